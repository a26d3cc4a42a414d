"""`Code2WavStreamer`, the sweep's load generator: many streams of codes over one bidirectional gRPC
stream, paced as a speech pipeline sends them (several requests of a stream may be in flight),
collecting PCM and latency statistics. The users' clients are `mimi_code2wav.client` (threads) and
`mimi_code2wav.client.aio`.

One stream of codes = one Triton sequence: a non-zero sequence id, START on its first request, END on
its last. Frames are sent the way the speech pipeline sends them: a first chunk of one frame (the
shortest time to first audio), then chunks of `chunk_frames` frames. The request tensors are
`protocol`'s (the contract: docs/design.md §2).

Pacing:
    paced    each chunk is sent when its last frame would have been produced (frame j at
             j * 80 ms after the stream started), whether or not earlier responses came back; the
             starts of concurrent streams are spread evenly over one chunk period, as live
             conversations do not start in lockstep.
    unpaced  each stream sends its next chunk as soon as the previous response arrived (one request
             in flight per stream): the fastest the server decodes that stream.

All streams share one `InferenceServerClient` and one gRPC stream; responses are routed to their
stream by request id ("<sequence id>-<chunk index>"). A failure ends the run.
"""

from __future__ import annotations

import queue
import time
from typing import Callable, Sequence

import numpy as np

from mimi_code2wav.client.protocol import (
    DEFAULT_OPTIONS,
    DEFAULT_URL,
    FRAME_DURATION_S,
    MODEL_NAME,
    ClientError,
    StreamOptions,
    checked_pcm,
    chunk_bounds,
    draw_sequence_ids,
    infer_inputs,
    request_arrays,
    response_pcm,
    validate_codes,
)
from mimi_code2wav.client.report import RunReport, StreamResult


class ScheduledStream:
    """One sequence of a `Code2WavStreamer` run: its chunks and when each is due, what was sent and
    what came back."""

    def __init__(self, sequence_id: int, codes: np.ndarray, options: StreamOptions, start_offset_s: float):
        self.sequence_id = sequence_id
        self.codes = codes
        # With catch_up the chunks are decided as the stream goes (`catch_up_chunk`).
        self.bounds = [] if options.catch_up else chunk_bounds(codes.shape[1], options.chunk_frames,
                                                               options.first_chunk_frames)
        self.start_offset_s = start_offset_s
        self.next_chunk = 0
        self.sent_s: dict[int, float] = {}
        self.latencies_s: list[float | None] = [None] * len(self.bounds)
        self.pcm: list[np.ndarray | None] = [None] * len(self.bounds)
        self.received = 0
        self.frames_received = 0
        self.finished_s = 0.0

    @property
    def done(self) -> bool:
        return self.frames_received == self.codes.shape[1]

    def catch_up_chunk(self, now_s: float, run_start_s: float, first_chunk_frames: int) -> float | None:
        """Catch-up pacing: with nothing in flight, add a chunk of every frame that exists and was not
        sent (the first chunk: `first_chunk_frames`, once they exist) and return None; else return
        when the next frame will exist (or None while a request is in flight or all was sent)."""
        sent = self.bounds[-1][1] if self.bounds else 0
        total = self.codes.shape[1]
        if self.in_flight or sent == total:
            return None
        elapsed = now_s - run_start_s - self.start_offset_s
        exist = min(total, int(elapsed / FRAME_DURATION_S) + 1) if elapsed >= 0 else 0
        wanted = min(total, first_chunk_frames) if not self.bounds else sent + 1
        if exist < wanted:
            return run_start_s + self.start_offset_s + (wanted - 1) * FRAME_DURATION_S
        self.bounds.append((sent, exist))
        self.latencies_s.append(None)
        self.pcm.append(None)
        return None

    @property
    def in_flight(self) -> int:
        return self.next_chunk - self.received

    def due_s(self, chunk: int, run_start_s: float) -> float:
        """When a paced chunk is sent: once its last frame exists (frame j exists at j * 80 ms)."""
        return run_start_s + self.start_offset_s + (self.bounds[chunk][1] - 1) * FRAME_DURATION_S


