"""The resumable client: a stream that survives the loss of the server holding it (resume by replay,
docs/design.md §2.4), one thread per stream.

`ResumableStream` drives `plan.StreamPlan` over a connection of its own, one request in flight,
every request carrying the gRPC header `code2wav-stream: <stream key>` (STREAM_KEY_HEADER) so that a
proxy can send all of a stream's requests to one replica. `run_resumable` runs several of them, one
thread each, for the CLI.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from .plan import PlannedRequest, Send, StreamPlan
from .protocol import (
    CHANNEL_ARGS,
    DEFAULT_OPTIONS,
    FRAME_DURATION_S,
    MODEL_NAME,
    STREAM_KEY_HEADER,
    ClientError,
    RequestFailure,
    StreamOptions,
    chunk_bounds,
    draw_sequence_ids,
    infer_inputs,
    request_failure,
    response_pcm,
    validate_codes,
)
from .report import RunReport, StreamResult


class Connection(Protocol):
    """A resumable stream's connection to one server."""

    url: str

    def infer(self, sequence_id: int, request: PlannedRequest, timeout_s: float) -> np.ndarray:
        """Send one request; return `model_outputs` (float32) or raise RequestFailure."""

    def close(self) -> None: ...


# connect(url, stream key) -> Connection
Connect = Callable[[str, str], Connection]


class GrpcConnection:
    """A resumable stream's own gRPC channel to one server: unary requests (one in flight keeps them
    in order), each carrying `STREAM_KEY_HEADER: stream key`."""

    # A channel of its own: no subchannel shared with other clients of this process.
    CHANNEL_ARGS = (*CHANNEL_ARGS, ("grpc.use_local_subchannel_pool", 1))

    def __init__(self, url: str, stream_key: str, model_name: str = MODEL_NAME):
        import tritonclient.grpc as grpcclient

        self.url = url
        self.model_name = model_name
        self._grpc = grpcclient
        self._headers = {STREAM_KEY_HEADER: stream_key}
        self._client = grpcclient.InferenceServerClient(url, channel_args=list(self.CHANNEL_ARGS))

    def infer(self, sequence_id: int, request: PlannedRequest, timeout_s: float) -> np.ndarray:
        from tritonclient.utils import InferenceServerException

        try:
            result = self._client.infer(
                self.model_name, infer_inputs(self._grpc, request.arrays), sequence_id=sequence_id, sequence_start=request.start,
                sequence_end=request.end, headers=self._headers, client_timeout=timeout_s,
            )
        except InferenceServerException as exc:
            raise request_failure(exc) from None
        return response_pcm(result, f"{self.url}, sequence {sequence_id}, {request.describe()}")

    def close(self) -> None:
        self._client.close()


