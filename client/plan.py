"""What a stream sends next and how it resumes after a lost server (docs/design.md §2.4), without I/O."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

import numpy as np

from . import protocol
from .protocol import NUM_CODEBOOKS, ClientError, RequestFailure, StreamOptions

RESUME_BACKOFF_FIRST_S, RESUME_BACKOFF_MAX_S = 0.1, 2.0  # waits between resume attempts, doubling


@dataclass(frozen=True)
class PlannedRequest:
    """One request's tensors; its answer holds the PCM of frames [first_new_frame, first_new_frame + new_frames)."""

    arrays: dict[str, np.ndarray]
    start: bool
    end: bool
    first_new_frame: int
    new_frames: int
    history_frames: int = 0  # a resume: leading frames of input_ids replayed to rebuild the decoder state
    maybe_decoded: int = 0  # leading new frames of an abandoned call: their PCM comes back if not decoded yet


@dataclass(frozen=True)
class Resume:
    """One resume of a stream on a new sequence."""

    frame: int  # first frame whose PCM came from the resumed sequence
    stall_s: float  # last answer (or the stream's first request) -> the resumed sequence's answer
    error: str  # the failure that started it, one line
    attempts: int  # resume requests sent, the last of them answered
    url: str  # the server that answered
    history_frames: int  # frames replayed to rebuild the decoder state

    def describe(self) -> str:
        return (f"resumed at frame {self.frame} on {self.url} after {self.stall_s:.2f} s "
                f"({self.attempts} attempt{'s' if self.attempts != 1 else ''}, {self.history_frames} frames "
                f"of history replayed): {self.error}")


# What `exchange` asks its driver for: a request to `url` (answered: InferResult or RequestFailure), or a wait (s).
Step = Generator["PlannedRequest | float", "object | RequestFailure | None", np.ndarray]


