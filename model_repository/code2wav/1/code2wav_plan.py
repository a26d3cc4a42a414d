"""What code2wav keeps per live stream, and planning one request against it (docs/design.md §2): validation,
dedupe (§2.1), resume (§2.4), limits, then its decoder calls, before anything changes. Pure numpy. Every
check raises RequestError naming the value, the limit and the parameter."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import numpy as np

from code2wav_settings import FLAG_SEQUENCE_END, FLAG_SEQUENCE_START, Code2WavSettings, RequestError


class DecodedCodes:
    """The codes of the frames a stream has decoded, [k, frames]: int16 when the codebook fits (~720 KB per hour
    of audio), in a buffer grown geometrically (appending is amortised O(new))."""

    def __init__(self, num_codebooks: int, codebook_size: int):
        dtype = np.int16 if codebook_size <= np.iinfo(np.int16).max + 1 else np.int32
        self._codes = np.zeros((num_codebooks, 64), dtype=dtype)
        self.frames = 0

    def codes(self) -> np.ndarray:
        """The decoded frames' codes [k, frames] (a read-only view)."""
        view = self._codes[:, : self.frames]
        view.flags.writeable = False
        return view

    def append(self, codes: np.ndarray) -> None:
        """Append frames [k, n] (values already validated to fit the dtype)."""
        needed, capacity = self.frames + codes.shape[1], self._codes.shape[1]
        if needed > capacity:
            grown = np.zeros((self._codes.shape[0], max(needed, 2 * capacity)), self._codes.dtype)
            grown[:, : self.frames] = self._codes[:, : self.frames]
            self._codes = grown
        self._codes[:, self.frames : needed] = codes
        self.frames = needed

    def first_mismatch(self, codes: np.ndarray, start: int) -> Optional[int]:
        """Index in `codes` [k, m] of the first frame that differs from decoded frame start + i, or None."""
        differs = (self._codes[:, start : start + codes.shape[1]] != codes).any(axis=0)
        mismatches = np.flatnonzero(differs)
        return int(mismatches[0]) if mismatches.size else None


class StreamEntry:
    """The stream table's entry of one live stream."""

    __slots__ = ("decoded", "base", "decoder_live", "needs_decoder_start", "last_active_s")

    def __init__(self, decoded: DecodedCodes, now_s: float, base: int = 0):
        self.decoded = decoded
        self.base = base  # stream index of decoded's first frame: 0, or where a resumed stream started
        self.decoder_live = False  # the decoder holds a sequence for this id (a START, no END yet)
        self.needs_decoder_start = True  # the next decoder step carries START: a new or reset (barge-in) stream
        self.last_active_s = now_s

    @property
    def next_frame(self) -> int:
        """Stream index of the stream's next frame."""
        return self.base + self.decoded.frames


@dataclasses.dataclass(frozen=True, eq=False)
class StreamRequest:
    """One request as the core sees it: Triton's correlation id and flags, its inputs (None when absent)."""

    correlation_id: int
    flags: int
    input_ids: np.ndarray
    frame_offset: Optional[np.ndarray] = None
    history_frames: Optional[np.ndarray] = None


@dataclasses.dataclass(frozen=True, eq=False)
class DecoderStep:
    """One decoder call: `codes` int32 [1, k, S] (C-contiguous), sequence `flags`, whether its PCM is thrown
    away (the END-only step) and whether it replays history (it then takes the replay lane)."""

    codes: np.ndarray
    flags: int
    discard_output: bool = False
    replay: bool = False

    @property
    def frames(self) -> int:
        return self.codes.shape[2]


@dataclasses.dataclass(frozen=True, eq=False)
class DecodePlan:
    """What one validated request does: run the steps in order, then `StreamTable.commit(plan)`."""

    correlation_id: int
    new_codes: np.ndarray  # the new frames, int32 [k, N], N may be 0: their PCM is the response
    steps: Tuple[DecoderStep, ...]
    starts_stream: bool  # START: the stream is created, or reset if it was live (barge-in)
    ends_stream: bool  # END: the stream is removed once the steps succeeded
    # Resume: the frames replayed before new_codes to rebuild the decoder state, int32 [k, H]; the
    # steps decode them first and their PCM is dropped. None without history_frames.
    history_codes: Optional[np.ndarray] = None
    resumes_stream: bool = False  # history_frames with START: a resumed stream whose first frame is `base`
    base: int = 0  # stream index of the stream's first held frame once the plan is committed
    # The table entry the plan was made against (None for a new stream): commit checks it is unchanged.
    entry: Optional[StreamEntry] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def new_frames(self) -> int:
        return self.new_codes.shape[1]

    @property
    def history_frames(self) -> int:
        return 0 if self.history_codes is None else self.history_codes.shape[1]


