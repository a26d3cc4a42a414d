"""The request contract of `code2wav` as the clients speak it (docs/design.md §2), without I/O."""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

MODEL_NAME = "code2wav"
DEFAULT_URL = "127.0.0.1:8001"
NUM_CODEBOOKS = 8
CODEBOOK_SIZE = 2048
SAMPLE_RATE_HZ = 24000
SAMPLES_PER_FRAME = 1920
FRAME_DURATION_S = SAMPLES_PER_FRAME / SAMPLE_RATE_HZ  # 80 ms
FRAMES_PER_SECOND = 1 / FRAME_DURATION_S  # 12.5: what one live stream needs decoded per second
DEFAULT_CHUNK_FRAMES = 4
FIRST_CHUNK_FRAMES = 1
MODES = ("delta", "cumulative")
HISTORY_FRAMES_INPUT = "history_frames"
STREAM_KEY_HEADER = "code2wav-stream"  # gRPC metadata: a proxy hashing it sends a whole stream to one replica
DEFAULT_RESUME_HISTORY_FRAMES = 250  # 20 s of history rebuild the decoder state (docs/benchmarks.md, "Resume by replay")
DEFAULT_RESUME_TIMEOUT_S = 30.0
DEFAULT_RESUME_PIECE_FRAMES = 16  # history frames per resume request: short pieces share the server's replay lane
# No message size limit, and reconnects within a second instead of gRPC's backoff of up to two minutes. gRPC reads
# min_reconnect_backoff_ms as the least time a connection attempt gets: 5 s, so a loaded host still connects.
CHANNEL_ARGS = (("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1),
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 5000),
                ("grpc.max_reconnect_backoff_ms", 1000))
# Triton's answer (UNAVAILABLE, as a lost server) to a restricted-protocol call without the right key.
RESTRICTED_FRAGMENT = "is restricted, expecting header"
_SEQUENCE_ID_LIMIT = 1 << 62


class ClientError(RuntimeError):
    """A failure the user can act on; the message is one line."""


@dataclass(frozen=True)
class StreamOptions:
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    first_chunk_frames: int = FIRST_CHUNK_FRAMES
    mode: str = "delta"  # delta: each request holds its new frames; cumulative: the stream so far
    send_frame_offset: bool = True
    paced: bool = False
    catch_up: bool = False  # paced only: each request carries every frame produced since the last
    model_name: str = MODEL_NAME
    response_timeout_s: float = 60.0  # a request without an answer for this long fails (and is resumed)
    resume: bool = True  # False: a lost server fails the stream at once
    resume_history_frames: int = DEFAULT_RESUME_HISTORY_FRAMES  # frames re-sent as history on a resume
    resume_timeout_s: float = DEFAULT_RESUME_TIMEOUT_S  # how long to keep trying to resume
    resume_piece_frames: int = DEFAULT_RESUME_PIECE_FRAMES  # most history frames per resume request

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ClientError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.chunk_frames < 1 or self.first_chunk_frames < 1:
            raise ClientError("chunk sizes must be >= 1 frame")
        if self.catch_up and not self.paced:
            raise ClientError("catch_up paces requests: it needs paced=True")
        if self.resume_piece_frames < 1 or self.resume_history_frames < 0:
            raise ClientError(f"resume_piece_frames must be >= 1 and resume_history_frames >= 0, got "
                              f"{self.resume_piece_frames} and {self.resume_history_frames}")
        if not self.resume_timeout_s > 0 or not self.response_timeout_s > 0:
            raise ClientError(f"timeouts must be > 0 s, got response {self.response_timeout_s:g} s, "
                              f"resume {self.resume_timeout_s:g} s")


DEFAULT_OPTIONS = StreamOptions()  # frozen: safe as a default argument


