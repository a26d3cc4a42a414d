"""Core of the `code2wav` BLS model: everything that is not Triton plumbing.

Pure numpy + stdlib (no `triton_python_backend_utils`), so it is unit-tested without a server and runs
on the Python 3.10 of the NGC 24.10 image as well as 3.11. It imports `triton_streams` (stdlib only),
which `export/render.py` copies beside it from model_repository/common/.

What it does, per request of a stream (one Triton sequence, keyed by its correlation id):

1. unflatten `input_ids` ([1, k*F] INT64, codebook-major) into codes [k, F] and validate them
   (dtype, length, code range, request-size limit);
2. dedupe against the frames the stream has already decoded (its history), with or without
   `frame_offset` (see `StreamTable.plan`), and apply the new-frames limit;
3. return a `DecodePlan`: the new frames in as few decoder calls as the decoder takes (int32
   [1, k, S], S <= decoder_max_frames_per_step: one call for most requests) with the START/END
   flags each call carries;
4. after the decoder ran every step, `StreamTable.commit` records the frames in the history (or
   removes the stream on END); after a decoder failure `StreamTable.abort` removes the stream.

Resume by replay: a START request may carry `history_frames` H with `frame_offset` o. Its F frames
are stream frames [o, o + F); the first H are decoded only to rebuild the decoder state (their PCM is
not returned), so a stream whose server was lost continues on another one. The resumed stream holds
frames from o (its base) on and counts frames in absolute stream indices (see `StreamTable.plan`).

`StreamTable.submit` drives all of it for one request with an injected async `decode_step`, each
stream's requests in order and the streams independently, so the whole request path, decoder
ordering included, is tested here.

A request is validated completely before anything changes: a rejected request leaves its stream as
it was, unless it carried END (Triton releases the sequence with it, so the stream ends and its
decoder sequence gets a discarded END step). Idle time runs from the last decoder step, so requests
that decode nothing cannot keep a stream past the decoder's own idle timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from triton_streams import IDLE_TIMEOUT_FIELD, ConfigError, ModelError, read_parameters

# Same values as pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END (Triton's C API).
FLAG_SEQUENCE_START = 1
FLAG_SEQUENCE_END = 2

# A replay step waits up to this long for the live steps in the decoder to finish (ReplayLane).
REPLAY_WAIT_FOR_IDLE_S = 0.1
# Replay steps in flight while no live step has run for LIVE_QUIET_S (ReplayLane): a full run of the
# python-ort decoder, for an instance whose streams are all resuming (a restarted server).
REPLAY_STEPS_WHEN_IDLE = 8
LIVE_QUIET_S = 1.0
IDLE_GRACE_S = 1.0  # streams expire this long after the idle timeout (see StreamTable.expire_idle)
DEDUPE_MODES = ("auto", "delta", "cumulative")

# Every kind an error can be counted under (the `kind` label of code2wav_errors_total).
ERROR_KINDS = (
    "dtype",
    "shape",
    "length",
    "code_range",
    "limit",
    "negative_offset",
    "gap",
    "changed_frame",
    "not_cumulative",
    "history",
    "before_resume",
    "correlation_id",
    "unknown_stream",
    "stream_cap",
    "unavailable",
    "decoder",
    "internal",
)

_INT32_MAX = 2**31 - 1


class RequestError(ModelError):
    """The request is invalid (the client's fault); nothing was decoded and the stream is unchanged.
    `kind` is one of ERROR_KINDS."""

    def __init__(self, kind: str, message: str):
        super().__init__(kind, message, "INVALID_ARG")


class DecoderError(ModelError):
    """A decoder step failed; raised by the decoder helper with the decoder's message. Kind and
    code: `decoder` / INTERNAL, unless the decoder refused a new stream for lack of room
    (`stream_cap`) or the server is shutting down (`unavailable`), both UNAVAILABLE: the client
    may retry, here later or on another server."""

    def __init__(self, message: str, code: str = "INTERNAL", kind: str = "decoder"):
        super().__init__(kind, message, code)


class StreamCapError(ModelError):
    """A START for a new stream while the instance holds `max_live_streams`: refused, nothing changed."""

    def __init__(self, message: str):
        super().__init__("stream_cap", message, "UNAVAILABLE")


# --------------------------------------------------------------------------------------------------
# Settings


@dataclasses.dataclass(frozen=True)
class Code2WavSettings:
    """Everything the core needs from the model config. The defaults are the shipped config.pbtxt."""

    decoder_model_name: str = "mimi_decoder"
    num_codebooks: int = 8
    codebook_size: int = 2048
    samples_per_frame: int = 1920
    sample_rate_hz: int = 24000
    decoder_max_frames_per_step: int = 16
    dedupe_mode: str = "auto"
    max_new_frames_per_request: int = 1500
    max_request_frames: int = 45000
    max_live_streams: int = 1024
    replay_steps_in_flight: int = 1
    replay_step_frames: int = 4
    stream_idle_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.decoder_model_name, str) or not self.decoder_model_name.strip():
            raise ConfigError("decoder_model_name", "must be a non-empty model name")
        for name in (
            "num_codebooks",
            "codebook_size",
            "samples_per_frame",
            "sample_rate_hz",
            "decoder_max_frames_per_step",
            "max_new_frames_per_request",
            "max_request_frames",
            "max_live_streams",
            "replay_steps_in_flight",
            "replay_step_frames",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        # The decoder takes int32 codes.
        if self.codebook_size > _INT32_MAX:
            raise ConfigError("codebook_size", f"must be at most {_INT32_MAX}, got {self.codebook_size}")
        if self.dedupe_mode not in DEDUPE_MODES:
            raise ConfigError(
                "dedupe_mode", f"must be one of {', '.join(DEDUPE_MODES)}, got {self.dedupe_mode!r}"
            )
        if not self.stream_idle_timeout_s > 0:
            raise ConfigError(IDLE_TIMEOUT_FIELD, f"must be positive, got {self.stream_idle_timeout_s!r}")


# The config's `parameters`: name -> parser of its string value.
PARAMETER_TYPES = {
    "decoder_model_name": str,
    "num_codebooks": int,
    "codebook_size": int,
    "samples_per_frame": int,
    "sample_rate_hz": int,
    "decoder_max_frames_per_step": int,
    "dedupe_mode": str,
    "max_new_frames_per_request": int,
    "max_request_frames": int,
    "max_live_streams": int,
    "replay_steps_in_flight": int,
    "replay_step_frames": int,
}


def settings_from_config(config: Mapping) -> Code2WavSettings:
    """Build the settings from the model config (the JSON Triton hands to `initialize`, parsed): its
    `parameters` (every one of PARAMETER_TYPES required, no other accepted) and its
    `sequence_batching.max_sequence_idle_microseconds`. Raises ConfigError naming the parameter."""
    values, idle_timeout_s = read_parameters(config, PARAMETER_TYPES)
    return Code2WavSettings(stream_idle_timeout_s=idle_timeout_s, **values)


# --------------------------------------------------------------------------------------------------
# Validation of one request's tensors


def unflatten_codes(input_ids: np.ndarray, num_codebooks: int) -> np.ndarray:
    """`input_ids` INT64 [1, k*F] (or [k*F]), codebook-major -> codes int64 [k, F] (a view).

    Codebook-major: the F codes of codebook 0 come first, then the F codes of codebook 1, ...
    Raises RequestError of kind "dtype", "shape" or "length".
    """
    input_ids = np.asarray(input_ids)
    if input_ids.dtype != np.int64:
        raise RequestError("dtype", f"input_ids must be INT64, got {input_ids.dtype}")
    if not (input_ids.ndim == 1 or (input_ids.ndim == 2 and input_ids.shape[0] == 1)):
        raise RequestError(
            "shape",
            f"input_ids must have shape [1, k*F] (one request of flat codes), got {list(input_ids.shape)}",
        )
    flat = input_ids.reshape(-1)
    if flat.size % num_codebooks:
        raise RequestError(
            "length",
            f"input_ids holds {flat.size} codes, not a multiple of num_codebooks={num_codebooks}",
        )
    return flat.reshape(num_codebooks, flat.size // num_codebooks)


def check_code_range(codes: np.ndarray, codebook_size: int) -> None:
    """Raise RequestError("code_range") naming the first code of `codes` [k, F] outside
    [0, codebook_size), with its codebook, frame and flat position in input_ids."""
    if codes.size == 0:
        return
    if codes.min() >= 0 and codes.max() < codebook_size:
        return
    flat = codes.reshape(-1)
    position = int(np.flatnonzero((flat < 0) | (flat >= codebook_size))[0])
    frames = codes.shape[1]
    raise RequestError(
        "code_range",
        f"input_ids[{position}] = {int(flat[position])} (codebook {position // frames}, "
        f"frame {position % frames}) is outside [0, {codebook_size}) (codebook_size={codebook_size})",
    )


def read_scalar_input(array: Optional[np.ndarray], name: str) -> Optional[int]:
    """An optional INT64 [1, 1] input (`frame_offset`, `history_frames`) -> int, or None when the
    request has none."""
    if array is None:
        return None
    array = np.asarray(array)
    if array.dtype != np.int64:
        raise RequestError("dtype", f"{name} must be INT64, got {array.dtype}")
    if array.size != 1:
        raise RequestError("shape", f"{name} must hold one value ([1, 1]), got shape {list(array.shape)}")
    return int(array.reshape(-1)[0])


# --------------------------------------------------------------------------------------------------
# Per-stream history


class CodeHistory:
    """The codes of the frames a stream has decoded, [k, frames], kept compactly.

    int16 when the codebook fits (2048 entries: 16 bytes per frame, ~720 KB per hour of audio),
    in a buffer grown geometrically so appending is amortised O(new frames).
    """

    _INITIAL_CAPACITY = 64

    def __init__(self, num_codebooks: int, codebook_size: int):
        dtype = np.int16 if codebook_size <= np.iinfo(np.int16).max + 1 else np.int32
        self._codes = np.zeros((num_codebooks, self._INITIAL_CAPACITY), dtype=dtype)
        self._frames = 0

    @property
    def frames(self) -> int:
        return self._frames

    @property
    def capacity(self) -> int:
        return self._codes.shape[1]

    @property
    def dtype(self) -> np.dtype:
        return self._codes.dtype

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

    def first_mismatch(self, codes: np.ndarray, start: int) -> Optional[int]:
        """Compare `codes` [k, m] with history frames [start, start + m) (all of which exist); return
        the index within `codes` of the first differing frame, or None when all m are equal."""
        width = codes.shape[1]
        differs = (self._codes[:, start : start + width] != codes).any(axis=0)
        mismatches = np.flatnonzero(differs)
        return int(mismatches[0]) if mismatches.size else None


class _Stream:
    """Table entry of one live stream."""

    __slots__ = ("history", "base", "decoder_live", "needs_decoder_start", "last_active_s")

    def __init__(self, history: CodeHistory, now_s: float, base: int = 0):
        self.history = history
        # Stream index of the first frame in `history`: 0, or where a resumed stream was started.
        self.base = base
        # The decoder holds a sequence for this correlation id (it got a START and no END yet).
        self.decoder_live = False
        # The next decoder step must carry START: the stream is new or was reset (barge-in).
        self.needs_decoder_start = True
        self.last_active_s = now_s


# --------------------------------------------------------------------------------------------------
# Plans


@dataclasses.dataclass(frozen=True, eq=False)
class DecoderStep:
    """One call into the decoder: `codes` int32 [1, k, S] (C-contiguous), the sequence `flags`
    (FLAG_SEQUENCE_START / _END bits), whether its PCM is thrown away (the END-only step) and whether
    it holds replayed history only."""

    codes: np.ndarray
    flags: int
    discard_output: bool = False
    # Replayed history only (a resume): the step waits for the instance's replay lane.
    replay: bool = False

    @property
    def frames(self) -> int:
        return self.codes.shape[2]


@dataclasses.dataclass(frozen=True, eq=False)
class DecodePlan:
    """What one validated request does. Nothing has changed yet: run the steps in order, then
    `StreamTable.commit(plan)`, or `StreamTable.abort(plan)` if a step failed."""

    correlation_id: int
    # The new frames, int32 [k, N]; N may be 0. Their PCM is the response.
    new_codes: np.ndarray
    steps: Tuple[DecoderStep, ...]
    # START: the stream is created, or reset if it was live (barge-in).
    starts_stream: bool
    # END: the stream is removed once the steps succeeded.
    ends_stream: bool
    # Resume: the frames replayed before new_codes to rebuild the decoder state, int32 [k, H]; the
    # steps decode them first and their PCM is dropped. None without history_frames.
    history_codes: Optional[np.ndarray] = None
    # The request carried history_frames: it opens a resumed stream whose first frame is `base`.
    resumes_stream: bool = False
    # Stream index of the stream's first held frame once the plan is committed.
    base: int = 0
    _stream: Optional[_Stream] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def new_frames(self) -> int:
        return self.new_codes.shape[1]

    @property
    def history_frames(self) -> int:
        return 0 if self.history_codes is None else self.history_codes.shape[1]

    @property
    def needs_end_only_step(self) -> bool:
        """END with no new frame while the decoder holds the sequence: one step of zero codes
        carrying END closes it; its PCM is discarded."""
        return bool(self.steps) and self.steps[-1].discard_output


@dataclasses.dataclass(frozen=True, eq=False)
class StreamRequest:
    """One request as the core sees it: the sequence identity and flags Triton gave it, and its
    input tensors as numpy arrays (`frame_offset` None when absent)."""

    correlation_id: int
    flags: int
    input_ids: np.ndarray
    frame_offset: Optional[np.ndarray] = None
    history_frames: Optional[np.ndarray] = None


@dataclasses.dataclass(frozen=True)
class Code2WavStats:
    """Counters for metrics (cumulative since the model loaded, except `live_streams`).
    `frames_decoded` counts every frame the decoder ran, replayed history included."""

    live_streams: int
    frames_decoded: int
    streams_expired: int
    errors_by_kind: Mapping[str, int]
    streams_resumed: int = 0


# decode_step(correlation_id, codes int32 [1, k, S], flags) -> PCM with samples_per_frame * S samples
DecodeStep = Callable[[int, np.ndarray, int], Awaitable[np.ndarray]]


# --------------------------------------------------------------------------------------------------
# The replay lane


class ReplayLane:
    """Decoder steps of replayed history (resumes, docs/design.md §2.4) as background work.

    Live steps (new frames) go straight to the decoder; `live()` only counts them. A replay step
    (`replay()`) waits for its turn: at most `steps_in_flight` replay steps at a time while the instance
    has live traffic, up to REPLAY_STEPS_WHEN_IDLE once no live step has run for LIVE_QUIET_S (an
    instance whose streams all resume replays at full speed), taken in arrival order; then it waits up
    to REPLAY_WAIT_FOR_IDLE_S for the live steps in the decoder to finish, so that it fills the gaps
    between them. However many streams resume at once, a live step finds at most `steps_in_flight`
    short replay rows beside it in the decoder."""

    def __init__(self, steps_in_flight: int, clock: Callable[[], float] = time.monotonic):
        self.steps_in_flight = steps_in_flight
        self.live_steps = 0
        self.replay_steps = 0
        self.replays_waiting = 0
        self._clock = clock
        self._last_live_s = -LIVE_QUIET_S
        self._condition: Optional[asyncio.Condition] = None  # made in the event loop that uses it

    def _lock(self) -> asyncio.Condition:
        if self._condition is None:
            self._condition = asyncio.Condition()
        return self._condition

    def _replay_may_start(self) -> bool:
        # Waiters are woken whenever a replay step or the last live step ends, so the quiet time is
        # looked at again as it passes.
        quiet = not self.live_steps and self._clock() - self._last_live_s >= LIVE_QUIET_S
        return self.replay_steps < (max(self.steps_in_flight, REPLAY_STEPS_WHEN_IDLE) if quiet else self.steps_in_flight)

    @contextlib.asynccontextmanager
    async def live(self):
        self.live_steps += 1
        try:
            yield
        finally:
            self.live_steps -= 1
            self._last_live_s = self._clock()
            if not self.live_steps and self.replays_waiting:  # live steps cost no lock otherwise
                condition = self._lock()
                async with condition:
                    condition.notify_all()

    @contextlib.asynccontextmanager
    async def replay(self):
        condition = self._lock()
        async with condition:
            self.replays_waiting += 1
            try:
                await condition.wait_for(self._replay_may_start)
                self.replay_steps += 1
                if self.live_steps:
                    try:
                        await asyncio.wait_for(condition.wait_for(lambda: not self.live_steps), REPLAY_WAIT_FOR_IDLE_S)
                    except asyncio.TimeoutError:
                        pass
            finally:
                self.replays_waiting -= 1
        try:
            yield
        finally:
            self.replay_steps -= 1
            async with condition:
                condition.notify_all()


# --------------------------------------------------------------------------------------------------
# The stream table


class StreamTable:
    """Live streams keyed by correlation id, with their history, lifecycle and idle expiry.

    One table per model instance, used from one thread: the instance's event loop (model.py runs
    the idle sweeper's `expire_idle` there too). Triton's sequence batcher routes every request of
    a sequence to the same instance; `submit` runs the requests of one stream in arrival order and
    the streams independently, across `execute()` batches (docs/design.md §5).
    """

    def __init__(self, settings: Code2WavSettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self._clock = clock
        self._streams: Dict[int, _Stream] = {}
        self._frames_decoded = 0
        self._streams_expired = 0
        self._streams_resumed = 0
        self._errors: Dict[str, int] = {kind: 0 for kind in ERROR_KINDS}
        # The last submitted request of every stream with one not yet finished (see `submit`).
        self._queued: Dict[int, asyncio.Task] = {}
        # Streams whose START is submitted and not yet finished: they count toward the stream cap.
        self._opening: set = set()
        self._lane = ReplayLane(settings.replay_steps_in_flight)

    # ---- inspection -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, correlation_id: object) -> bool:
        return correlation_id in self._streams

    def history(self, correlation_id: int) -> np.ndarray:
        """The decoded codes [k, frames] of a live stream (read-only view) from its base on; KeyError
        if not live."""
        return self._streams[correlation_id].history.codes()

    def base(self, correlation_id: int) -> int:
        """Stream index of a live stream's first held frame: 0, or where it was resumed; KeyError if
        not live."""
        return self._streams[correlation_id].base

    def stats(self) -> Code2WavStats:
        return Code2WavStats(
            live_streams=len(self._streams),
            frames_decoded=self._frames_decoded,
            streams_expired=self._streams_expired,
            errors_by_kind=dict(self._errors),
            streams_resumed=self._streams_resumed,
        )

    def count_error(self, kind: str) -> None:
        """Count a failed request (model.py counts the failures that happen outside the core)."""
        self._errors[kind] = self._errors.get(kind, 0) + 1

    # ---- lifecycle ----------------------------------------------------------------------------

    def expire_idle(self, keep: Iterable[int] = ()) -> List[int]:
        """Drop the streams idle for longer than the timeout and return their ids.

        Triton frees an idle sequence without telling the model, so the table expires entries
        itself. Streams in `keep` (those with a request in the current batch: Triton accepted them
        as live) and streams with a request queued or running are never dropped.
        """
        # A second late: Triton itself refuses a non-START request for a sequence it expired, so
        # this only frees memory, and the grace spares a request queued just before the timeout.
        deadline = self._clock() - self.settings.stream_idle_timeout_s - IDLE_GRACE_S
        keep = set(keep) | set(self._queued)
        expired = [
            correlation_id
            for correlation_id, stream in self._streams.items()
            if stream.last_active_s < deadline and correlation_id not in keep
        ]
        for correlation_id in expired:
            del self._streams[correlation_id]
        self._streams_expired += len(expired)
        return expired

    def plan(
        self,
        correlation_id: int,
        flags: int,
        input_ids: np.ndarray,
        frame_offset: Optional[np.ndarray] = None,
        history_frames: Optional[np.ndarray] = None,
    ) -> DecodePlan:
        """Validate one request and say what decoding it takes. Changes nothing.

        Dedupe (h = frames the stream has decoded; a START request sees h = 0):
        - with `frame_offset` o: o < 0 and o > h (a gap) are errors; the request's frames in [o, h)
          must equal the history (else a changed-frame error); frames from h on are new;
        - without it, by `dedupe_mode`: `delta`: every frame is new; `cumulative`: the request must
          start with the whole history and only its suffix is new; `auto`: cumulative if the request
          starts with the whole history, else delta. Known limits of `auto`: a delta that happens
          to repeat the history's first frames (silence) is taken as a resend and not decoded; a
          resend shorter than the history is taken as a delta and decoded twice. Cumulative
          requests resend and compare the whole history each time: O(n^2) bytes over a stream.

        Resume (`history_frames` H, only with START): the request's F frames are stream frames
        [o, o + F) for `frame_offset` o (required when H > 0; o = 0 without it); 0 <= H <= F. All F
        are decoded, the decoder starting afresh on the first; the PCM of the last F - H is returned.
        The stream's base is o: it holds frames from o on, h = o + F, and later offsets are stream
        indices: o' < base is an error (those frames are held on no server any more), [base, h) is
        compared with the held frames, o' > h is a gap. Without `frame_offset`, requests of a
        resumed stream count from its base: a cumulative request holds the frames from the base on.
        History frames count toward `max_new_frames_per_request`: the decoder runs them like new
        ones.

        Raises RequestError with a message naming the value, the limit and the parameter.
        """
        settings = self.settings
        if isinstance(correlation_id, bool) or not isinstance(correlation_id, int) or correlation_id <= 0:
            raise RequestError(
                "correlation_id",
                f"requests need a non-zero integer correlation id (one per stream), got {correlation_id!r}",
            )
        starts = bool(flags & FLAG_SEQUENCE_START)
        ends = bool(flags & FLAG_SEQUENCE_END)
        replay = read_scalar_input(history_frames, "history_frames")
        stream = self._streams.get(correlation_id)
        if stream is None and not starts:
            raise RequestError(
                "unknown_stream",
                f"stream {correlation_id} is not open: send the first request of the sequence with the "
                f"START flag (a stream ends with END, with a decoder error, or after "
                f"{settings.stream_idle_timeout_s:g} s idle)",
            )

        codes = unflatten_codes(input_ids, settings.num_codebooks)
        request_frames = codes.shape[1]
        if request_frames > settings.max_request_frames:
            raise RequestError(
                "limit",
                f"request holds {request_frames} frames, more than "
                f"max_request_frames={settings.max_request_frames}",
            )
        check_code_range(codes, settings.codebook_size)
        offset = read_scalar_input(frame_offset, "frame_offset")

        if replay is None:
            continuing = not starts and stream is not None
            history = stream.history if continuing else None
            base = stream.base if continuing else 0
            first_new = self._first_new_frame(correlation_id, codes, offset, history, base)
            first_decoded = first_new
        elif starts:
            base = self._resume_base(correlation_id, replay, offset, request_frames)
            first_new, first_decoded = replay, 0
        else:
            base = stream.base
            self._check_continued_replay(correlation_id, replay, offset, request_frames, base + stream.history.frames)
            first_new, first_decoded = replay, 0
        decoded_codes = codes[:, first_decoded:].astype(np.int32)
        new_frames = request_frames - first_new
        if replay:
            if replay + new_frames > settings.max_new_frames_per_request:
                raise RequestError(
                    "limit",
                    f"request decodes {replay + new_frames} frames ({replay} history_frames + {new_frames} "
                    f"new), more than max_new_frames_per_request={settings.max_new_frames_per_request}",
                )
        elif new_frames > settings.max_new_frames_per_request:
            raise RequestError(
                "limit",
                f"request has {new_frames} new frames, more than "
                f"max_new_frames_per_request={settings.max_new_frames_per_request}",
            )

        decoder_live = stream is not None and stream.decoder_live
        needs_start = starts or stream is None or stream.needs_decoder_start
        # History frames get steps of their own, which take the replay lane (see `run`).
        history_steps = self._steps(decoded_codes[:, :replay], needs_start, ends and replay == decoded_codes.shape[1],
                                    replay=True) if replay else ()
        steps = history_steps + self._steps(decoded_codes[:, replay or 0 :], needs_start and not history_steps, ends)
        if ends and decoded_codes.shape[1] == 0 and decoder_live:
            # The decoder holds a sequence for this id (a START without END reached it): close it
            # with one step of zero codes. Without a live decoder sequence (e.g. START|END with no
            # frame) nothing was started there, so nothing is sent.
            steps += (DecoderStep(self._zero_step_codes(), FLAG_SEQUENCE_END, discard_output=True),)

        return DecodePlan(
            correlation_id=correlation_id,
            new_codes=decoded_codes[:, first_new - first_decoded :],
            steps=steps,
            starts_stream=starts,
            ends_stream=ends,
            history_codes=None if replay is None else decoded_codes[:, :replay],
            resumes_stream=replay is not None and starts,
            base=base,
            _stream=stream,
        )

    def commit(self, plan: DecodePlan) -> None:
        """Record a plan whose decoder steps all succeeded."""
        correlation_id = plan.correlation_id
        stream = self._streams.get(correlation_id)
        if stream is not plan._stream:
            # Same-stream requests are serialised, so this is a bug, not a client error.
            raise RuntimeError(f"stream {correlation_id} changed between plan and commit")
        self._frames_decoded += plan.history_frames + plan.new_frames
        self._streams_resumed += plan.resumes_stream
        if plan.ends_stream:
            self._streams.pop(correlation_id, None)
            return
        now_s = self._clock()
        if stream is None:
            stream = _Stream(
                CodeHistory(self.settings.num_codebooks, self.settings.codebook_size), now_s, plan.base
            )
            self._streams[correlation_id] = stream
        elif plan.starts_stream:
            # Barge-in: the stream starts over. The decoder resets on the next step's START; until
            # then it still holds the old sequence, so decoder_live is kept.
            stream.history = CodeHistory(self.settings.num_codebooks, self.settings.codebook_size)
            stream.base = plan.base
            stream.needs_decoder_start = True
        if plan.history_codes is not None:
            stream.history.append(plan.history_codes)
        stream.history.append(plan.new_codes)
        if plan.steps:
            stream.decoder_live = True
            stream.needs_decoder_start = False
        if plan.steps or plan.starts_stream:
            # Idle time runs from the last decoder step: requests that decode nothing (retries,
            # resends, rejected requests) must not outlive the decoder's own idle timeout.
            stream.last_active_s = now_s

    def abort(self, plan: DecodePlan) -> None:
        """A decoder step of `plan` failed: the stream ends (the client must START again)."""
        self._streams.pop(plan.correlation_id, None)

    # ---- running requests ---------------------------------------------------------------------

    async def run(self, plan: DecodePlan, decode_step: DecodeStep) -> np.ndarray:
        """Run the plan's steps in order through `decode_step`, commit, and return the PCM of the
        new frames, float32 [1, samples_per_frame * N] (replayed history frames are decoded, their
        PCM dropped). On any failure the stream is aborted and DecoderError is raised saying to
        START again."""
        samples_per_frame = self.settings.samples_per_frame
        pcm_out = np.empty((1, samples_per_frame * plan.new_frames), np.float32)
        written = 0
        history_left = plan.history_frames  # leading decoded frames whose PCM is not returned
        for index, step in enumerate(plan.steps):
            try:
                async with (self._lane.replay() if step.replay else self._lane.live()):
                    pcm = await decode_step(plan.correlation_id, step.codes, step.flags)
                if not step.discard_output:
                    samples = samples_per_frame * step.frames
                    pcm = np.asarray(pcm)
                    if pcm.size != samples:
                        raise DecoderError(
                            f"returned {pcm.size} samples for {step.frames} frame(s), "
                            f"expected {samples} (samples_per_frame={samples_per_frame})"
                        )
                    dropped = min(history_left, step.frames) * samples_per_frame
                    history_left -= dropped // samples_per_frame
                    pcm_out[0, written : written + samples - dropped] = pcm.reshape(-1)[dropped:]
                    written += samples - dropped
            except BaseException as exc:
                self.abort(plan)
                if not isinstance(exc, Exception):  # cancellation: the stream is gone all the same
                    raise
                raise DecoderError(
                    f"decoder '{self.settings.decoder_model_name}' failed on step {index + 1} of "
                    f"{len(plan.steps)} for stream {plan.correlation_id}: {exc}; the stream was ended, "
                    f"send its next request with the START flag to begin again",
                    *((exc.code, exc.kind) if isinstance(exc, DecoderError) else ()),
                ) from exc
        self.commit(plan)
        return pcm_out

    async def process(self, request: StreamRequest, decode_step: DecodeStep) -> np.ndarray:
        """Plan, run and commit one request; count its error, if any, and re-raise it."""
        try:
            plan = self.plan(
                request.correlation_id, request.flags, request.input_ids, request.frame_offset, request.history_frames
            )
            return await self.run(plan, decode_step)
        except RequestError as exc:
            self.count_error(exc.kind)
            if request.flags & FLAG_SEQUENCE_END and await self._end_rejected(request.correlation_id, decode_step):
                # Triton has released the sequence with this END: nothing can continue the stream.
                raise RequestError(exc.kind, f"{exc}; the request carried END, so the stream has ended") from exc
            raise
        except ModelError as exc:
            self.count_error(exc.kind)
            raise
        except Exception:
            self.count_error("internal")
            raise

    async def _end_rejected(self, correlation_id, decode_step: DecodeStep) -> bool:
        """A rejected request carried END: drop the stream and close its decoder sequence (one
        zero-code END step, output discarded). Returns whether a stream was dropped."""
        stream = self._streams.pop(correlation_id, None)
        if stream is None:
            return False
        if stream.decoder_live:
            try:
                await decode_step(correlation_id, self._zero_step_codes(), FLAG_SEQUENCE_END)
            except Exception:  # the decoder frees the sequence on its idle timeout anyway
                pass
        return True

    def submit(
        self,
        request: StreamRequest,
        decode_step: DecodeStep,
        finish: Optional[Callable[[Union[np.ndarray, Exception]], None]] = None,
    ) -> asyncio.Task[Union[np.ndarray, Exception]]:
        """Queue one request behind the earlier requests of its stream and return the task that runs
        it (call from the event loop). The task's result is the request's PCM or the exception it
        failed with (it never raises). `finish(result)`, if given, is called with it before the
        stream's next request may start, so whatever it sends goes out in the stream's order.

        Streams run independently: a long request (a resume's replay) holds up the later requests of
        its own stream only; between its decoder steps the other streams' steps reach the decoder.
        A START for a new stream is refused here, at once, when the instance already holds (or is
        opening) `max_live_streams` streams."""
        correlation_id = request.correlation_id
        loop = asyncio.get_running_loop()
        if (request.flags & FLAG_SEQUENCE_START and not request.flags & FLAG_SEQUENCE_END
                and correlation_id not in self._streams and correlation_id not in self._queued):
            live = len(self._streams) + len(self._opening)
            if live >= self.settings.max_live_streams:
                self.count_error("stream_cap")
                return self._finished(loop, self._stream_cap_error(live), finish)
            self._opening.add(correlation_id)
        previous = self._queued.get(correlation_id)
        task = loop.create_task(self._run_in_turn(previous, request, decode_step, finish))
        self._queued[correlation_id] = task
        task.add_done_callback(lambda done: self._dequeue(correlation_id, done))
        return task

    def submit_batch(
        self,
        requests: Sequence[StreamRequest],
        decode_step: DecodeStep,
        finishes: Optional[Sequence[Callable[[Union[np.ndarray, Exception]], None]]] = None,
    ) -> List[asyncio.Task[Union[np.ndarray, Exception]]]:
        """One `execute()` batch: expire idle streams (never those with a request here or queued),
        then `submit` every request in arrival order (with its `finish`, if given)."""
        self.expire_idle(keep=[request.correlation_id for request in requests])
        finishes = finishes if finishes is not None else [None] * len(requests)
        return [self.submit(request, decode_step, finish) for request, finish in zip(requests, finishes)]

    async def process_batch(
        self, requests: Sequence[StreamRequest], decode_step: DecodeStep
    ) -> List[Union[np.ndarray, Exception]]:
        """`submit_batch` and wait for all of it: per request, its PCM or the exception it failed with."""
        return list(await asyncio.gather(*self.submit_batch(requests, decode_step)))

    @property
    def requests_in_flight(self) -> int:
        """Streams with a request submitted and not yet finished."""
        return len(self._queued)

    async def _run_in_turn(self, previous, request: StreamRequest, decode_step: DecodeStep, finish):
        if previous is not None:
            await asyncio.wait([previous])
        try:
            result: Union[np.ndarray, Exception] = await self.process(request, decode_step)
        except Exception as exc:
            result = exc
        finally:
            self._opening.discard(request.correlation_id)
        if finish is not None:
            finish(result)
        return result

    def _dequeue(self, correlation_id: int, task) -> None:
        if self._queued.get(correlation_id) is task:
            del self._queued[correlation_id]

    @staticmethod
    def _finished(loop, result, finish):
        future = loop.create_future()
        if finish is not None:
            finish(result)
        future.set_result(result)
        return future

    # ---- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _check_history_count(correlation_id: int, replay: int, request_frames: int) -> None:
        if not 0 <= replay <= request_frames:
            raise RequestError(
                "history",
                f"history_frames={replay} must lie in [0, {request_frames}]: the request holds {request_frames} "
                f"frames and its first history_frames of them are the replayed history (stream {correlation_id})",
            )

    @classmethod
    def _check_continued_replay(cls, correlation_id: int, replay: int, offset: Optional[int], request_frames: int,
                                decoded: int) -> None:
        """History on a continuing stream (a resume sent in pieces): every frame of the request is new,
        so it starts at the stream's next frame, and 0 <= H <= F."""
        cls._check_history_count(correlation_id, replay, request_frames)
        if offset != decoded:
            raise RequestError(
                "history",
                f"history_frames={replay} on a continuing stream needs frame_offset={decoded}, the stream's next "
                f"frame (got {offset}): history is decoded once, after the frames stream {correlation_id} holds",
            )

    def _stream_cap_error(self, live: int) -> StreamCapError:
        settings = self.settings
        return StreamCapError(
            f"resource exhausted: this code2wav instance already holds {live} live streams, its limit "
            f"(max_live_streams={settings.max_live_streams}); the new stream was refused and no other "
            f"stream was affected. Retry later, or END streams that are done (an abandoned stream is "
            f"freed after {settings.stream_idle_timeout_s:g} s idle)"
        )

    def _resume_base(self, correlation_id: int, replay: int, offset: Optional[int], request_frames: int) -> int:
        """The base (first frame index) of a stream a START with history_frames opens (see `plan`)."""
        self._check_history_count(correlation_id, replay, request_frames)
        if offset is None:
            if replay:
                raise RequestError(
                    "history",
                    f"history_frames={replay} needs frame_offset, the stream index of the request's first "
                    f"frame, to place the history in the stream (stream {correlation_id})",
                )
            return 0
        if offset < 0:
            raise RequestError("negative_offset", f"frame_offset must be >= 0, got {offset}")
        return offset

    def _first_new_frame(
        self,
        correlation_id: int,
        codes: np.ndarray,
        offset: Optional[int],
        history: Optional[CodeHistory],
        base: int = 0,
    ) -> int:
        """Index within the request of its first frame to decode (see `plan` for the rules).
        `history` holds the stream's frames from `base` on."""
        held = 0 if history is None else history.frames
        decoded = base + held
        request_frames = codes.shape[1]
        if offset is not None:
            if offset < 0:
                raise RequestError("negative_offset", f"frame_offset must be >= 0, got {offset}")
            if offset < base:
                raise RequestError(
                    "before_resume",
                    f"frame_offset {offset} is before frame {base}, where stream {correlation_id} was resumed "
                    f"on this server: frames before {base} are not held here and cannot be compared; "
                    f"send frames from {base} on",
                )
            if offset > decoded:
                raise RequestError(
                    "gap",
                    f"frame_offset {offset} leaves a gap: stream {correlation_id} has decoded {decoded} "
                    f"frames, so frame_offset must be at most {decoded}",
                )
            overlap = min(decoded - offset, request_frames)
            if overlap > 0:
                self._check_unchanged(correlation_id, codes[:, :overlap], history, offset - base, base)
            return overlap
        # Without an offset, a request is read against the held frames: those of a resumed stream
        # start at its base (the frames before it are on no server), so a cumulative request of a
        # resumed stream holds the frames from its base on.
        mode = self.settings.dedupe_mode
        if mode == "delta" or held == 0:
            return 0
        if mode == "cumulative":
            if request_frames < held:
                since = f" since frame {base}, where it was resumed on this server" if base else ""
                raise RequestError(
                    "not_cumulative",
                    f"dedupe_mode=cumulative: the request holds {request_frames} frames but stream "
                    f"{correlation_id} has decoded {held}{since}; a cumulative request starts with all of them",
                )
            self._check_unchanged(correlation_id, codes[:, :held], history, 0, base)
            return held
        # auto
        if request_frames >= held and history.first_mismatch(codes[:, :held], 0) is None:
            return held
        return 0

    @staticmethod
    def _check_unchanged(
        correlation_id: int, codes: np.ndarray, history: CodeHistory, start: int, base: int = 0
    ) -> None:
        """Compare `codes` with held frames [start, start + m); `base` turns held indices into stream
        indices for the message."""
        mismatch = history.first_mismatch(codes, start)
        if mismatch is not None:
            raise RequestError(
                "changed_frame",
                f"frame {base + start + mismatch} differs from the frame stream {correlation_id} already "
                f"decoded at that index; decoded frames cannot change (START a new sequence instead)",
            )

    def _zero_step_codes(self) -> np.ndarray:
        """The codes of an END-only step (its output is discarded): one frame of zeros."""
        return np.zeros((1, self.settings.num_codebooks, 1), np.int32)

    def _steps(self, new_codes: np.ndarray, needs_start: bool, ends: bool, replay: bool = False) -> Tuple[DecoderStep, ...]:
        """The new frames [k, N] in as few decoder calls as the decoder takes: one call when N <=
        decoder_max_frames_per_step, else full calls and the remainder last (requests of equal size
        give equal calls, which the decoder batches); replayed history (`replay`) in calls of
        `replay_step_frames`. START on the first step when the decoder must (re)start, END on the last."""
        settings = self.settings
        total = new_codes.shape[1]
        per_step = min(settings.replay_step_frames, settings.decoder_max_frames_per_step) if replay \
            else settings.decoder_max_frames_per_step
        steps = []
        for first in range(0, total, per_step):
            flags = 0
            if first == 0 and needs_start:
                flags |= FLAG_SEQUENCE_START
            if first + per_step >= total and ends:
                flags |= FLAG_SEQUENCE_END
            steps.append(DecoderStep(np.ascontiguousarray(new_codes[None, :, first : first + per_step]), flags,
                                     replay=replay))
        return tuple(steps)