class Code2WavStreamer:
    """gRPC client for `code2wav`, as a context manager (check the server first with the client's
    `Code2WavClient(url).check_ready()`).

        with Code2WavStreamer("127.0.0.1:8001") as streamer:
            report = streamer.run([codes], StreamOptions(paced=False))
    """

    def __init__(self, url: str = DEFAULT_URL, model_name: str = MODEL_NAME, verbose: bool = False):
        import tritonclient.grpc as grpcclient

        self.url = url
        self.model_name = model_name
        self._grpc = grpcclient
        self._client = grpcclient.InferenceServerClient(url, verbose=verbose)

    def __enter__(self) -> Code2WavStreamer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def run(
        self,
        streams_codes: Sequence[np.ndarray],
        options: StreamOptions = DEFAULT_OPTIONS,
        sequence_ids: Sequence[int] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> RunReport:
        """Decode each [k, F] code array as its own sequence, all concurrently.

        sequence_ids: non-zero, one per stream; default random ones (clients sharing a server must
        not reuse each other's live ids: a START on a live id resets that stream).
        progress(frames_decoded, frames_total) is called as responses arrive.
        """
        options.validate()
        codes_list = [validate_codes(c) for c in streams_codes]
        if not codes_list:
            raise ClientError("no streams to decode")
        sequence_ids = draw_sequence_ids(len(codes_list), sequence_ids)
        period_s = options.chunk_frames * FRAME_DURATION_S
        streams = [
            ScheduledStream(sid, codes, options, (i * period_s / len(codes_list)) if options.paced else 0.0)
            for i, (sid, codes) in enumerate(zip(sequence_ids, codes_list))
        ]
        by_id = {s.sequence_id: s for s in streams}
        frames_total = sum(c.shape[1] for c in codes_list)
        frames_done = 0
        events: queue.Queue = queue.Queue()

        def on_response(result, error):
            events.put((time.perf_counter(), result, error))

        self._client.start_stream(callback=on_response)
        stream_open = True
        try:
            run_start_s = time.perf_counter()
            while not all(s.done for s in streams):
                now = time.perf_counter()
                next_due = None
                for stream in streams:
                    if options.catch_up:
                        due = stream.catch_up_chunk(now, run_start_s, options.first_chunk_frames)
                        if due is not None:
                            next_due = due if next_due is None else min(next_due, due)
                    while stream.next_chunk < len(stream.bounds):
                        if options.paced:
                            due = stream.due_s(stream.next_chunk, run_start_s)
                            if due > now:
                                next_due = due if next_due is None else min(next_due, due)
                                break
                        elif stream.in_flight:
                            break
                        self._send(stream, options)
                        now = time.perf_counter()
                wait_s = options.response_timeout_s if next_due is None else max(0.0, next_due - time.perf_counter())
                try:
                    received_s, result, error = events.get(timeout=wait_s)
                except queue.Empty:
                    self._check_overdue(streams, options)
                    continue
                if error is not None:
                    raise ClientError(f"server error: {' '.join(str(error).split())}")
                stream, chunk = self._route(result, by_id)
                stream.latencies_s[chunk] = received_s - stream.sent_s[chunk]
                stream.pcm[chunk] = self._pcm(result, stream, chunk)
                stream.received += 1
                stream.frames_received += stream.bounds[chunk][1] - stream.bounds[chunk][0]
                stream.finished_s = received_s
                frames_done += stream.bounds[chunk][1] - stream.bounds[chunk][0]
                if progress is not None:
                    progress(frames_done, frames_total)
            self._client.stop_stream()
            stream_open = False
        finally:
            if stream_open:
                # Sequences left open on the server expire after its idle timeout.
                self._client.stop_stream(cancel_requests=True)
        results = [
            StreamResult(
                sequence_id=s.sequence_id,
                frames=s.codes.shape[1],
                pcm=np.concatenate(s.pcm).astype(np.float32, copy=False),
                chunk_frames=[stop - start for start, stop in s.bounds],
                chunk_latencies_s=list(s.latencies_s),
                started_s=s.sent_s[0],
                finished_s=s.finished_s,
            )
            for s in streams
        ]
        wall_s = max(r.finished_s for r in results) - min(r.started_s for r in results)
        return RunReport(results, options, wall_s)

    def _send(self, stream: ScheduledStream, options: StreamOptions) -> None:
        chunk = stream.next_chunk
        start, stop = stream.bounds[chunk]
        arrays = request_arrays(stream.codes, start, stop, options.mode, options.send_frame_offset)
        stream.sent_s[chunk] = time.perf_counter()
        self._client.async_stream_infer(
            options.model_name,
            infer_inputs(self._grpc, arrays),
            request_id=f"{stream.sequence_id}-{chunk}",
            sequence_id=stream.sequence_id,
            sequence_start=chunk == 0,
            sequence_end=stop == stream.codes.shape[1],
        )
        stream.next_chunk += 1

    @staticmethod
    def _route(result, by_id: dict[int, ScheduledStream]) -> tuple[ScheduledStream, int]:
        request_id = result.get_response().id
        try:
            sequence_text, chunk_text = request_id.split("-")
            stream, chunk = by_id[int(sequence_text)], int(chunk_text)
        except (ValueError, KeyError):
            raise ClientError(f"response with unknown request id {request_id!r}") from None
        if chunk not in stream.sent_s or stream.pcm[chunk] is not None:
            raise ClientError(f"unexpected response {request_id!r} (not sent, or answered twice)")
        return stream, chunk

    @staticmethod
    def _pcm(result, stream: ScheduledStream, chunk: int) -> np.ndarray:
        start, stop = stream.bounds[chunk]
        where = f"sequence {stream.sequence_id}, frames [{start}, {stop})"
        return checked_pcm(response_pcm(result, where), stop - start, where)

    @staticmethod
    def _check_overdue(streams: list[ScheduledStream], options: StreamOptions) -> None:
        now = time.perf_counter()
        for stream in streams:
            for chunk in range(stream.next_chunk):
                if stream.pcm[chunk] is None and now - stream.sent_s[chunk] > options.response_timeout_s:
                    start, stop = stream.bounds[chunk]
                    raise ClientError(
                        f"no response in {options.response_timeout_s:g} s for sequence {stream.sequence_id}, "
                        f"frames [{start}, {stop})"
                    )

