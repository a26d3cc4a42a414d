"""Stream Mimi codes through `code2wav` over one gRPC stream and collect PCM and latency statistics.

One stream of codes = one Triton sequence: a non-zero sequence id, START on its first request, END on
its last. Frames are sent the way the speech pipeline sends them: a first chunk of one frame (the
shortest time to first audio), then chunks of `chunk_frames` frames.

Request contract (README, "The request contract"), every tensor with a leading batch dimension of 1:
    input_ids     INT64 [1, k*F]  codebook-major codes of the chunk (delta) or of the stream so far
                                  (cumulative)
    frame_offset  INT64 [1, 1]    index of the first frame of input_ids within the stream (optional)
    model_outputs FP32  [1, 1920*N] PCM of the N frames the request newly decoded
    sr            INT32 [1, 1]    24000

Pacing:
    paced    each chunk is sent when its last frame would have been produced (frame j at
             j * 80 ms after the stream started), whether or not earlier responses came back; the
             starts of concurrent streams are spread evenly over one chunk period, as live
             conversations do not start in lockstep.
    unpaced  each stream sends its next chunk as soon as the previous response arrived (one request
             in flight per stream): the fastest the server decodes that stream.

All streams share one `InferenceServerClient` and one gRPC stream; responses are routed to their
stream by request id ("<sequence id>-<chunk index>").
"""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

MODEL_NAME = "code2wav"
DEFAULT_URL = "127.0.0.1:8001"
NUM_CODEBOOKS = 8
CODEBOOK_SIZE = 2048
SAMPLE_RATE_HZ = 24000
SAMPLES_PER_FRAME = 1920
FRAME_DURATION_S = SAMPLES_PER_FRAME / SAMPLE_RATE_HZ  # 80 ms: one frame every 80 ms
DEFAULT_CHUNK_FRAMES = 4
FIRST_CHUNK_FRAMES = 1
MODES = ("delta", "cumulative")
PCM_OUTPUT = "model_outputs"
SAMPLE_RATE_OUTPUT = "sr"
# Sequence ids are drawn at random below this bound so that clients sharing a server do not collide.
_SEQUENCE_ID_LIMIT = 1 << 62


class ClientError(RuntimeError):
    """A failure the user can act on; the message is one line."""


def chunk_bounds(total_frames: int, chunk_frames: int, first_chunk_frames: int = FIRST_CHUNK_FRAMES) -> list[tuple[int, int]]:
    """[start, stop) frame ranges of the requests for a stream of `total_frames` frames: the first
    holds `first_chunk_frames`, the others `chunk_frames` (the last one the remainder)."""
    if total_frames < 1:
        raise ValueError(f"a stream needs at least one frame, got {total_frames}")
    if chunk_frames < 1 or first_chunk_frames < 1:
        raise ValueError(f"chunk sizes must be >= 1, got first {first_chunk_frames}, then {chunk_frames}")
    bounds = [(0, min(first_chunk_frames, total_frames))]
    while bounds[-1][1] < total_frames:
        start = bounds[-1][1]
        bounds.append((start, min(start + chunk_frames, total_frames)))
    return bounds


def validate_codes(codes: np.ndarray, num_codebooks: int = NUM_CODEBOOKS, codebook_size: int = CODEBOOK_SIZE) -> np.ndarray:
    """Codes as int64 [k, F]; a leading batch dimension of 1 is dropped. Raises ClientError."""
    codes = np.asarray(codes)
    if codes.ndim == 3 and codes.shape[0] == 1:
        codes = codes[0]
    if codes.ndim != 2 or codes.shape[0] != num_codebooks or codes.shape[1] < 1:
        raise ClientError(f"codes must have shape [{num_codebooks}, frames] with frames >= 1, got {list(codes.shape)}")
    if not np.issubdtype(codes.dtype, np.integer):
        raise ClientError(f"codes must be integers, got dtype {codes.dtype}")
    if codes.min() < 0 or codes.max() >= codebook_size:
        raise ClientError(f"codes must lie in [0, {codebook_size}), got [{codes.min()}, {codes.max()}]")
    return codes.astype(np.int64)


def random_codes(frames: int, seed: int, num_codebooks: int = NUM_CODEBOOKS, codebook_size: int = CODEBOOK_SIZE) -> np.ndarray:
    """Seeded uniform codes, int64 [k, frames]."""
    return np.random.default_rng(seed).integers(0, codebook_size, (num_codebooks, frames), dtype=np.int64)