class StreamPlan:
    """One stream's requests, START first, END last. A resumable failure STARTs a new sequence on the next URL with
    the last frames as history, then the unanswered ones: at once, then after 0.1, 0.2 ... 2 s, until the timeout."""

    def __init__(self, urls: list[str], options: StreamOptions, sequence_id: int | None, stream_key: str | None,
                 clock: Callable[[], float]):
        self.urls, self.options, self._clock, self._url_index = urls, options, clock, 0
        self.sequence_id = protocol.draw_sequence_ids(1, None if sequence_id is None else [sequence_id])[0]
        self.stream_key = str(self.sequence_id) if stream_key is None else stream_key
        if not self.stream_key:
            raise ClientError("the stream key must not be empty")
        # Answered codes kept for a resume (the last `resume_history_frames`; cumulative: from `_base` on).
        self._kept, self._kept_from = np.zeros((NUM_CODEBOOKS, 0), np.int64), 0
        self._owed = np.zeros((NUM_CODEBOOKS, 0), np.int64)  # handed frames whose audio has not come back
        self._owed_end = False  # the last call handed asked for END
        self._base = 0  # stream index of the current sequence's first frame
        self._needs_start = True  # the next request opens a sequence
        self.ended = False
        self._last_answer_s: float | None = None
        self.resumes: list[Resume] = []

    @property
    def url(self) -> str:
        return self.urls[self._url_index]

    @property
    def next_frame(self) -> int:  # frames whose PCM came back
        return self._kept_from + self._kept.shape[1]

    @property
    def handed_frames(self) -> int:  # answered or not
        return self.next_frame + self._owed.shape[1]

    @property
    def needs_end(self) -> bool:
        """Closing sends an END: frames were handed, not ended, and a sequence is open or frames owed."""
        return not (self.ended or self.handed_frames == 0
                    or (self._needs_start and self.handed_frames == self.next_frame))

    def hand(self, codes: np.ndarray, end: bool) -> tuple[int, int]:
        """Take codes [k, F], owed until their audio comes back; returns their frames [first, stop)."""
        codes = protocol.validate_codes(codes)
        if self.ended or self._owed_end:
            raise ClientError(f"stream {self.stream_key}: decode() after the request that ended it")
        first = self.handed_frames
        self._owed, self._owed_end = np.concatenate([self._owed, codes], axis=1), end
        return first, first + codes.shape[1]

    def exchange(self, first: int, stop: int, end: bool) -> Step:
        """The PCM of handed frames [first, stop) from a request (or resume) carrying every owed frame before `stop`;
        nothing changes before the answer (an abandoned generator leaves them owed). ClientError if it cannot."""
        if self._last_answer_s is None:
            self._last_answer_s = self._clock()
        new = self._owed[:, : stop - self.next_frame]
        own_frames = stop - first
        requests = (self.resume_requests(new, end) if self._needs_start and self.next_frame
                    else [self.request(new, end, new.shape[1] - own_frames)])
        outcome = yield from self._send_all(requests)
        if isinstance(outcome, RequestFailure):
            self._needs_start = True
            if not outcome.resumable or not self.options.resume:
                raise ClientError(f"{self._where(requests[-1])}: {outcome}")
            outcome, requests = yield from self._resume(new, end, outcome)
        if requests[0].start:
            self._base = requests[0].first_new_frame - requests[0].history_frames
        self._kept = np.concatenate([self._kept, new], axis=1)
        keep_from = max(self.next_frame - self.options.resume_history_frames, 0)
        keep_from = max(min(keep_from, self._base) if self.options.mode == "cumulative" else keep_from, self._kept_from)
        self._kept, self._kept_from = self._kept[:, keep_from - self._kept_from :].copy(), keep_from
        self._owed = self._owed[:, new.shape[1] :]
        self._needs_start, self.ended, self._last_answer_s = False, end, self._clock()
        return outcome[outcome.size - own_frames * protocol.SAMPLES_PER_FRAME :]

    def request(self, new: np.ndarray, end: bool, maybe_decoded: int = 0) -> PlannedRequest:
        """The request for frames `new` [k, F] from `next_frame` on the current sequence."""
        first = self.next_frame
        if self.options.mode == "cumulative":
            sent_from, sent = self._base, np.concatenate([self._kept[:, self._base - self._kept_from :], new], axis=1)
        else:
            sent_from, sent = first, new
        arrays = protocol.contract_arrays(sent, sent_from if self.options.send_frame_offset else None)
        return PlannedRequest(arrays, self._needs_start, end, first, new.shape[1],
                              maybe_decoded=0 if self._needs_start else maybe_decoded)

    def resume_requests(self, new: np.ndarray, end: bool) -> list[PlannedRequest]:
        """A new sequence: the kept history in pieces of `resume_piece_frames` (START first), the last with `new`."""
        history_from = max(self._kept_from, self.next_frame - self.options.resume_history_frames, 0)
        history = self._kept[:, history_from - self._kept_from :]
        piece = self.options.resume_piece_frames
        last = max(history.shape[1] - 1, 0) // piece * piece  # the last piece, which carries the new frames
        requests = []
        for done in range(0, last + 1, piece):
            codes = history[:, done : done + piece] if done < last else np.concatenate([history[:, done:], new], axis=1)
            history_frames = min(piece, history.shape[1] - done)
            requests.append(PlannedRequest(protocol.contract_arrays(codes, history_from + done, history_frames),
                                           not requests, end and done == last, history_from + done + history_frames,
                                           new.shape[1] if done == last else 0, history_frames))
        return requests

    def _where(self, request: PlannedRequest) -> str:
        frames = f"[{request.first_new_frame}, {request.first_new_frame + request.new_frames})"
        return f"stream {self.stream_key} (sequence {self.sequence_id}), frames {frames} on {self.url}"

    def _send_all(self, requests: list[PlannedRequest]) -> Step:
        """Send `requests` in order; returns the last one's PCM, or the RequestFailure that stopped them."""
        for request in requests:
            outcome = yield request
            if isinstance(outcome, RequestFailure):
                return outcome
            pcm = protocol.answer_pcm(outcome, request.new_frames - request.maybe_decoded, request.new_frames,
                             self._where(request))
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
            requests = self.resume_requests(new, end)
            outcome = yield from self._send_all(requests)
            if not isinstance(outcome, RequestFailure):
                self.resumes.append(Resume(
                    frame=self.next_frame, stall_s=self._clock() - self._last_answer_s, error=str(failure),
                    attempts=attempts, url=self.url, history_frames=sum(r.history_frames for r in requests)))
                return outcome, requests
            if not outcome.resumable:
                raise ClientError(f"stream {self.stream_key} (sequence {self.sequence_id}): resuming at frame "
                                  f"{self.next_frame} on {self.url} failed: {outcome}")
            last = outcome


class PlannedClient:
    """What both clients check first: one or more URLs (to fail over between), options and credentials."""

    stream_type: type

    def __init__(self, urls: str | Sequence[str], options: StreamOptions, credentials, clock=time.monotonic):
        options.validate()
        credentials.validate()
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ClientError("the client needs at least one server URL")
        self.options, self.credentials, self._clock = options, credentials, clock

    def stream(self, stream_key: str | None = None, sequence_id: int | None = None):
        """A new stream; `sequence_id` (non-zero) defaults to random, `stream_key` to it in decimal."""
        return self.stream_type(self, sequence_id, stream_key)


class PlannedStream:
    """What both clients' streams show of their `StreamPlan` (`stream_key`: the `code2wav-stream` header)."""

    def __init__(self, client: PlannedClient, sequence_id: int | None, stream_key: str | None):
        self._plan = StreamPlan(client.urls, client.options, sequence_id, stream_key, client._clock)
        self._client = client

    sequence_id = property(lambda self: self._plan.sequence_id)
    stream_key = property(lambda self: self._plan.stream_key)
    url = property(lambda self: self._plan.url)
    next_frame = property(lambda self: self._plan.next_frame)
    ended = property(lambda self: self._plan.ended)
    resumes = property(lambda self: self._plan.resumes)

    def _infer_args(self, grpc_module, request: PlannedRequest) -> dict:
        options = self._client.options
        return dict(model_name=options.model_name, inputs=protocol.infer_inputs(grpc_module, request.arrays),
                    sequence_id=self.sequence_id, sequence_start=request.start, sequence_end=request.end,
                    headers={**self._client.credentials.headers(), protocol.STREAM_KEY_HEADER: self.stream_key},
                    client_timeout=options.response_timeout_s)