def chunk_bounds(total_frames: int, chunk_frames: int, first_chunk_frames: int = FIRST_CHUNK_FRAMES,
                 schedule: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """[start, stop) of a stream's requests: `first_chunk_frames`, then `chunk_frames` (or `schedule` in turn)."""
    sizes = list(schedule) if schedule else [first_chunk_frames, chunk_frames]
    if total_frames < 1 or min(sizes) < 1:
        raise ValueError(f"a stream needs frames, and chunks of >= 1 frame: got {total_frames} frames, chunks {sizes}")
    turns = itertools.cycle(sizes) if schedule else itertools.chain(sizes[:1], itertools.repeat(sizes[1]))
    bounds = [(0, min(next(turns), total_frames))]
    while bounds[-1][1] < total_frames:
        bounds.append((bounds[-1][1], min(bounds[-1][1] + next(turns), total_frames)))
    return bounds


def validate_codes(codes: np.ndarray) -> np.ndarray:
    """Codes as int64 [k, F]; a leading batch dimension of 1 is dropped. Raises ClientError."""
    codes = np.asarray(codes)
    if codes.ndim == 3 and codes.shape[0] == 1:
        codes = codes[0]
    if codes.ndim != 2 or codes.shape[0] != NUM_CODEBOOKS or codes.shape[1] < 1:
        raise ClientError(f"codes must have shape [{NUM_CODEBOOKS}, frames] with frames >= 1, got {list(codes.shape)}")
    if not np.issubdtype(codes.dtype, np.integer):
        raise ClientError(f"codes must be integers, got dtype {codes.dtype}")
    if codes.min() < 0 or codes.max() >= CODEBOOK_SIZE:
        raise ClientError(f"codes must lie in [0, {CODEBOOK_SIZE}), got [{codes.min()}, {codes.max()}]")
    return codes.astype(np.int64)


def random_codes(frames: int, seed: int) -> np.ndarray:
    """Seeded uniform codes, int64 [k, frames]."""
    return np.random.default_rng(seed).integers(0, CODEBOOK_SIZE, (NUM_CODEBOOKS, frames), dtype=np.int64)


def contract_arrays(codes: np.ndarray, frame_offset: int | None = None,
                    history_frames: int | None = None) -> dict[str, np.ndarray]:
    """`input_ids` INT64 [1, k*F] (codebook-major) of codes [k, F], and the optional scalars INT64 [1, 1]."""
    arrays = {"input_ids": np.ascontiguousarray(codes, dtype=np.int64).reshape(1, -1)}
    for name, value in (("frame_offset", frame_offset), (HISTORY_FRAMES_INPUT, history_frames)):
        if value is not None:
            arrays[name] = np.array([[value]], np.int64)
    return arrays


def infer_inputs(grpc_module, arrays: dict[str, np.ndarray]) -> list:
    """The request tensors as `InferInput`s of `grpc_module` (tritonclient.grpc or tritonclient.grpc.aio)."""
    return [grpc_module.InferInput(name, list(array.shape), "INT64").set_data_from_numpy(array)
            for name, array in arrays.items()]


def answer_pcm(result, least_frames: int, most_frames: int, where: str) -> np.ndarray:
    """An InferResult's `model_outputs` as float32 [N * 1920], N in [least_frames, most_frames]; `sr` checked."""
    sample_rate = result.as_numpy("sr")
    if sample_rate is not None and (rate := int(sample_rate.reshape(-1)[0])) != SAMPLE_RATE_HZ:
        raise ClientError(f"{where}: server reports sample rate {rate}, expected {SAMPLE_RATE_HZ}")
    pcm = result.as_numpy("model_outputs")
    pcm = np.zeros(0, np.float32) if pcm is None else pcm.reshape(-1)
    least, most = least_frames * SAMPLES_PER_FRAME, most_frames * SAMPLES_PER_FRAME
    if pcm.size % SAMPLES_PER_FRAME or not least <= pcm.size <= most:
        wanted = least if least == most else f"{least}-{most}"
        raise ClientError(f"{where}: expected {wanted} samples, got {pcm.size}")
    return pcm.astype(np.float32, copy=False)


def draw_sequence_ids(count: int, given: Sequence[int] | None = None) -> list[int]:
    """`count` distinct non-zero sequence ids: the given ones, checked, or consecutive from a random start."""
    if given is None:
        base = int.from_bytes(os.urandom(8), "little") % (_SEQUENCE_ID_LIMIT - count) + 1
        return [base + i for i in range(count)]
    given = list(given)
    if len(given) != count or len(set(given)) != count or 0 in given:
        raise ClientError("sequence ids must be distinct, non-zero, one per stream")
    return given


def grpc_reason(exc: Exception) -> str:
    """The useful part of a gRPC error, one line."""
    text = " ".join(str(exc).split())
    if "connection refused" in text.lower():
        return "connection refused"
    if "Deadline Exceeded" in text or "DEADLINE_EXCEEDED" in text:
        return "no answer in time"
    return text


def unreachable(url: str, exc: Exception, tls_hint: str | None = None) -> ClientError:
    """The error for a server that failed a liveness check, with what to try."""
    if tls_hint:
        return ClientError(f"cannot connect to Triton (gRPC) at {url}: {tls_hint} ({grpc_reason(exc)})")
    hint = ("give the gRPC address as host:port, without a scheme such as http://" if "://" in url
            else "give the gRPC address as host:port (the gRPC port, 8001 by default)" if ":" not in url
            else "is the server running?")
    return ClientError(f"cannot reach Triton (gRPC) at {url}: {grpc_reason(exc)}; {hint}")


class RequestFailure(Exception):
    """A request that got no PCM back, as one line; `resumable`: the stream can go on in a new sequence."""

    def __init__(self, message: str, resumable: bool, kind: str | None = None):
        super().__init__(message)
        self.resumable, self.kind = resumable, kind


# What a client does about each code2wav error kind (docs/design.md §2, "Errors"): `fail` the stream,
# `resume` it on a new sequence with its history, or `retry` later (a refused new stream).
FAIL, RESUME, RETRY = "fail", "resume", "retry"
ERROR_ACTIONS = {
    **dict.fromkeys(("dtype", "shape", "length", "code_range", "limit", "negative_offset", "changed_frame",
                     "not_cumulative", "history", "before_resume", "correlation_id", "internal"), FAIL),
    **dict.fromkeys(("unknown_stream", "gap", "history_offset", "unavailable", "decoder"), RESUME),
    "stream_cap": RETRY,
}
_KIND_TAG = re.compile(r"\s*\[code2wav\.([a-z_]+)\]")


def error_kind(message: str) -> str | None:
    """The kind of a code2wav error message (`[code2wav.KIND] ...`); None for a message without one."""
    return match.group(1) if (match := _KIND_TAG.match(message)) else None


def request_failure(exc: Exception) -> RequestFailure:
    """A tritonclient InferenceServerException as a RequestFailure, decided by its kind (unknown: fail). An
    untagged one is Triton or the transport losing the request: resumable, unless Triton refused the key."""
    status, message = exc.status(), exc.message()
    text = " ".join(str(exc if message is None else message).split())
    kind = error_kind(text)
    if kind is None and RESTRICTED_FRAGMENT in text:
        return RequestFailure(f"the server refused the request: it requires the inference key, and the key was "
                              f"missing or wrong ({text})", resumable=False)
    resumable = ERROR_ACTIONS.get(kind, FAIL) != FAIL if kind is not None else True
    if status == "StatusCode.DEADLINE_EXCEEDED":
        text = f"no answer in time ({text})"
    return RequestFailure(f"{status.replace('StatusCode.', '')}: {text}" if status else text, resumable, kind)