def plan_request(settings: Code2WavSettings, entry: Optional[StreamEntry], request: StreamRequest) -> DecodePlan:
    """Validate a request of the stream whose entry is `entry` (None: not live) and plan its decoding."""
    correlation_id = request.correlation_id
    if isinstance(correlation_id, bool) or not isinstance(correlation_id, int) or correlation_id <= 0:
        raise RequestError("correlation_id",
                           f"requests need a non-zero integer correlation id (one per stream), got {correlation_id!r}")
    starts = bool(request.flags & FLAG_SEQUENCE_START)
    ends = bool(request.flags & FLAG_SEQUENCE_END)
    history_frames = read_scalar_input(request.history_frames, "history_frames")
    if entry is None and not starts:
        raise RequestError("unknown_stream", f"stream {correlation_id} is not open: send the first request of the "
                           "sequence with the START flag (a stream ends with END, with a decoder error, or after "
                           f"{settings.stream_idle_timeout_s:g} s idle)")
    codes = validated_codes(settings, request.input_ids)
    request_frames = codes.shape[1]
    offset = read_scalar_input(request.frame_offset, "frame_offset")

    if history_frames is None:
        continuing = entry if not starts else None
        base = continuing.base if continuing is not None else 0
        first_new = first_new_frame(settings, correlation_id, codes, offset,
                                    None if continuing is None else continuing.decoded, base)
        first_decoded = first_new
    else:
        base = resume_base(correlation_id, history_frames, offset, request_frames, None if starts else entry)
        first_new, first_decoded = history_frames, 0
    new_frames, limit = request_frames - first_new, settings.max_new_frames_per_request
    if (history_frames or 0) + new_frames > limit:  # replayed history counts: the decoder runs it too
        decodes = (f"decodes {history_frames + new_frames} frames ({history_frames} history_frames + {new_frames} new)"
                   if history_frames else f"has {new_frames} new frames")
        raise RequestError("limit", f"request {decodes}, more than max_new_frames_per_request={limit}")
    # The frames this request decodes: the history, if any, then the new frames.
    to_decode = codes[:, first_decoded:].astype(np.int32)

    needs_start = starts or entry is None or entry.needs_decoder_start
    # History frames get steps of their own (replay steps), which take the replay lane.
    replay_steps = decoder_steps(settings, to_decode[:, :history_frames], needs_start,
                                 ends and history_frames == to_decode.shape[1], replay=True) if history_frames else ()
    steps = replay_steps + decoder_steps(settings, to_decode[:, history_frames or 0 :],
                                         needs_start and not replay_steps, ends)
    if ends and to_decode.shape[1] == 0 and entry is not None and entry.decoder_live:
        # Close the decoder's sequence for this id (a START without END reached it) with one step of zero
        # codes; without one (e.g. START|END with no frame) nothing is sent.
        steps += (DecoderStep(zero_step_codes(settings), FLAG_SEQUENCE_END, discard_output=True),)

    return DecodePlan(
        correlation_id=correlation_id, new_codes=to_decode[:, first_new - first_decoded :], steps=steps,
        starts_stream=starts, ends_stream=ends,
        history_codes=None if history_frames is None else to_decode[:, :history_frames],
        resumes_stream=history_frames is not None and starts, base=base, entry=entry,
    )


def validated_codes(settings: Code2WavSettings, input_ids: np.ndarray) -> np.ndarray:
    """`input_ids` INT64 [1, k*F] (or [k*F]), codebook-major -> codes int64 [k, F] (a view), checked."""
    input_ids, num_codebooks, codebook_size = np.asarray(input_ids), settings.num_codebooks, settings.codebook_size
    if input_ids.dtype != np.int64:
        raise RequestError("dtype", f"input_ids must be INT64, got {input_ids.dtype}")
    if not (input_ids.ndim == 1 or (input_ids.ndim == 2 and input_ids.shape[0] == 1)):
        raise RequestError("shape", f"input_ids must have shape [1, k*F] (one request of flat codes), "
                                    f"got {list(input_ids.shape)}")
    flat = input_ids.reshape(-1)
    if flat.size % num_codebooks:
        raise RequestError("length",
                           f"input_ids holds {flat.size} codes, not a multiple of num_codebooks={num_codebooks}")
    frames = flat.size // num_codebooks
    if frames > settings.max_request_frames:
        raise RequestError("limit", f"request holds {frames} frames, more than "
                                    f"max_request_frames={settings.max_request_frames}")
    if flat.size and (flat.min() < 0 or flat.max() >= codebook_size):
        position = int(np.flatnonzero((flat < 0) | (flat >= codebook_size))[0])
        raise RequestError("code_range", f"input_ids[{position}] = {int(flat[position])} (codebook {position // frames}, "
                           f"frame {position % frames}) is outside [0, {codebook_size}) (codebook_size={codebook_size})")
    return flat.reshape(num_codebooks, frames)


def read_scalar_input(array: Optional[np.ndarray], name: str) -> Optional[int]:
    """An optional INT64 [1, 1] input (`frame_offset`, `history_frames`) -> int, or None when absent."""
    if array is None:
        return None
    array = np.asarray(array)
    if array.dtype != np.int64:
        raise RequestError("dtype", f"{name} must be INT64, got {array.dtype}")
    if array.size != 1:
        raise RequestError("shape", f"{name} must hold one value ([1, 1]), got shape {list(array.shape)}")
    return int(array.reshape(-1)[0])


