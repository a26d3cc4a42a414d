"""Core of the `code2wav` BLS model, the stream table: admission, each stream's requests in turn, lifecycle,
expiry, the replay lane (docs/design.md §2). Pure numpy + stdlib, Python 3.10+. A request is planned, its decoder
steps run through an injected async `decode_step`, then committed, or its stream is dropped if a step failed."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Dict, List, Optional, Union

import numpy as np

from code2wav_plan import DecodedCodes, DecodePlan, StreamEntry, StreamRequest, plan_request, zero_step_codes
from code2wav_settings import (
    ERROR_KINDS,
    FLAG_SEQUENCE_END,
    FLAG_SEQUENCE_START,
    Code2WavSettings,
    DecoderError,
    RequestError,
)
from model_errors import ModelError

IDLE_GRACE_S = 1.0  # streams expire this long after the idle timeout (see StreamTable.expire_idle)
# decode_step(correlation_id, codes int32 [1, k, S], flags) -> PCM with samples_per_frame * S samples
DecodeStep = Callable[[int, np.ndarray, int], Awaitable[np.ndarray]]
# finish(result): called with a request's PCM or the exception it failed with.
Finish = Callable[[Union[np.ndarray, Exception]], None]
# A replay step waits up to this long for the live steps in the decoder to finish.
REPLAY_WAIT_FOR_IDLE_S = 0.1
# Replay steps in flight while no live step has run for LIVE_QUIET_S: a full run of the python-ort
# decoder, for an instance whose streams are all resuming (a restarted server).
REPLAY_STEPS_WHEN_IDLE = 8
LIVE_QUIET_S = 1.0


class ReplayLane:
    """Replayed history's decoder steps (docs/design.md §2.4) as background work; `live()` only counts live steps.
    A `replay()` step waits its turn, `steps_in_flight` at a time (REPLAY_STEPS_WHEN_IDLE once no live step ran
    for LIVE_QUIET_S), then up to REPLAY_WAIT_FOR_IDLE_S for live steps to end: they meet few replay rows."""

    def __init__(self, steps_in_flight: int, clock: Callable[[], float] = time.monotonic):
        self.steps_in_flight = steps_in_flight
        self.live_steps = self.replay_steps = self.replays_waiting = 0
        self._clock = clock
        self._last_live_s = -LIVE_QUIET_S
        self._condition = asyncio.Condition()  # bound to the event loop that first waits on it (Python 3.10+)

    def _replay_may_start(self) -> bool:
        # Waiters wake whenever a replay step or the last live step ends, so the quiet time is looked at again.
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
                async with self._condition:
                    self._condition.notify_all()

    @contextlib.asynccontextmanager
    async def replay(self):
        condition = self._condition
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


class StreamTable:
    """Live streams by correlation id: one per model instance, used from its event loop only."""

    def __init__(self, settings: Code2WavSettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self._clock = clock
        self._streams: Dict[int, StreamEntry] = {}
        # The metrics' fields (model.py's METRIC_FAMILIES), since the load; frames_decoded includes history.
        self.frames_decoded = self.streams_expired = self.streams_resumed = 0
        self.errors_by_kind: Dict[str, int] = {kind: 0 for kind in ERROR_KINDS}
        # The last submitted request of every stream with one not yet finished (see `submit`).
        self._queued: Dict[int, asyncio.Task] = {}
        # Streams whose START is submitted and not yet finished: they count toward the stream cap.
        self._opening: set = set()
        self._lane = ReplayLane(settings.replay_steps_in_flight)

    @property
    def live_streams(self) -> int:
        return len(self._streams)

    def count_error(self, kind: str) -> None:
        self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + 1

    def expire_idle(self, keep: Iterable[int] = ()) -> List[int]:
        """Drop and return the streams idle past the timeout (and a grace, for a request queued just before it),
        but those in `keep` (the current batch) or with a request queued or running. This only frees memory."""
        deadline = self._clock() - self.settings.stream_idle_timeout_s - IDLE_GRACE_S
        keep = set(keep) | set(self._queued)
        expired = [correlation_id for correlation_id, stream in self._streams.items()
                   if stream.last_active_s < deadline and correlation_id not in keep]
        for correlation_id in expired:
            del self._streams[correlation_id]
        self.streams_expired += len(expired)
        return expired

    def commit(self, plan: DecodePlan) -> None:
        """Record a plan whose decoder steps all succeeded."""
        correlation_id = plan.correlation_id
        stream = self._streams.get(correlation_id)
        if stream is not plan.entry:
            # Same-stream requests are serialised, so this is a bug, not a client error.
            raise RuntimeError(f"stream {correlation_id} changed between plan and commit")
        self.frames_decoded += plan.history_frames + plan.new_frames
        self.streams_resumed += plan.resumes_stream
        if plan.ends_stream:
            self._streams.pop(correlation_id, None)
            return
        now_s = self._clock()
        if stream is None:
            decoded = DecodedCodes(self.settings.num_codebooks, self.settings.codebook_size)
            stream = self._streams[correlation_id] = StreamEntry(decoded, now_s, plan.base)
        elif plan.starts_stream:
            # Barge-in: the stream starts over. The decoder resets on the next step's START; until
            # then it still holds the old sequence, so decoder_live is kept.
            stream.decoded = DecodedCodes(self.settings.num_codebooks, self.settings.codebook_size)
            stream.base = plan.base
            stream.needs_decoder_start = True
        if plan.history_codes is not None:
            stream.decoded.append(plan.history_codes)
        stream.decoded.append(plan.new_codes)
        if plan.steps:
            stream.decoder_live = True
            stream.needs_decoder_start = False
        if plan.steps or plan.starts_stream:
            # Idle time runs from the last decoder step: requests that decode nothing (retries,
            # resends, rejected requests) must not outlive the decoder's own idle timeout.
            stream.last_active_s = now_s

    async def run(self, plan: DecodePlan, decode_step: DecodeStep) -> np.ndarray:
        """Run the plan's steps, commit, and return the new frames' PCM float32 [1, samples_per_frame * N]
        (history's dropped). On any failure the stream ends and DecoderError says to START again."""
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
                self._streams.pop(plan.correlation_id, None)
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
            plan = plan_request(self.settings, self._streams.get(request.correlation_id), request)
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
        """Drop the stream of a rejected END (Triton released it) and close its decoder sequence (a discarded
        zero-code END step). Returns whether a stream was dropped."""
        stream = self._streams.pop(correlation_id, None)
        if stream is None:
            return False
        if stream.decoder_live:
            try:
                await decode_step(correlation_id, zero_step_codes(self.settings), FLAG_SEQUENCE_END)
            except Exception:  # the decoder frees the sequence on its idle timeout anyway
                pass
        return True

    def submit(self, request: StreamRequest, decode_step: DecodeStep,
               finish: Optional[Finish] = None) -> asyncio.Task[Union[np.ndarray, Exception]]:
        """Queue a request behind its stream's earlier ones; returns the task whose result is its PCM or the
        exception it failed with. `finish(result)` runs before the stream's next request may start, so that
        answers go out in order. A new stream's START past `max_live_streams` (opening ones count) is refused."""
        correlation_id = request.correlation_id
        loop = asyncio.get_running_loop()
        if (request.flags & FLAG_SEQUENCE_START and not request.flags & FLAG_SEQUENCE_END
                and correlation_id not in self._streams and correlation_id not in self._queued):
            live = len(self._streams) + len(self._opening)
            if live >= self.settings.max_live_streams:
                self.count_error("stream_cap")
                error = ModelError("stream_cap", f"resource exhausted: this code2wav instance already holds {live} "
                                   f"live streams, its limit (max_live_streams={self.settings.max_live_streams}); the "
                                   "new stream was refused and no other stream was affected. Retry later, or END "
                                   "streams that are done (an abandoned stream is freed after "
                                   f"{self.settings.stream_idle_timeout_s:g} s idle)", "UNAVAILABLE")
                if finish is not None:
                    finish(error)
                refused = loop.create_future()
                refused.set_result(error)
                return refused
            self._opening.add(correlation_id)
        previous = self._queued.get(correlation_id)
        task = loop.create_task(self._run_in_turn(previous, request, decode_step, finish))
        self._queued[correlation_id] = task
        task.add_done_callback(lambda done: self._dequeue(correlation_id, done))
        return task

    def live(self, requests: Sequence[StreamRequest]) -> List[bool]:
        """Per request of a batch not yet submitted, whether execute may answer it in its returned list (live):
        one decoder step at most, no history, and its stream's only request in flight or in the batch."""
        batch_counts = collections.Counter(request.correlation_id for request in requests)
        most_codes = self.settings.num_codebooks * self.settings.decoder_max_frames_per_step
        return [request.history_frames is None
                and request.input_ids.size <= most_codes
                and batch_counts[request.correlation_id] == 1
                and request.correlation_id not in self._queued
                for request in requests]

    def submit_batch(self, requests: Sequence[StreamRequest], decode_step: DecodeStep,
                     finishes: Optional[Sequence[Finish]] = None) -> List[asyncio.Task[Union[np.ndarray, Exception]]]:
        """One `execute()` batch: expire idle streams, then `submit` every request in arrival order."""
        self.expire_idle(keep=[request.correlation_id for request in requests])
        finishes = finishes if finishes is not None else [None] * len(requests)
        return [self.submit(request, decode_step, finish) for request, finish in zip(requests, finishes)]

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
