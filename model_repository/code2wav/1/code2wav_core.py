"""Core of the `code2wav` BLS model, the stream table: admission, each stream's requests in turn,
lifecycle, expiry. Pure numpy + stdlib (unit-tested without a server; Python 3.10 and 3.11); its
siblings (`code2wav_settings`, `_plan`, `_stream`, `_replay`) are listed in docs/design.md, and the
request contract is docs/design.md §2.

A request is planned (`plan_request`), its decoder steps run through an injected async `decode_step`,
then committed (`StreamTable.commit`), or the stream is aborted if a step failed. A rejected request
leaves its stream as it was, unless it carried END (Triton releases the sequence with it, so the
stream ends and its decoder sequence gets a discarded END step).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Dict, List, Optional, Union

import numpy as np

from code2wav_plan import DecodePlan, StreamRequest, plan_request, zero_step_codes
from code2wav_replay import ReplayLane
from code2wav_settings import (
    ERROR_KINDS,
    FLAG_SEQUENCE_END,
    FLAG_SEQUENCE_START,
    Code2WavSettings,
    DecoderError,
    RequestError,
    StreamCapError,
)
from code2wav_stream import DecodedCodes, StreamEntry
from model_errors import ModelError

IDLE_GRACE_S = 1.0  # streams expire this long after the idle timeout (see StreamTable.expire_idle)


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
# finish(result): called with a request's PCM or the exception it failed with.
Finish = Callable[[Union[np.ndarray, Exception]], None]


class StreamTable:
    """Live streams keyed by correlation id, with their decoded codes, lifecycle and idle expiry. One
    per model instance, used from its event loop only (model.py runs the sweeper's `expire_idle` there)."""

    def __init__(self, settings: Code2WavSettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self._clock = clock
        self._streams: Dict[int, StreamEntry] = {}
        self._frames_decoded = 0
        self._streams_expired = 0
        self._streams_resumed = 0
        self._errors: Dict[str, int] = {kind: 0 for kind in ERROR_KINDS}
        # The last submitted request of every stream with one not yet finished (see `submit`).
        self._queued: Dict[int, asyncio.Task] = {}
        # Streams whose START is submitted and not yet finished: they count toward the stream cap.
        self._opening: set = set()
        self._lane = ReplayLane(settings.replay_steps_in_flight)

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

    def expire_idle(self, keep: Iterable[int] = ()) -> List[int]:
        """Drop the streams idle for longer than the timeout (Triton frees them without telling the
        model) and return their ids; never those in `keep` (a request in the current batch) or with a
        request queued or running."""
        # A second late: Triton itself refuses a non-START request for a sequence it expired, so
        # this only frees memory, and the grace spares a request queued just before the timeout.
        deadline = self._clock() - self.settings.stream_idle_timeout_s - IDLE_GRACE_S
        keep = set(keep) | set(self._queued)
        expired = [correlation_id for correlation_id, stream in self._streams.items()
                   if stream.last_active_s < deadline and correlation_id not in keep]
        for correlation_id in expired:
            del self._streams[correlation_id]
        self._streams_expired += len(expired)
        return expired

    def commit(self, plan: DecodePlan) -> None:
        """Record a plan whose decoder steps all succeeded."""
        correlation_id = plan.correlation_id
        stream = self._streams.get(correlation_id)
        if stream is not plan.entry:
            # Same-stream requests are serialised, so this is a bug, not a client error.
            raise RuntimeError(f"stream {correlation_id} changed between plan and commit")
        self._frames_decoded += plan.history_frames + plan.new_frames
        self._streams_resumed += plan.resumes_stream
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

    def abort(self, plan: DecodePlan) -> None:
        """A decoder step of `plan` failed: the stream ends (the client must START again)."""
        self._streams.pop(plan.correlation_id, None)

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
        """A rejected request carried END: drop the stream and close its decoder sequence (one
        zero-code END step, output discarded). Returns whether a stream was dropped."""
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
        """Queue one request behind the earlier requests of its stream and return the task that runs
        it (call from the event loop). The task's result is the request's PCM or the exception it
        failed with (it never raises). `finish(result)`, if given, is called with it before the
        stream's next request may start, so whatever it sends goes out in the stream's order. A long
        request (a resume's replay) holds up only its own stream. A START for a new stream is refused
        here, at once, when the instance already holds (or is opening) `max_live_streams` streams."""
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

    def busy(self, correlation_id: int) -> bool:
        """Whether the stream has a submitted request not yet finished."""
        return correlation_id in self._queued

    def live(self, requests: Sequence[StreamRequest]) -> List[bool]:
        """Per request of a batch not yet submitted, whether it is live: one decoder step at most, no
        replayed history, and its stream's only request in flight (none queued before it, no other in
        the batch). `execute` may wait for a live request and answer it in its returned list; the
        others are answered through their senders, which keeps each stream's answers in order."""
        batch_counts = collections.Counter(request.correlation_id for request in requests)
        most_codes = self.settings.num_codebooks * self.settings.decoder_max_frames_per_step
        return [request.history_frames is None
                and request.input_ids.size <= most_codes
                and batch_counts[request.correlation_id] == 1
                and not self.busy(request.correlation_id)
                for request in requests]

    def submit_batch(self, requests: Sequence[StreamRequest], decode_step: DecodeStep,
                     finishes: Optional[Sequence[Finish]] = None) -> List[asyncio.Task[Union[np.ndarray, Exception]]]:
        """One `execute()` batch: expire idle streams (never those with a request here or queued),
        then `submit` every request in arrival order (with its `finish`, if given)."""
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

    @staticmethod
    def _finished(loop, result, finish):
        future = loop.create_future()
        if finish is not None:
            finish(result)
        future.set_result(result)
        return future

    def _stream_cap_error(self, live: int) -> StreamCapError:
        settings = self.settings
        return StreamCapError(f"resource exhausted: this code2wav instance already holds {live} live streams, its "
                              f"limit (max_live_streams={settings.max_live_streams}); the new stream was refused "
                              "and no other stream was affected. Retry later, or END streams that are done (an "
                              f"abandoned stream is freed after {settings.stream_idle_timeout_s:g} s idle)")