def _check_offset_not_negative(offset: int) -> None:
    if offset < 0:
        raise RequestError("negative_offset", f"frame_offset must be >= 0, got {offset}")


def first_new_frame(settings: Code2WavSettings, correlation_id: int, codes: np.ndarray, offset: Optional[int],
                    decoded: Optional[DecodedCodes], base: int = 0) -> int:
    """Index in the request (codes [k, F]) of its first frame to decode (docs/design.md §2.1). `decoded` holds
    the stream's frames from `base` on (None: it starts here); a request without offset is read against them."""
    held, request_frames = 0 if decoded is None else decoded.frames, codes.shape[1]
    if offset is not None:
        _check_offset_not_negative(offset)
        if offset < base:
            raise RequestError("before_resume", f"frame_offset {offset} is before frame {base}, where stream "
                               f"{correlation_id} was resumed on this server: frames before {base} are not held here "
                               f"and cannot be compared; send frames from {base} on")
        if offset > base + held:
            raise RequestError("gap", f"frame_offset {offset} leaves a gap: stream {correlation_id} has decoded "
                                      f"{base + held} frames, so frame_offset must be at most {base + held}")
        overlap = min(base + held - offset, request_frames)
        if overlap > 0:
            _check_unchanged(correlation_id, codes[:, :overlap], decoded, offset - base, base)
        return overlap
    mode = settings.dedupe_mode
    if mode == "delta" or held == 0:
        return 0
    if mode == "cumulative":
        if request_frames < held:
            since = f" since frame {base}, where it was resumed on this server" if base else ""
            raise RequestError("not_cumulative", f"dedupe_mode=cumulative: the request holds {request_frames} frames "
                               f"but stream {correlation_id} has decoded {held}{since}; a cumulative request starts "
                               "with all of them")
        _check_unchanged(correlation_id, codes[:, :held], decoded, 0, base)
        return held
    # auto: a resend if it starts with every held frame, else a delta
    if request_frames >= held and decoded.first_mismatch(codes[:, :held], 0) is None:
        return held
    return 0


def _check_unchanged(correlation_id: int, codes: np.ndarray, decoded: DecodedCodes, start: int, base: int) -> None:
    """Compare `codes` with held frames [start, start + m) of `decoded` (`base` + held index: stream index)."""
    mismatch = decoded.first_mismatch(codes, start)
    if mismatch is not None:
        raise RequestError("changed_frame", f"frame {base + start + mismatch} differs from the frame stream "
                           f"{correlation_id} already decoded at that index; decoded frames cannot change (START a "
                           "new sequence instead)")


def resume_base(correlation_id: int, history_frames: int, offset: Optional[int], request_frames: int,
                continuing: Optional[StreamEntry]) -> int:
    """The stream's base after a request with history_frames (docs/design.md §2.4): a START (`continuing` None)
    opens it at frame_offset (or 0); a later piece of the resume must start at the stream's next frame."""
    if not 0 <= history_frames <= request_frames:
        raise RequestError("history", f"history_frames={history_frames} must lie in [0, {request_frames}]: the "
                           f"request holds {request_frames} frames and its first history_frames of them are the "
                           f"replayed history (stream {correlation_id})")
    if continuing is not None:
        if offset != continuing.next_frame:
            raise RequestError("history_offset", f"history_frames={history_frames} on a continuing stream needs "
                               f"frame_offset={continuing.next_frame}, the stream's next frame (got {offset}): history "
                               f"is decoded once, after the frames stream {correlation_id} holds")
        return continuing.base
    if offset is None:
        if history_frames:
            raise RequestError("history", f"history_frames={history_frames} needs frame_offset, the stream index of "
                               "the request's first frame, to place the history in the stream "
                               f"(stream {correlation_id})")
        return 0
    _check_offset_not_negative(offset)
    return offset


def decoder_steps(settings: Code2WavSettings, codes: np.ndarray, needs_start: bool, ends: bool,
                  replay: bool = False) -> Tuple[DecoderStep, ...]:
    """Frames [k, N] in full decoder calls, the remainder last (equal requests give equal calls, which the decoder
    batches); history (`replay`) in calls of replay_step_frames. START first if needed, END last."""
    total, per_step = codes.shape[1], settings.decoder_max_frames_per_step
    if replay:
        per_step = min(settings.replay_step_frames, per_step)
    return tuple(DecoderStep(np.ascontiguousarray(codes[None, :, first : first + per_step]),
                             (FLAG_SEQUENCE_START if first == 0 and needs_start else 0)
                             | (FLAG_SEQUENCE_END if first + per_step >= total and ends else 0), replay=replay)
                 for first in range(0, total, per_step))


def zero_step_codes(settings: Code2WavSettings) -> np.ndarray:
    """The codes of an END-only step (its output is discarded): one frame of zeros, int32 [1, k, 1]."""
    return np.zeros((1, settings.num_codebooks, 1), np.int32)