class ResumableStream(StreamPlan):
    """One stream of codes decoded by code2wav that survives the loss of the server holding it.

        with ResumableStream(["10.0.0.1:8001", "10.0.0.2:8001"]) as stream:
            pcm = stream.decode(codes[:, 0:1])                  # frame 0
            pcm = stream.decode(codes[:, 1:5])                  # frames 1-4
            pcm = stream.decode(codes[:, 5:9], end=True)        # frames 5-8, END

    `decode(codes [k, F])` sends the stream's next F frames (a delta with `frame_offset`, or as the
    options say) and returns their PCM, float32 [F * 1920]. Every request carries the header
    STREAM_KEY_HEADER with `stream_key` (default: the sequence id in decimal).

    When a request fails because the server is gone or going (see `request_failure`), the stream goes
    on in a new sequence with the kept history, as `plan.StreamPlan` says: the answer is the PCM of
    the failed request's frames, nothing is lost or repeated. Attempts go to the next URL of `urls`
    each (with one URL, to the same address: a proxy routes the key to a live replica) until
    `options.resume_timeout_s` after the failure; then ClientError says why. Each resume is recorded
    in `resumes`.

    The resumed sequence keeps the sequence id: on a replica that no longer holds it the START opens
    it, and on one that still does (a lost connection, not a lost server) it resets it (barge-in)
    instead of leaving a second sequence there to idle out. A decoder fault ends the stream on the
    server ("... send its next request with the START flag ..."), so it is resumed like a lost
    server; other failures (an invalid request, a server without `history_frames`) raise ClientError
    at once. A server that hangs instead of failing stalls the stream for
    `options.response_timeout_s` before the resume.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        options: StreamOptions = DEFAULT_OPTIONS,
        sequence_id: int | None = None,
        stream_key: str | None = None,
        connect: Connect | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        super().__init__(urls, options, sequence_id, stream_key, clock)
        self._connect = connect if connect is not None else (
            lambda url, key: GrpcConnection(url, key, options.model_name))
        self._sleep = sleep
        self._connection: Connection | None = None

    def __enter__(self) -> ResumableStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection. A stream closed before its END request is dropped by the server
        after its idle timeout."""
        self._drop_connection()

    def decode(self, codes: np.ndarray, end: bool = False) -> np.ndarray:
        """Decode the stream's next frames, codes [k, F] (F >= 1), the last ones with `end`; returns
        their PCM, float32 [F * 1920]. Resumes on a new sequence if the server holding the stream is
        lost; raises ClientError when that fails or the failure is not one a resume can fix."""
        first, stop = self.hand(codes, end)
        steps, outcome = self.exchange(first, stop, end), None
        while True:
            try:
                step = steps.send(outcome)
            except StopIteration as done:
                return done.value
            if isinstance(step, Send):
                outcome = self._send(step)
            else:
                self._sleep(step)
                outcome = None

    def _send(self, step: Send) -> np.ndarray | RequestFailure:
        if self._connection is not None and self._connection.url != step.url:
            self._drop_connection()
        if self._connection is None:
            self._connection = self._connect(step.url, self.stream_key)
        try:
            return self._connection.infer(self.sequence_id, step.request, self.options.response_timeout_s)
        except RequestFailure as failure:
            self._drop_connection()
            return failure

    def _drop_connection(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            connection.close()


class StreamsFailed(ClientError):
    """A run of resumable streams that a stream's failure stopped: `received` holds, per stream, the
    PCM that came back before the run stopped (float32, whole frames; the stream stopped at frame
    `len(pcm) // 1920`), so that nothing already decoded is lost."""

    def __init__(self, message: str, received: list[np.ndarray]):
        super().__init__(message)
        self.received = received


def run_resumable(
    urls: str | Sequence[str],
    streams_codes: Sequence[np.ndarray],
    options: StreamOptions = DEFAULT_OPTIONS,
    sequence_ids: Sequence[int] | None = None,
    stream_keys: Sequence[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    connect: Connect | None = None,
) -> RunReport:
    """Decode each [k, F] code array as its own `ResumableStream` (own connection, own stream key,
    one request in flight), all concurrently, one thread each; chunks as `chunk_bounds` says.

    Paced: a chunk is sent when its last frame would exist, or when the previous answer came back if
    that is later (one request in flight per stream). stream_keys default to the sequence ids in
    decimal. The first stream that fails stops the others and StreamsFailed is raised, with its
    error and the PCM every stream received until then."""
    options.validate()
    codes_list = [validate_codes(c) for c in streams_codes]
    if not codes_list:
        raise ClientError("no streams to decode")
    sequence_ids = draw_sequence_ids(len(codes_list), sequence_ids)
    stream_keys = [str(sid) for sid in sequence_ids] if stream_keys is None else list(stream_keys)
    if len(stream_keys) != len(codes_list) or len(set(stream_keys)) != len(stream_keys):
        raise ClientError("stream keys must be distinct, one per stream")
    period_s = options.chunk_frames * FRAME_DURATION_S
    frames_total = sum(c.shape[1] for c in codes_list)
    results: list[StreamResult | None] = [None] * len(codes_list)
    received: list[list[np.ndarray]] = [[] for _ in codes_list]
    failures: list[BaseException] = []
    stop = threading.Event()
    lock = threading.Lock()
    frames_done = 0
    run_start_s = time.perf_counter()

    def run_one(index: int) -> None:
        nonlocal frames_done
        codes = codes_list[index]
        bounds = chunk_bounds(codes.shape[1], options.chunk_frames, options.first_chunk_frames)
        start_offset_s = index * period_s / len(codes_list) if options.paced else 0.0
        pcm, latencies_s, sent_times_s, started_s = received[index], [], [], None
        with ResumableStream(urls, options, sequence_ids[index], stream_keys[index], connect) as stream:
            for chunk, (first, stop_frame) in enumerate(bounds):
                if options.paced:
                    wait_s = run_start_s + start_offset_s + (stop_frame - 1) * FRAME_DURATION_S - time.perf_counter()
                    if wait_s > 0 and stop.wait(wait_s):
                        return
                if stop.is_set():
                    return
                sent_s = time.perf_counter()
                started_s = sent_s if started_s is None else started_s
                pcm.append(stream.decode(codes[:, first:stop_frame], end=chunk == len(bounds) - 1))
                latencies_s.append(time.perf_counter() - sent_s)
                sent_times_s.append(sent_s)
                with lock:
                    frames_done += stop_frame - first
                    if progress is not None:
                        progress(frames_done, frames_total)
            results[index] = StreamResult(
                sequence_id=stream.sequence_id, frames=codes.shape[1], pcm=np.concatenate(pcm),
                chunk_frames=[b - a for a, b in bounds], chunk_latencies_s=latencies_s, started_s=started_s,
                finished_s=time.perf_counter(), resumes=list(stream.resumes), stream_key=stream.stream_key,
                chunk_sent_s=sent_times_s,
            )

    def guarded(index: int) -> None:
        try:
            run_one(index)
        except BaseException as exc:  # reported by the caller's thread
            with lock:
                failures.append(exc)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(i,), name=f"code2wav-stream-{i}", daemon=True)
               for i in range(len(codes_list))]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)
    except BaseException:
        stop.set()
        raise
    if failures:
        if not isinstance(failures[0], Exception):
            raise failures[0]
        raise StreamsFailed(str(failures[0]), [np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
                                               for chunks in received]) from failures[0]
    wall_s = max(r.finished_s for r in results) - min(r.started_s for r in results)
    return RunReport(results, options, wall_s)
