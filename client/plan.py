"""What one resumable stream sends next, and how it resumes after a lost server (docs/design.md §2.4).

`StreamPlan` is a stream's side of the contract without I/O: the frames handed to it, the last R
whose audio came back (`HistoryBuffer`), the sequence's base and URL. Its generator `exchange` yields
what to do (`Send` a request, or wait so many seconds), is sent the outcome (PCM or `RequestFailure`)
and returns the call's PCM; `sync` and `aio` drive it with their own I/O, so both follow its rules:

- frames go as deltas with `frame_offset` (or as the options say), START first, END last;
- a failure a resume can fix (`protocol.request_failure`, unless `options.resume` is False) STARTs
  the sequence again on the next URL with `frame_offset` o = max(0, n - R), `history_frames` n - o
  (the kept frames [o, n) in pieces of `resume_piece_frames`), then the unanswered frames from n.
  Attempts: at once, then after 0.1, 0.2, 0.4 ... 2 s, until `resume_timeout_s`;
- frames of a call abandoned before its answer stay owed: the next request carries them again at
  their offsets, and only the PCM of the calling frames is returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Sequence

import numpy as np

from .protocol import (
    NUM_CODEBOOKS,
    RESUME_BACKOFF_FIRST_S,
    RESUME_BACKOFF_MAX_S,
    SAMPLES_PER_FRAME,
    ClientError,
    RequestFailure,
    StreamOptions,
    checked_pcm,
    contract_arrays,
    draw_sequence_ids,
    validate_codes,
)


@dataclass(frozen=True)
class PlannedRequest:
    """One request: its tensors (batch dimension included), and its answer's frames of stream PCM,
    [first_new_frame, first_new_frame + new_frames)."""

    arrays: dict[str, np.ndarray]
    start: bool
    end: bool
    first_new_frame: int
    new_frames: int
    history_frames: int = 0  # a resume: leading frames of input_ids replayed to rebuild the decoder state
    maybe_decoded: int = 0  # leading new frames of an abandoned call: their PCM comes back if not decoded yet

    def describe(self) -> str:
        return f"frames [{self.first_new_frame}, {self.first_new_frame + self.new_frames})"

    @property
    def answer_frames(self) -> int | tuple[int, int]:
        """Frames of PCM the answer holds: exactly `new_frames`, or a range after an abandoned call."""
        if self.maybe_decoded:
            return self.new_frames - self.maybe_decoded, self.new_frames
        return self.new_frames


@dataclass(frozen=True)
class Resume:
    """One resume of a stream on a new sequence."""

    frame: int  # first frame whose PCM came from the resumed sequence (the resume point)
    stall_s: float  # last answered request (or the stream's first request) -> the resumed sequence's answer
    error: str  # the failure that started it, one line
    attempts: int  # resume requests sent, the last of them answered
    url: str  # the server that answered
    history_frames: int  # frames replayed to rebuild the decoder state

    def describe(self) -> str:
        return (f"resumed at frame {self.frame} on {self.url} after {self.stall_s:.2f} s "
                f"({self.attempts} attempt{'s' if self.attempts != 1 else ''}, {self.history_frames} frames "
                f"of history replayed): {self.error}")


class HistoryBuffer:
    """Codes kept for a resume, [k, frames] int64 from stream frame `first_frame`: the last
    `history_frames` answered frames, and every frame from `keep_from` on (for cumulative requests)."""

    def __init__(self, history_frames: int, num_codebooks: int = NUM_CODEBOOKS):
        self.history_frames = history_frames
        self._codes = np.zeros((num_codebooks, 0), np.int64)
        self.first_frame = 0

    @property
    def next_frame(self) -> int:
        """Frames appended so far: the stream index of the next frame."""
        return self.first_frame + self._codes.shape[1]

    def frames(self, first: int) -> np.ndarray:
        """Codes of stream frames [first, next_frame), [k, next_frame - first]."""
        if not self.first_frame <= first <= self.next_frame:
            raise ValueError(f"frame {first} is not kept (kept: [{self.first_frame}, {self.next_frame}))")
        return self._codes[:, first - self.first_frame :]

    def append(self, codes: np.ndarray, keep_from: int | None = None) -> None:
        """Append frames [k, n], then drop those before the last `history_frames` and `keep_from`."""
        self._codes = np.concatenate([self._codes, np.asarray(codes, np.int64)], axis=1)
        first = max(self.next_frame - self.history_frames, 0)
        if keep_from is not None:
            first = min(first, keep_from)
        first = max(first, self.first_frame)
        self._codes = self._codes[:, first - self.first_frame :].copy()
        self.first_frame = first


@dataclass(frozen=True)
class Send:
    """Send `request` to `url`; the outcome sent back is `model_outputs` or a RequestFailure."""

    request: PlannedRequest
    url: str


# What `exchange` asks its driver for: a request to send, or a wait in seconds (0: none).
Step = Generator["Send | float", "np.ndarray | RequestFailure | None", np.ndarray]


class StreamPlan:
    """One stream's requests and resumes, without I/O (see the module's docstring)."""

    def __init__(self, urls: str | Sequence[str], options: StreamOptions, sequence_id: int | None,
                 stream_key: str | None, clock: Callable[[], float]):
        options.validate()
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ClientError("a resumable stream needs at least one server URL")
        self.options = options
        self.sequence_id = draw_sequence_ids(1, None if sequence_id is None else [sequence_id])[0]
        self.stream_key = str(self.sequence_id) if stream_key is None else stream_key
        if not self.stream_key:
            raise ClientError("the stream key must not be empty")
        self._clock = clock
        self._url_index = 0
        self._kept = HistoryBuffer(options.resume_history_frames)
        self._owed = np.zeros((NUM_CODEBOOKS, 0), np.int64)  # handed frames whose audio has not come back
        self._owed_end = False  # the last call handed asked for END
        self._base = 0  # stream index of the current sequence's first frame
        self._needs_start = True  # the next request opens a sequence
        self.ended = False
        self._last_answer_s: float | None = None
        self.resumes: list[Resume] = []

    @property
    def url(self) -> str:
        """The server the stream's requests go to now."""
        return self.urls[self._url_index]

    @property
    def next_frame(self) -> int:
        """Frames whose PCM came back: the stream index of the next frame to send."""
        return self._kept.next_frame

    @property
    def handed_frames(self) -> int:
        """Frames handed to the stream so far, answered or not."""
        return self.next_frame + self._owed.shape[1]

    @property
    def needs_end(self) -> bool:
        """Closing sends an END: frames were handed, not ended, and a sequence is open or frames owed."""
        return not (self.ended or self.handed_frames == 0
                    or (self._needs_start and self.handed_frames == self.next_frame))

    def hand(self, codes: np.ndarray, end: bool) -> tuple[int, int]:
        """Take the next frames, codes [k, F] (F >= 1), owed until their audio comes back; returns
        their stream indices [first, stop)."""
        codes = validate_codes(codes)
        if self.ended or self._owed_end:
            raise ClientError(f"stream {self.stream_key}: decode() after the request that ended it")
        first = self.handed_frames
        self._owed, self._owed_end = np.concatenate([self._owed, codes], axis=1), end
        return first, first + codes.shape[1]

    def exchange(self, first: int, stop: int, end: bool) -> Step:
        """The PCM of handed frames [first, stop), float32 [(stop - first) * 1920], from a request (or
        resume) carrying every owed frame before `stop`, END with `end`. Nothing changes before the
        answer: an abandoned generator leaves the frames owed. Raises ClientError if not resumable
        or resuming timed out."""
        if self._last_answer_s is None:
            self._last_answer_s = self._clock()
        new = self._owed[:, : stop - self.next_frame]
        own_frames = stop - first
        requests = (self._resume_requests(new, end) if self._needs_start and self.next_frame
                    else [self._request(new, end, new.shape[1] - own_frames)])
        outcome = yield from self._send_all(requests)
        if isinstance(outcome, RequestFailure):
            self._needs_start = True
            if not outcome.resumable or not self.options.resume:
                raise ClientError(f"{self._where(requests[-1])}: {outcome}")
            outcome, requests = yield from self._resume(new, end, outcome)
        if requests[0].start:
            self._base = requests[0].first_new_frame - requests[0].history_frames
        self._kept.append(new, self._base if self.options.mode == "cumulative" else None)
        self._owed = self._owed[:, new.shape[1] :]
        self._needs_start = False
        self.ended = end
        self._last_answer_s = self._clock()
        return outcome[outcome.size - own_frames * SAMPLES_PER_FRAME :]

    def request(self, codes: np.ndarray, end: bool) -> PlannedRequest:
        """The request for the owed frames and then `codes` [k, F] on the current sequence."""
        return self._request(np.concatenate([self._owed, codes], axis=1), end, 0)

    def resume_requests(self, codes: np.ndarray, end: bool) -> list[PlannedRequest]:
        """A new sequence: the kept history in pieces of `options.resume_piece_frames` (a START, then
        history alone), the last piece with the owed frames and `codes` [k, F]. Short pieces keep a
        resume within the server's idle timeout however long the replay lane waits (design §2.4)."""
        return self._resume_requests(np.concatenate([self._owed, codes], axis=1), end)

    def _request(self, new: np.ndarray, end: bool, maybe_decoded: int) -> PlannedRequest:
        first = self.next_frame
        if self.options.mode == "cumulative":
            sent_from, sent = self._base, np.concatenate([self._kept.frames(self._base), new], axis=1)
        else:
            sent_from, sent = first, new
        arrays = contract_arrays(sent, sent_from if self.options.send_frame_offset else None)
        return PlannedRequest(arrays, self._needs_start, end, first, new.shape[1],
                              maybe_decoded=0 if self._needs_start else maybe_decoded)

    def _resume_requests(self, new: np.ndarray, end: bool) -> list[PlannedRequest]:
        history_from = max(self._kept.first_frame, self.next_frame - self.options.resume_history_frames, 0)
        history = self._kept.frames(history_from)
        piece = self.options.resume_piece_frames
        last = max(history.shape[1] - 1, 0) // piece * piece  # the last piece, which carries the new frames
        requests = []
        for done in range(0, last + 1, piece):
            codes = history[:, done : done + piece] if done < last else np.concatenate([history[:, done:], new], axis=1)
            history_frames = min(piece, history.shape[1] - done)
            requests.append(PlannedRequest(
                contract_arrays(codes, history_from + done, history_frames), not requests, end and done == last,
                history_from + done + history_frames, new.shape[1] if done == last else 0, history_frames))
        return requests

    def _where(self, request: PlannedRequest) -> str:
        return f"stream {self.stream_key} (sequence {self.sequence_id}), {request.describe()} on {self.url}"

    def _send_all(self, requests: list[PlannedRequest]) -> Step:
        """Send `requests` in order; returns the last one's PCM, or the RequestFailure that stopped them."""
        for request in requests:
            outcome = yield Send(request, self.url)
            if isinstance(outcome, RequestFailure):
                return outcome
            pcm = checked_pcm(outcome, request.answer_frames, self._where(request))
        return pcm

    def _resume(self, new: np.ndarray, end: bool, failure: RequestFailure) -> Step:
        """Resume until one answers or the resume timeout passes; returns (PCM, the requests sent)."""
        deadline_s = self._clock() + self.options.resume_timeout_s
        last, attempts = failure, 0
        while True:
            wait_s = 0.0 if attempts == 0 else min(RESUME_BACKOFF_MAX_S, RESUME_BACKOFF_FIRST_S * 2 ** (attempts - 1))
            if self._clock() + wait_s > deadline_s:
                raise ClientError(
                    f"stream {self.stream_key} (sequence {self.sequence_id}) could not resume at frame "
                    f"{self.next_frame} within {self.options.resume_timeout_s:g} s ({attempts} attempt"
                    f"{'s' if attempts != 1 else ''} on {', '.join(self.urls)}): it failed with {failure}"
                    + (f"; last error: {last}" if str(last) != str(failure) else ""))
            yield wait_s
            self._url_index = (self._url_index + 1) % len(self.urls)
            attempts += 1
            requests = self._resume_requests(new, end)
            outcome = yield from self._send_all(requests)
            if isinstance(outcome, RequestFailure):
                if not outcome.resumable:
                    raise ClientError(
                        f"stream {self.stream_key} (sequence {self.sequence_id}): resuming at frame "
                        f"{self.next_frame} on {self.url} failed: {outcome}")
                last = outcome
                continue
            self.resumes.append(Resume(
                frame=self.next_frame, stall_s=self._clock() - self._last_answer_s, error=str(failure),
                attempts=attempts, url=self.url, history_frames=sum(r.history_frames for r in requests)))
            return outcome, requests


class PlannedStream:
    """What both clients' streams show of their `StreamPlan` (`_plan`), read-only; `stream_key` is the
    `code2wav-stream` header's value, `next_frame` the frames whose PCM came back."""

    _plan: StreamPlan

    sequence_id = property(lambda self: self._plan.sequence_id)
    stream_key = property(lambda self: self._plan.stream_key)
    url = property(lambda self: self._plan.url)
    next_frame = property(lambda self: self._plan.next_frame)
    ended = property(lambda self: self._plan.ended)
    resumes = property(lambda self: self._plan.resumes)
