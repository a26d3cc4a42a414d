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

`Code2WavStreamer` (the benchmarks' client): all streams share one `InferenceServerClient` and one
gRPC stream; responses are routed to their stream by request id ("<sequence id>-<chunk index>"). A
failure ends the run.

`ResumableStream` (resume by replay): one stream on a connection of its own, one request in flight,
every request carrying the gRPC header `code2wav-stream: <stream key>` (STREAM_KEY_HEADER) so that a
proxy can send all of a stream's requests to one replica. It keeps the last R frames whose audio came
back; when the server holding the stream is lost (UNAVAILABLE, connection refused or reset, no answer
in time, "the server is shutting down", or a server that no longer knows the sequence) it STARTs the
sequence again, on the next URL it was given or where the proxy now sends the key, with those R
frames as history (`history_frames`: decoded to rebuild the decoder state, no audio returned) and
the frames whose answer was lost as new frames. Every frame's PCM comes back exactly once, in order.
`run_resumable` runs several of them, one thread each, for the CLI.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

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
HISTORY_FRAMES_INPUT = "history_frames"
# gRPC metadata sent with every request of a resumable stream; its value (the stream key) is the
# same for all of them, so a proxy hashing it (nginx: `hash $http_code2wav_stream consistent`)
# sends a whole stream to one replica.
STREAM_KEY_HEADER = "code2wav-stream"
# Frames replayed when a stream resumes: 250 frames (20 s) rebuild the decoder state to >= 86 dB SNR
# in the first second after the resume (`python -m mimi_code2wav.server.bench.resume`).
DEFAULT_RESUME_HISTORY_FRAMES = 250
DEFAULT_RESUME_TIMEOUT_S = 30.0
# History frames per resume request: short requests, each answered within moments even while many
# streams share the server's replay lane (docs/design.md §2.4).
DEFAULT_RESUME_PIECE_FRAMES = 16
# Waits between resume attempts: none before the first, then doubling up to the cap.
RESUME_BACKOFF_FIRST_S = 0.1
RESUME_BACKOFF_MAX_S = 2.0
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
    # Paced only: at most one request in flight per stream, each carrying every frame produced since
    # the last one (chunk_frames then only sizes the first request): a live client that catches up
    # with multi-frame requests when the server is slower than real time, instead of queueing.
    catch_up: bool = False
    model_name: str = MODEL_NAME
    # A request without an answer for this long fails the run (a resumable stream resumes instead).
    response_timeout_s: float = 60.0
    # Resumable streams only: frames replayed as history when resuming, and how long to keep trying.
    resume_history_frames: int = DEFAULT_RESUME_HISTORY_FRAMES
    resume_timeout_s: float = DEFAULT_RESUME_TIMEOUT_S
    # Resumable streams only: the history travels in requests of at most this many history frames.
    resume_piece_frames: int = DEFAULT_RESUME_PIECE_FRAMES

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ClientError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.chunk_frames < 1 or self.first_chunk_frames < 1:
            raise ClientError("chunk sizes must be >= 1 frame")
        if self.catch_up and not self.paced:
            raise ClientError("catch_up paces requests: it needs paced=True")
        if self.resume_piece_frames < 1:
            raise ClientError(f"resume_piece_frames must be >= 1, got {self.resume_piece_frames}")
        if self.resume_history_frames < 0:
            raise ClientError(f"resume_history_frames must be >= 0, got {self.resume_history_frames}")
        if not self.resume_timeout_s > 0 or not self.response_timeout_s > 0:
            raise ClientError(
                f"timeouts must be > 0 s, got response {self.response_timeout_s:g} s, resume {self.resume_timeout_s:g} s"
            )


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
    resumes: list[Resume] = field(default_factory=list)  # resumable streams: each resume, in order
    stream_key: str | None = None  # resumable streams: the STREAM_KEY_HEADER value
    chunk_sent_s: list[float] = field(default_factory=list)  # resumable streams: when each request was sent

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
            "resumes": sum(len(r.resumes) for r in self.results),
        }


def _sequence_ids(count: int, sequence_ids: Sequence[int] | None) -> list[int]:
    """`count` distinct non-zero sequence ids: the given ones (checked) or consecutive ones from a
    random start (clients sharing a server must not reuse each other's live ids: a START on a live
    id resets that stream)."""
    if sequence_ids is None:
        base = int.from_bytes(os.urandom(8), "little") % (_SEQUENCE_ID_LIMIT - count) + 1
        return [base + i for i in range(count)]
    sequence_ids = list(sequence_ids)
    if len(sequence_ids) != count or len(set(sequence_ids)) != count or 0 in sequence_ids:
        raise ClientError("sequence ids must be distinct, non-zero, one per stream")
    return sequence_ids


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
        sequence_ids = _sequence_ids(len(codes_list), sequence_ids)
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
            sequence_end=stop == stream.codes.shape[1],
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


