"""What code2wav keeps per live stream: the codes it has decoded (`DecodedCodes`) and the stream
table's entry around them (`StreamEntry`). Pure numpy."""

from __future__ import annotations

from typing import Optional

import numpy as np


class DecodedCodes:
    """The codes of the frames a stream has decoded, [k, frames]: int16 when the codebook fits (2048
    entries: ~720 KB per hour of audio), in a buffer grown geometrically (appending is amortised O(new))."""

    _INITIAL_CAPACITY = 64

    def __init__(self, num_codebooks: int, codebook_size: int):
        dtype = np.int16 if codebook_size <= np.iinfo(np.int16).max + 1 else np.int32
        self._codes = np.zeros((num_codebooks, self._INITIAL_CAPACITY), dtype=dtype)
        self._frames = 0

    @property
    def frames(self) -> int:
        return self._frames

    def codes(self) -> np.ndarray:
        """The decoded frames' codes [k, frames] (a read-only view)."""
        view = self._codes[:, : self._frames]
        view.flags.writeable = False
        return view

    def append(self, codes: np.ndarray) -> None:
        """Append frames [k, n] (values already validated to fit the dtype)."""
        needed = self._frames + codes.shape[1]
        if needed > self.capacity:
            grown = np.zeros((self._codes.shape[0], max(needed, 2 * self.capacity)), self._codes.dtype)
            grown[:, : self._frames] = self._codes[:, : self._frames]
            self._codes = grown
        self._codes[:, self._frames : needed] = codes
        self._frames = needed

    # Storage, for tests and memory accounting.
    @property
    def capacity(self) -> int:
        return self._codes.shape[1]

    @property
    def dtype(self) -> np.dtype:
        return self._codes.dtype

    def first_mismatch(self, codes: np.ndarray, start: int) -> Optional[int]:
        """Compare `codes` [k, m] with decoded frames [start, start + m) (all of which exist); return
        the index within `codes` of the first differing frame, or None when all m are equal."""
        width = codes.shape[1]
        differs = (self._codes[:, start : start + width] != codes).any(axis=0)
        mismatches = np.flatnonzero(differs)
        return int(mismatches[0]) if mismatches.size else None


class StreamEntry:
    """The stream table's entry of one live stream."""

    __slots__ = ("decoded", "base", "decoder_live", "needs_decoder_start", "last_active_s")

    def __init__(self, decoded: DecodedCodes, now_s: float, base: int = 0):
        self.decoded = decoded
        # Stream index of the first frame in `decoded`: 0, or where a resumed stream was started.
        self.base = base
        # The decoder holds a sequence for this correlation id (it got a START and no END yet).
        self.decoder_live = False
        # The next decoder step must carry START: the stream is new or was reset (barge-in).
        self.needs_decoder_start = True
        self.last_active_s = now_s

    @property
    def next_frame(self) -> int:
        """Stream index of the stream's next frame: the frames it has decoded, counted from 0."""
        return self.base + self.decoded.frames
