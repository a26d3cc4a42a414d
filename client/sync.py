"""The thread client: each stream one Triton sequence on a gRPC connection of its own; `run_streams`: a thread each."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from typing import Callable, Sequence

import numpy as np

from . import protocol
from .credentials import PLAINTEXT, Credentials
from .plan import PlannedClient, PlannedRequest, PlannedStream
from .protocol import DEFAULT_OPTIONS, DEFAULT_URL, FRAME_DURATION_S, ClientError, RequestFailure, StreamOptions
from .report import RunReport, StreamResult


def grpc_connection(url: str, credentials: Credentials):
    """A stream's own channel to `url` (no shared subchannel); `infer(stream, request)` raises RequestFailure."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(
        url, channel_args=[*protocol.CHANNEL_ARGS, ("grpc.use_local_subchannel_pool", 1)],
        creds=credentials.channel_credentials())

    def infer(stream: Code2WavStream, request: PlannedRequest):
        try:
            return client.infer(**stream._infer_args(grpcclient, request))
        except InferenceServerException as exc:
            raise protocol.request_failure(exc) from None

    return types.SimpleNamespace(url=url, infer=infer, close=client.close)


class Code2WavStream(PlannedStream):
    """One stream of a `Code2WavClient`. A resumed sequence keeps the sequence id: a replica that still
    holds it (a lost connection) resets it rather than let a second copy idle out."""

    _connection = None  # a gRPC connection to `url`, opened by the first request

    def __enter__(self) -> Code2WavStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (a later request opens another); a stream not ENDed idles out on the server."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def decode(self, codes: np.ndarray, end: bool = False) -> np.ndarray:
        """PCM float32 [F * 1920] of the stream's next frames, codes [k, F], the last ones with `end`.
        Raises ClientError when a resume fails or cannot fix the failure."""
        steps, outcome = self._plan.exchange(*self._plan.hand(codes, end), end), None
        while True:
            try:
                step = steps.send(outcome)
            except StopIteration as done:
                return done.value
            outcome = self._send(step) if isinstance(step, PlannedRequest) else self._client._sleep(step)

    def _send(self, request: PlannedRequest):
        if self._connection is not None and self._connection.url != self.url:
            self.close()
        if self._connection is None:
            self._connection = self._client._connect(self.url)
        try:
            return self._connection.infer(self, request)
        except RequestFailure as failure:
            self.close()
            return failure


class Code2WavClient(PlannedClient):
    """Streams decoded by code2wav from threads. `connect`, `clock` and `sleep` replace network and time."""

    stream_type = Code2WavStream

    def __init__(self, urls: str | Sequence[str] = DEFAULT_URL, options: StreamOptions = DEFAULT_OPTIONS,
                 connect: Callable | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, credentials: Credentials = PLAINTEXT):
        super().__init__(urls, options, credentials, clock)
        self._connect, self._sleep = connect or (lambda url: grpc_connection(url, credentials)), sleep

    def __enter__(self) -> Code2WavClient:
        return self

    def __exit__(self, *exc_info) -> None:  # nothing to close: each stream closes its own connection
        pass

    def check_ready(self, timeout_s: float = 10.0) -> None:
        """The asyncio client's `check_ready`, for where no event loop runs."""
        from .aio import Code2WavClient as AsyncClient

        async def check() -> None:
            async with AsyncClient(self.urls, StreamOptions(model_name=self.options.model_name),
                                   credentials=self.credentials) as client:
                await client.check_ready(timeout_s)

        asyncio.run(check())


class StreamsFailed(ClientError):
    """A run that a stream's failure stopped; `received`: per stream, the PCM (whole frames) that came back."""

    def __init__(self, message: str, received: list[np.ndarray]):
        super().__init__(message)
        self.received = received


def run_streams(urls: str | Sequence[str], streams_codes: Sequence[np.ndarray],
                options: StreamOptions = DEFAULT_OPTIONS, sequence_ids: Sequence[int] | None = None,
                stream_keys: Sequence[str] | None = None, progress: Callable[[int, int], None] | None = None,
                connect: Callable | None = None, credentials: Credentials = PLAINTEXT) -> RunReport:
    """Decode each [k, F] code array as its own stream, one thread each, in `first_chunk_frames`, then `chunk_frames`;
    a request goes when the previous answer came back (paced: and its last frame exists, frame j at j * 80 ms,
    starts spread over one request's period; `catch_up`: with every frame existing by then). The first stream to
    fail stops the others: StreamsFailed."""
    client = Code2WavClient(urls, options, connect, credentials=credentials)
    codes_list = [protocol.validate_codes(c) for c in streams_codes]
    if not codes_list:
        raise ClientError("no streams to decode")
    sequence_ids = protocol.draw_sequence_ids(len(codes_list), sequence_ids)
    stream_keys = [str(sid) for sid in sequence_ids] if stream_keys is None else list(stream_keys)
    if len(stream_keys) != len(codes_list) or len(set(stream_keys)) != len(stream_keys):
        raise ClientError("stream keys must be distinct, one per stream")
    results: list[StreamResult] = [None] * len(codes_list)
    received: list[list[np.ndarray]] = [[] for _ in codes_list]
    failures: list[BaseException] = []
    stop, lock = threading.Event(), threading.Lock()
    frames_done, frames_total, run_start_s = 0, sum(c.shape[1] for c in codes_list), time.perf_counter()

    def run_one(index: int) -> None:
        nonlocal frames_done
        codes, pcm, sizes, latencies_s, sent_times_s = codes_list[index], received[index], [], [], []
        total, first = codes.shape[1], 0
        bounds = protocol.chunk_bounds(total, options.chunk_frames, options.first_chunk_frames)
        period_s = options.chunk_frames * FRAME_DURATION_S  # a request's: paced streams start spread over it
        start_s = run_start_s + (index * period_s / len(codes_list) if options.paced else 0.0)
        with client.stream(stream_keys[index], sequence_ids[index]) as stream:
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
                sent_times_s.append(time.perf_counter())
                pcm.append(stream.decode(codes[:, first:stop_frame], end=stop_frame == total))
                latencies_s.append(time.perf_counter() - sent_times_s[-1])
                sizes.append(stop_frame - first)
                with lock:
                    frames_done += stop_frame - first
                    if progress is not None:
                        progress(frames_done, frames_total)
                first = stop_frame
            results[index] = StreamResult(
                sequence_id=stream.sequence_id, frames=total, pcm=np.concatenate(pcm), chunk_frames=sizes,
                chunk_latencies_s=latencies_s, started_s=sent_times_s[0], finished_s=time.perf_counter(),
                resumes=list(stream.resumes), stream_key=stream.stream_key, chunk_sent_s=sent_times_s)

    def guarded(index: int) -> None:
        try:
            run_one(index)
        except BaseException as exc:  # reported by the caller's thread
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
    return RunReport(results, options, max(r.finished_s for r in results) - min(r.started_s for r in results))