# ---- resume by replay ------------------------------------------------------------------------------

class RequestFailure(Exception):
    """A request that got no PCM back, as one line. `resumable`: the server holding the stream is gone
    or going, or no longer holds the sequence, so the stream can go on in a new sequence."""

    def __init__(self, message: str, resumable: bool):
        super().__init__(message)
        self.resumable = resumable


# gRPC statuses of a server that is unreachable, gone mid-request or not answering.
_RESUMABLE_STATUSES = ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
# Answers meaning that the server no longer holds the stream, whatever their status: code2wav's and
# Triton's reply to a request of a sequence they do not hold (a restarted server, an expired or
# ended stream) both say "... the START flag"; a server that is exiting says it, and once it has
# unloaded its models (a drain's last moments) Triton says the model "has no available versions".
_STREAM_LOST_FRAGMENTS = ("START flag", "the server is shutting down", "has no available versions")
# A lost connection that some gRPC versions report under another status.
_CONNECTION_LOST_FRAGMENTS = ("socket closed", "connection reset", "connection refused", "stream removed", "broken pipe")


def request_failure(exc: Exception) -> RequestFailure:
    """A tritonclient InferenceServerException (`status()` like "StatusCode.UNAVAILABLE", `message()`)
    as a RequestFailure, resumable or not."""
    status = exc.status() if callable(getattr(exc, "status", None)) else None
    message = exc.message() if callable(getattr(exc, "message", None)) else None
    text = " ".join(str(message if message is not None else exc).split())
    resumable = (
        status in _RESUMABLE_STATUSES
        or any(fragment in text for fragment in _STREAM_LOST_FRAGMENTS)
        or any(fragment in text.lower() for fragment in _CONNECTION_LOST_FRAGMENTS)
    )
    if status == "StatusCode.DEADLINE_EXCEEDED":
        text = f"no answer in time ({text})"
    return RequestFailure(f"{status.replace('StatusCode.', '')}: {text}" if status else text, resumable)


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a resumable stream: its tensors (batch dimension included) and what its answer
    must hold: the PCM of stream frames [first_new_frame, first_new_frame + new_frames)."""

    arrays: dict[str, np.ndarray]
    start: bool
    end: bool
    first_new_frame: int
    new_frames: int
    history_frames: int = 0  # a resume: leading frames of input_ids replayed to rebuild the decoder state

    def describe(self) -> str:
        return f"frames [{self.first_new_frame}, {self.first_new_frame + self.new_frames})"


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

    # A channel of its own (no subchannel shared with other clients of this process), and reconnects
    # within a second instead of gRPC's default backoff of up to two minutes after a failure.
    CHANNEL_ARGS = (
        ("grpc.max_send_message_length", 2**31 - 1),
        ("grpc.max_receive_message_length", 2**31 - 1),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    )

    def __init__(self, url: str, stream_key: str, model_name: str = MODEL_NAME):
        import tritonclient.grpc as grpcclient

        self.url = url
        self.model_name = model_name
        self._grpc = grpcclient
        self._headers = {STREAM_KEY_HEADER: stream_key}
        self._client = grpcclient.InferenceServerClient(url, channel_args=list(self.CHANNEL_ARGS))

    def infer(self, sequence_id: int, request: PlannedRequest, timeout_s: float) -> np.ndarray:
        from tritonclient.utils import InferenceServerException

        inputs = []
        for name, array in request.arrays.items():
            tensor = self._grpc.InferInput(name, list(array.shape), "INT64")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        try:
            result = self._client.infer(
                self.model_name, inputs, sequence_id=sequence_id, sequence_start=request.start,
                sequence_end=request.end, headers=self._headers, client_timeout=timeout_s,
            )
        except InferenceServerException as exc:
            raise request_failure(exc) from None
        sample_rate = result.as_numpy(SAMPLE_RATE_OUTPUT)
        if sample_rate is not None and int(sample_rate.reshape(-1)[0]) != SAMPLE_RATE_HZ:
            raise ClientError(f"{self.url} reports sample rate {int(sample_rate.reshape(-1)[0])}, expected {SAMPLE_RATE_HZ}")
        pcm = result.as_numpy(PCM_OUTPUT)
        return np.zeros(0, np.float32) if pcm is None else pcm

    def close(self) -> None:
        self._client.close()


class ReplayBuffer:
    """The codes a resumable stream keeps for a resume: the last `history_frames` frames whose audio
    came back, and every frame from `keep_from` on (cumulative requests resend the frames since their
    sequence's first one). [k, frames] int64, with the stream index of the first one."""

    def __init__(self, history_frames: int, num_codebooks: int = NUM_CODEBOOKS):
        self.history_frames = history_frames
        self._codes = np.zeros((num_codebooks, 0), np.int64)
        self._first = 0

    @property
    def first_frame(self) -> int:
        return self._first

    @property
    def next_frame(self) -> int:
        """Frames appended so far: the stream index of the next frame."""
        return self._first + self._codes.shape[1]

    def frames(self, first: int) -> np.ndarray:
        """Codes of stream frames [first, next_frame), [k, next_frame - first]."""
        if not self._first <= first <= self.next_frame:
            raise ValueError(f"frame {first} is not kept (kept: [{self._first}, {self.next_frame}))")
        return self._codes[:, first - self._first :]

    def append(self, codes: np.ndarray, keep_from: int | None = None) -> None:
        """Append frames [k, n], then drop those before the last `history_frames` (and before
        `keep_from`, if given)."""
        self._codes = np.concatenate([self._codes, np.asarray(codes, np.int64)], axis=1)
        first = max(self.next_frame - self.history_frames, 0)
        if keep_from is not None:
            first = min(first, keep_from)
        first = max(first, self._first)
        self._codes = self._codes[:, first - self._first :].copy()
        self._first = first


class ResumableStream:
    """One stream of codes decoded by code2wav that survives the loss of the server holding it.

        with ResumableStream(["10.0.0.1:8001", "10.0.0.2:8001"]) as stream:
            pcm = stream.decode(codes[:, 0:1])                  # frame 0
            pcm = stream.decode(codes[:, 1:5])                  # frames 1-4
            pcm = stream.decode(codes[:, 5:9], end=True)        # frames 5-8, END

    `decode(codes [k, F])` sends the stream's next F frames (a delta with `frame_offset`, or as the
    options say) and returns their PCM, float32 [F * 1920]. Every request carries the header
    STREAM_KEY_HEADER with `stream_key` (default: the sequence id in decimal).

    When a request fails because the server is gone or going (see `request_failure`), the stream goes
    on in a new sequence: a START with `frame_offset` o = max(0, n - R), `history_frames` n - o and
    input_ids = the kept frames [o, n) followed by the frames of the failed request, where n is the
    first frame whose audio did not come back and R is `options.resume_history_frames`. The answer
    is the PCM of the failed request's frames: nothing is lost or repeated. Attempts go to the next
    URL of `urls` each (with one URL, to the same address: a proxy routes the key to a live
    replica), the first at once, then after 0.1, 0.2, 0.4 ... 2 s, until `options.resume_timeout_s`
    after the failure; then ClientError says why. Each resume is recorded in `resumes`.

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
        options: StreamOptions = StreamOptions(),
        sequence_id: int | None = None,
        stream_key: str | None = None,
        connect: Connect | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        options.validate()
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ClientError("a resumable stream needs at least one server URL")
        self.options = options
        self.sequence_id = _sequence_ids(1, None if sequence_id is None else [sequence_id])[0]
        self.stream_key = str(self.sequence_id) if stream_key is None else stream_key
        if not self.stream_key:
            raise ClientError("the stream key must not be empty")
        self._connect = connect if connect is not None else (
            lambda url, key: GrpcConnection(url, key, options.model_name))
        self._clock = clock
        self._sleep = sleep
        self._url_index = 0
        self._connection: Connection | None = None
        self._kept = ReplayBuffer(options.resume_history_frames)
        self._base = 0  # stream index of the current sequence's first frame
        self._needs_start = True  # the next request opens a sequence
        self._ended = False
        self._last_answer_s: float | None = None
        self.resumes: list[Resume] = []

    def __enter__(self) -> ResumableStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection. A stream closed before its END request is dropped by the server
        after its idle timeout."""
        self._drop_connection()

    @property
    def url(self) -> str:
        """The server the stream's requests go to now."""
        return self.urls[self._url_index]

    @property
    def next_frame(self) -> int:
        """Frames whose PCM came back: the stream index of the next frame to send."""
        return self._kept.next_frame

    @property
    def ended(self) -> bool:
        return self._ended

    def decode(self, codes: np.ndarray, end: bool = False) -> np.ndarray:
        """Decode the stream's next frames, codes [k, F] (F >= 1), the last ones with `end`; returns
        their PCM, float32 [F * 1920]. Resumes on a new sequence if the server holding the stream is
        lost; raises ClientError when that fails or the failure is not one a resume can fix."""
        codes = validate_codes(codes)
        if self._ended:
            raise ClientError(f"stream {self.stream_key}: decode() after the request that ended it")
        if self._last_answer_s is None:
            self._last_answer_s = self._clock()
        requests = (self.resume_requests(codes, end) if self._needs_start and self.next_frame
                    else [self.request(codes, end)])
        try:
            pcm = self._send_all(requests)
        except RequestFailure as failure:
            self._drop_connection()
            self._needs_start = True
            if not failure.resumable:
                raise ClientError(
                    f"stream {self.stream_key} (sequence {self.sequence_id}), {requests[-1].describe()} on "
                    f"{self.url}: {failure}") from None
            pcm, requests = self._resume(codes, end, failure)
        if requests[0].start:
            self._base = requests[0].first_new_frame - requests[0].history_frames
        self._kept.append(codes, self._base if self.options.mode == "cumulative" else None)
        self._needs_start = False
        self._ended = end
        self._last_answer_s = self._clock()
        return pcm

    def request(self, codes: np.ndarray, end: bool) -> PlannedRequest:
        """The request for the next frames `codes` [k, F] on the current sequence (the first
        request of the stream opens it: START at frame 0)."""
        first = self.next_frame
        if self.options.mode == "cumulative":
            sent_from = self._base
            sent = np.concatenate([self._kept.frames(sent_from), codes], axis=1)
        else:
            sent_from, sent = first, codes
        arrays = {"input_ids": np.ascontiguousarray(sent, dtype=np.int64).reshape(1, -1)}
        if self.options.send_frame_offset:
            arrays["frame_offset"] = np.array([[sent_from]], np.int64)
        return PlannedRequest(arrays, self._needs_start, end, first, codes.shape[1])

    def resume_requests(self, codes: np.ndarray, end: bool) -> list[PlannedRequest]:
        """A new sequence carrying the kept history and then the next frames `codes` [k, F]: a START
        with the first `options.resume_piece_frames` frames of history, requests of history alone for
        the next pieces, and the last piece with the new frames (one request when the history fits in
        a piece). Pieces keep every request short, so a resume never outlasts the server's idle
        timeout however long it waits for the decoder's replay lane (docs/design.md §2.4)."""
        first = self.next_frame
        replay_from = max(self._kept.first_frame, first - self.options.resume_history_frames, 0)
        history = self._kept.frames(replay_from)
        piece = self.options.resume_piece_frames
        requests, done = [], 0
        while history.shape[1] - done > piece:
            requests.append(self._history_request(history[:, done : done + piece], replay_from + done,
                                                  piece, start=not requests, end=False, new_frames=0))
            done += piece
        requests.append(self._history_request(np.concatenate([history[:, done:], codes], axis=1), replay_from + done,
                                              history.shape[1] - done, start=not requests, end=end,
                                              new_frames=codes.shape[1]))
        return requests

    @staticmethod
    def _history_request(codes: np.ndarray, frame_offset: int, history_frames: int, start: bool, end: bool,
                         new_frames: int) -> PlannedRequest:
        arrays = {
            "input_ids": np.ascontiguousarray(codes, np.int64).reshape(1, -1),
            "frame_offset": np.array([[frame_offset]], np.int64),
            HISTORY_FRAMES_INPUT: np.array([[history_frames]], np.int64),
        }
        return PlannedRequest(arrays, start, end, frame_offset + history_frames, new_frames,
                              history_frames=history_frames)

    def _send_all(self, requests: list[PlannedRequest]) -> np.ndarray:
        """Send `requests` in order; returns the last one's PCM (the others hold history only)."""
        for request in requests:
            pcm = self._send(request)
        return pcm

    def _send(self, request: PlannedRequest) -> np.ndarray:
        if self._connection is None:
            self._connection = self._connect(self.url, self.stream_key)
        pcm = np.asarray(self._connection.infer(self.sequence_id, request, self.options.response_timeout_s))
        expected = request.new_frames * SAMPLES_PER_FRAME
        if pcm.size != expected:
            raise ClientError(
                f"stream {self.stream_key} (sequence {self.sequence_id}), {request.describe()} on {self.url}: "
                f"expected {expected} samples, got {pcm.size}")
        return pcm.reshape(-1).astype(np.float32, copy=False)

    def _resume(self, codes: np.ndarray, end: bool, failure: RequestFailure) -> tuple[np.ndarray, list[PlannedRequest]]:
        """Open a new sequence with the kept history until one answers or the resume timeout passes."""
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
            self._sleep(wait_s)
            self._url_index = (self._url_index + 1) % len(self.urls)
            attempts += 1
            requests = self.resume_requests(codes, end)
            try:
                pcm = self._send_all(requests)
            except RequestFailure as exc:
                self._drop_connection()
                if not exc.resumable:
                    raise ClientError(
                        f"stream {self.stream_key} (sequence {self.sequence_id}): resuming at frame "
                        f"{self.next_frame} on {self.url} failed: {exc}") from None
                last = exc
                continue
            self.resumes.append(Resume(
                frame=self.next_frame, stall_s=self._clock() - self._last_answer_s, error=str(failure),
                attempts=attempts, url=self.url, history_frames=sum(r.history_frames for r in requests)))
            return pcm, requests

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
    options: StreamOptions = StreamOptions(),
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
    sequence_ids = _sequence_ids(len(codes_list), sequence_ids)
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
