"""The thread client: `Code2WavClient` and its streams (`Code2WavStream`), each one Triton sequence
over a gRPC connection of its own that drives `plan.StreamPlan`, one request in flight, and survives
the loss of its server (resume by replay, docs/design.md §2.4); `run_streams` decodes several streams
at once, one thread each (the CLI). The asyncio client (`aio`) has the same API with `await`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, Protocol, Sequence

import numpy as np

from .credentials import PLAINTEXT, Credentials
from .plan import PlannedRequest, PlannedStream, Send, StreamPlan
from .protocol import (
    CHANNEL_ARGS,
    DEFAULT_OPTIONS,
    DEFAULT_URL,
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
    """A stream's connection to one server (`GrpcConnection`, or a test's fake)."""

    url: str

    def infer(self, sequence_id: int, request: PlannedRequest, timeout_s: float) -> np.ndarray:
        """Send one request; return `model_outputs` (float32) or raise RequestFailure."""

    def close(self) -> None: ...


Connect = Callable[[str, str], Connection]


class GrpcConnection:
    """A stream's own gRPC channel to one server: unary requests, each with `STREAM_KEY_HEADER`."""

    # No subchannel shared with other clients of this process.
    CHANNEL_ARGS = (*CHANNEL_ARGS, ("grpc.use_local_subchannel_pool", 1))

    def __init__(self, url: str, stream_key: str, model_name: str = MODEL_NAME, credentials: Credentials = PLAINTEXT):
        import tritonclient.grpc as grpcclient

        self.url = url
        self.model_name = model_name
        self._grpc = grpcclient
        self._headers = {**credentials.headers(), STREAM_KEY_HEADER: stream_key}
        self._client = grpcclient.InferenceServerClient(url, channel_args=list(self.CHANNEL_ARGS),
                                                        creds=credentials.channel_credentials())

    def infer(self, sequence_id: int, request: PlannedRequest, timeout_s: float) -> np.ndarray:
        from tritonclient.utils import InferenceServerException

        try:
            result = self._client.infer(
                self.model_name, infer_inputs(self._grpc, request.arrays), sequence_id=sequence_id,
                sequence_start=request.start, sequence_end=request.end, headers=self._headers, client_timeout=timeout_s)
        except InferenceServerException as exc:
            raise request_failure(exc) from None
        return response_pcm(result, f"{self.url}, sequence {sequence_id}, {request.describe()}")

    def close(self) -> None:
        self._client.close()


class Code2WavClient:
    """Streams decoded by code2wav from threads (the package's docstring has an example). `urls`: one
    server (or a proxy), or several to fail over between. `credentials` adds TLS and the inference
    key; `connect(url, stream_key) -> Connection`, `clock` and `sleep` replace network and time (tests)."""

    def __init__(self, urls: str | Sequence[str] = DEFAULT_URL, options: StreamOptions = DEFAULT_OPTIONS,
                 connect: Connect | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, credentials: Credentials = PLAINTEXT):
        options.validate()
        credentials.validate()
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ClientError("the client needs at least one server URL")
        self.options = options
        self.credentials = credentials
        self._connect = connect if connect is not None else (
            lambda url, key: GrpcConnection(url, key, options.model_name, credentials))
        self._clock, self._sleep = clock, sleep

    def __enter__(self) -> Code2WavClient:
        return self

    def __exit__(self, *exc_info) -> None:
        pass  # every stream closes its own connection

    def check_ready(self, timeout_s: float = 10.0) -> None:
        """Raise ClientError (one line) unless every URL answers and its model is ready (the asyncio
        client's check; call it where no event loop runs)."""
        from .aio import Code2WavClient as AsyncClient

        async def check() -> None:
            async with AsyncClient(self.urls, StreamOptions(model_name=self.options.model_name),
                                   credentials=self.credentials) as client:
                await client.check_ready(timeout_s)

        asyncio.run(check())

    def stream(self, stream_key: str | None = None, sequence_id: int | None = None) -> Code2WavStream:
        """A new stream; `sequence_id` (non-zero) defaults to random, `stream_key` to it in decimal."""
        return Code2WavStream(self, sequence_id, stream_key)