def request_arrays(codes: np.ndarray, start: int, stop: int, mode: str, send_frame_offset: bool) -> dict[str, np.ndarray]:
    """The request tensors (batch dimension included) for frames [start, stop) of a stream."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    first = start if mode == "delta" else 0
    arrays = {"input_ids": np.ascontiguousarray(codes[:, first:stop]).reshape(1, -1)}
    if send_frame_offset:
        arrays["frame_offset"] = np.array([[first]], dtype=np.int64)
    return arrays


@dataclass(frozen=True)
class StreamOptions:
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    first_chunk_frames: int = FIRST_CHUNK_FRAMES
    mode: str = "delta"  # delta: each request holds its new frames; cumulative: the stream so far
    send_frame_offset: bool = True
    paced: bool = False
    model_name: str = MODEL_NAME
    # A request without an answer for this long fails the run.
    response_timeout_s: float = 60.0

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ClientError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.chunk_frames < 1 or self.first_chunk_frames < 1:
            raise ClientError("chunk sizes must be >= 1 frame")


@dataclass
class StreamResult:
    """One decoded stream. Times are time.perf_counter() seconds."""

    sequence_id: int
    frames: int
    pcm: np.ndarray  # float32 [frames * 1920]
    chunk_frames: list[int]  # new frames of each request
    chunk_latencies_s: list[float]  # send -> response, per request
    started_s: float  # first request sent
    finished_s: float  # last response received

    @property
    def first_chunk_latency_s(self) -> float:
        return self.chunk_latencies_s[0]

    @property
    def audio_s(self) -> float:
        return self.frames * FRAME_DURATION_S

    @property
    def wall_s(self) -> float:
        return self.finished_s - self.started_s

    @property
    def real_time_factor(self) -> float:
        """Audio seconds per wall second (> 1: faster than real time)."""
        return self.audio_s / self.wall_s if self.wall_s > 0 else float("inf")


@dataclass
class RunReport:
    """All streams of one run, and the statistics a summary shows."""

    results: list[StreamResult]
    options: StreamOptions
    wall_s: float  # first request of any stream -> last response of any stream
    extra: dict = field(default_factory=dict)

    @property
    def audio_s(self) -> float:
        return sum(r.audio_s for r in self.results)

    @property
    def frames(self) -> int:
        return sum(r.frames for r in self.results)

    @property
    def real_time_factor(self) -> float:
        """Total audio seconds of all streams per wall second of the run."""
        return self.audio_s / self.wall_s if self.wall_s > 0 else float("inf")

    def summary(self) -> dict:
        """Latencies in milliseconds; first-chunk latency over streams, chunk percentiles over all requests."""
        latencies_ms = np.array([x for r in self.results for x in r.chunk_latencies_s]) * 1e3
        first_ms = np.array([r.first_chunk_latency_s for r in self.results]) * 1e3
        return {
            "streams": len(self.results),
            "paced": self.options.paced,
            "mode": self.options.mode,
            "chunk_frames": self.options.chunk_frames,
            "frames_per_stream": self.results[0].frames if self.results else 0,
            "requests": int(latencies_ms.size),
            "first_chunk_latency_ms_mean": float(first_ms.mean()),
            "first_chunk_latency_ms_max": float(first_ms.max()),
            "chunk_latency_ms_p50": float(np.percentile(latencies_ms, 50)),
            "chunk_latency_ms_p90": float(np.percentile(latencies_ms, 90)),
            "chunk_latency_ms_p99": float(np.percentile(latencies_ms, 99)),
            "audio_s": self.audio_s,
            "wall_s": self.wall_s,
            "real_time_factor": self.real_time_factor,
            "real_time_factor_per_stream_min": float(min(r.real_time_factor for r in self.results)),
            "frames_per_s": self.frames / self.wall_s if self.wall_s > 0 else float("inf"),
        }


def _grpc_reason(exc: Exception) -> str:
    """The useful part of a gRPC error, one line."""
    text = " ".join(str(exc).split())
    if "Connection refused" in text or "connection refused" in text:
        return "connection refused"
    if "Deadline Exceeded" in text or "DEADLINE_EXCEEDED" in text:
        return "no answer in time"
    return text


class _Stream:
    """Book-keeping for one sequence within a run."""

    def __init__(self, sequence_id: int, codes: np.ndarray, options: StreamOptions, start_offset_s: float):
        self.sequence_id = sequence_id
        self.codes = codes
        self.bounds = chunk_bounds(codes.shape[1], options.chunk_frames, options.first_chunk_frames)
        self.start_offset_s = start_offset_s
        self.next_chunk = 0
        self.sent_s: dict[int, float] = {}
        self.latencies_s: list[float | None] = [None] * len(self.bounds)
        self.pcm: list[np.ndarray | None] = [None] * len(self.bounds)
        self.received = 0
        self.finished_s = 0.0

    @property
    def done(self) -> bool:
        return self.received == len(self.bounds)

    @property
    def in_flight(self) -> int:
        return self.next_chunk - self.received

    def due_s(self, chunk: int, run_start_s: float) -> float:
        """When a paced chunk is sent: once its last frame exists (frame j exists at j * 80 ms)."""
        return run_start_s + self.start_offset_s + (self.bounds[chunk][1] - 1) * FRAME_DURATION_S


class Code2WavStreamer:
    """gRPC client for `code2wav`. Use as a context manager; `check_ready()` before `run()`.

        with Code2WavStreamer("127.0.0.1:8001") as streamer:
            streamer.check_ready()
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

    def check_ready(self, timeout_s: float = 10.0) -> None:
        """Raise ClientError (one line) unless the server answers and the model is ready."""
        from tritonclient.utils import InferenceServerException

        try:
            live = self._client.is_server_live(client_timeout=timeout_s)
        except InferenceServerException as exc:
            hint = "is the server running?"
            if "://" in self.url:
                hint = "give the gRPC address as host:port, without a scheme such as http://"
            elif ":" not in self.url:
                hint = "give the gRPC address as host:port (the gRPC port, 8001 by default)"
            raise ClientError(f"cannot reach Triton (gRPC) at {self.url}: {_grpc_reason(exc)}; {hint}") from None
        if not live:
            raise ClientError(f"Triton at {self.url} answers but is not live")
        try:
            ready = self._client.is_model_ready(self.model_name, client_timeout=timeout_s)
        except InferenceServerException as exc:
            raise ClientError(f"Triton at {self.url}: readiness of model '{self.model_name}' unknown: {_grpc_reason(exc)}") from None
        if not ready:
            raise ClientError(
                f"model '{self.model_name}' is not ready on Triton at {self.url} ({self._model_state()}); "
                "see the server log"
            )

    def _model_state(self) -> str:
        try:
            index = self._client.get_model_repository_index(as_json=True).get("models", [])
        except Exception:  # the index only decorates the message
            return "state unknown"
        for model in index:
            if model.get("name") == self.model_name:
                reason = model.get("reason")
                return f"state {model.get('state', 'UNKNOWN')}" + (f": {reason}" if reason else "")
        return "not in the model repository"

    def _inputs(self, arrays: dict[str, np.ndarray]):
        inputs = []
        for name, array in arrays.items():
            tensor = self._grpc.InferInput(name, list(array.shape), "INT64")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs

    def run(
        self,
        streams_codes: Sequence[np.ndarray],
        options: StreamOptions = StreamOptions(),
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
        if sequence_ids is None:
            base = int.from_bytes(os.urandom(8), "little") % (_SEQUENCE_ID_LIMIT - len(codes_list)) + 1
            sequence_ids = [base + i for i in range(len(codes_list))]
        if len(sequence_ids) != len(codes_list) or len(set(sequence_ids)) != len(sequence_ids) or 0 in sequence_ids:
            raise ClientError("sequence ids must be distinct, non-zero, one per stream")
        period_s = options.chunk_frames * FRAME_DURATION_S
        streams = [
            _Stream(sid, codes, options, (i * period_s / len(codes_list)) if options.paced else 0.0)
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

    def _send(self, stream: _Stream, options: StreamOptions) -> None:
        chunk = stream.next_chunk
        start, stop = stream.bounds[chunk]
        arrays = request_arrays(stream.codes, start, stop, options.mode, options.send_frame_offset)
        stream.sent_s[chunk] = time.perf_counter()
        self._client.async_stream_infer(
            options.model_name,
            self._inputs(arrays),
            request_id=f"{stream.sequence_id}-{chunk}",
            sequence_id=stream.sequence_id,
            sequence_start=chunk == 0,
            sequence_end=chunk == len(stream.bounds) - 1,
        )
        stream.next_chunk += 1

    @staticmethod
    def _route(result, by_id: dict[int, _Stream]) -> tuple[_Stream, int]:
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
    def _pcm(result, stream: _Stream, chunk: int) -> np.ndarray:
        start, stop = stream.bounds[chunk]
        pcm = result.as_numpy(PCM_OUTPUT)
        expected = (stop - start) * SAMPLES_PER_FRAME
        if pcm is None or pcm.size != expected:
            got = "no PCM" if pcm is None else f"{pcm.size} samples"
            raise ClientError(
                f"sequence {stream.sequence_id}, frames [{start}, {stop}): expected {expected} samples, got {got}"
            )
        sample_rate = result.as_numpy(SAMPLE_RATE_OUTPUT)
        if sample_rate is not None and int(sample_rate.reshape(-1)[0]) != SAMPLE_RATE_HZ:
            raise ClientError(f"server reports sample rate {int(sample_rate.reshape(-1)[0])}, expected {SAMPLE_RATE_HZ}")
        return pcm.reshape(-1)

    @staticmethod
    def _check_overdue(streams: list[_Stream], options: StreamOptions) -> None:
        now = time.perf_counter()
        for stream in streams:
            for chunk in range(stream.next_chunk):
                if stream.pcm[chunk] is None and now - stream.sent_s[chunk] > options.response_timeout_s:
                    start, stop = stream.bounds[chunk]
                    raise ClientError(
                        f"no response in {options.response_timeout_s:g} s for sequence {stream.sequence_id}, "
                        f"frames [{start}, {stop})"
                    )


def decode(
    codes: np.ndarray,
    url: str = DEFAULT_URL,
    options: StreamOptions = StreamOptions(),
    sequence_id: int | None = None,
) -> tuple[np.ndarray, RunReport]:
    """Decode one stream of codes [k, F] on a running server; returns (PCM float32 [F*1920], report)."""
    with Code2WavStreamer(url, options.model_name) as streamer:
        streamer.check_ready()
        report = streamer.run([codes], options, None if sequence_id is None else [sequence_id])
    return report.results[0].pcm, report