class Code2WavStream(PlannedStream):
    """One stream of a `Code2WavClient` (attributes: `PlannedStream`). A request that fails because
    its server is gone or going (`request_failure`) is resumed on a new sequence, as `plan.StreamPlan`
    says, on the next URL each attempt (with one URL, where a proxy now routes the key), until
    `options.resume_timeout_s`; nothing is lost or repeated. The resumed sequence keeps the sequence
    id: a replica that still holds it (a lost connection) resets it rather than let a second copy
    idle out. A hung server stalls the stream for `options.response_timeout_s` before the resume."""

    def __init__(self, client: Code2WavClient, sequence_id: int | None = None, stream_key: str | None = None):
        self._plan = StreamPlan(client.urls, client.options, sequence_id, stream_key, client._clock)
        self._client = client
        self._connection: Connection | None = None

    def __enter__(self) -> Code2WavStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection; a stream not ENDed is dropped by the server after its idle timeout."""
        self._drop_connection()

    def decode(self, codes: np.ndarray, end: bool = False) -> np.ndarray:
        """PCM float32 [F * 1920] of the stream's next frames, codes [k, F] (F >= 1), the last ones with
        `end`. Raises ClientError when a resume fails or cannot fix the failure."""
        steps, outcome = self._plan.exchange(*self._plan.hand(codes, end), end), None
        while True:
            try:
                step = steps.send(outcome)
            except StopIteration as done:
                return done.value
            outcome = self._send(step) if isinstance(step, Send) else self._client._sleep(step)

    def _send(self, step: Send) -> np.ndarray | RequestFailure:
        if self._connection is not None and self._connection.url != step.url:
            self._drop_connection()
        if self._connection is None:
            self._connection = self._client._connect(step.url, self.stream_key)
        try:
            return self._connection.infer(self.sequence_id, step.request, self._client.options.response_timeout_s)
        except RequestFailure as failure:
            self._drop_connection()
            return failure

    def _drop_connection(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            connection.close()


class StreamsFailed(ClientError):
    """A run that a stream's failure stopped; `received`: per stream, the PCM that came back before
    (float32, whole frames: it stopped at frame `len(pcm) // 1920`)."""

    def __init__(self, message: str, received: list[np.ndarray]):
        super().__init__(message)
        self.received = received


def run_streams(urls: str | Sequence[str], streams_codes: Sequence[np.ndarray],
                options: StreamOptions = DEFAULT_OPTIONS, sequence_ids: Sequence[int] | None = None,
                stream_keys: Sequence[str] | None = None, progress: Callable[[int, int], None] | None = None,
                connect: Connect | None = None, credentials: Credentials = PLAINTEXT) -> RunReport:
    """Decode each [k, F] code array as its own `Code2WavStream`, all at once, one thread each.

    Requests hold `options.first_chunk_frames` frames, then `options.chunk_frames`. Unpaced, each goes
    when the previous answer came back; paced, when its last frame would exist too (frame j at
    j * 80 ms, the streams' starts spread over one request's period); with `catch_up`, each carries
    every frame existing by then. The first stream to fail stops the others: StreamsFailed."""
    client = Code2WavClient(urls, options, connect, credentials=credentials)
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
        total = codes.shape[1]
        bounds = chunk_bounds(total, options.chunk_frames, options.first_chunk_frames)
        start_s = run_start_s + (index * period_s / len(codes_list) if options.paced else 0.0)
        pcm, sizes, latencies_s, sent_times_s = received[index], [], [], []
        with client.stream(stream_keys[index], sequence_ids[index]) as stream:
            first = 0
            while first < total:
                stop_frame = bounds[len(sizes)][1] if not options.catch_up else min(
                    total, first + (options.first_chunk_frames if first == 0 else 1))
                if options.paced:
                    wait_s = start_s + (stop_frame - 1) * FRAME_DURATION_S - time.perf_counter()
                    if wait_s > 0 and stop.wait(wait_s):
                        return
                    if options.catch_up and first > 0:  # every frame produced by now
                        produced = int((time.perf_counter() - start_s) / FRAME_DURATION_S) + 1
                        stop_frame = min(total, max(stop_frame, produced))
                if stop.is_set():
                    return
                sent_s = time.perf_counter()
                pcm.append(stream.decode(codes[:, first:stop_frame], end=stop_frame == total))
                latencies_s.append(time.perf_counter() - sent_s)
                sent_times_s.append(sent_s)
                sizes.append(stop_frame - first)
                with lock:
                    frames_done += stop_frame - first
                    if progress is not None:
                        progress(frames_done, frames_total)
                first = stop_frame
            results[index] = StreamResult(
                sequence_id=stream.sequence_id, frames=total, pcm=np.concatenate(pcm), chunk_frames=sizes,
                chunk_latencies_s=latencies_s, started_s=sent_times_s[0], finished_s=time.perf_counter(),
                resumes=list(stream.resumes), stream_key=stream.stream_key, chunk_sent_s=sent_times_s,
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
