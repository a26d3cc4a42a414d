"""The client's public names in one place: `from mimi_code2wav.client.stream import ...`.

The request contract is docs/design.md §2; the modules beside this one implement the client's side
of it, by role:

- `protocol`: the contract itself (tensors, answer checks, which failures a resume fixes), constants,
  `StreamOptions`, `ClientError`; no I/O.
- `plan`: one resumable stream's requests and resumes without I/O (`StreamPlan`, `ReplayBuffer`).
- `streamer`: `Code2WavStreamer`, the benchmarks' client (many paced streams over one gRPC stream),
  and `decode`.
- `resumable`: `ResumableStream` (a stream that survives a lost server, one thread each) and
  `run_resumable`.
- `report`: `StreamResult` and `RunReport`, what a run of streams reports.
- `aio`: the asyncio client (`Code2WavClient`), many conversations on one event loop.
"""

from .plan import PlannedRequest, ReplayBuffer, Resume, Send, StreamPlan
from .protocol import (
    CODEBOOK_SIZE,
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_RESUME_HISTORY_FRAMES,
    DEFAULT_RESUME_PIECE_FRAMES,
    DEFAULT_RESUME_TIMEOUT_S,
    DEFAULT_URL,
    FIRST_CHUNK_FRAMES,
    FRAME_DURATION_S,
    HISTORY_FRAMES_INPUT,
    MODEL_NAME,
    MODES,
    NUM_CODEBOOKS,
    PCM_OUTPUT,
    SAMPLE_RATE_HZ,
    SAMPLE_RATE_OUTPUT,
    SAMPLES_PER_FRAME,
    STREAM_KEY_HEADER,
    ClientError,
    RequestFailure,
    StreamOptions,
    chunk_bounds,
    random_codes,
    request_arrays,
    request_failure,
    validate_codes,
)
from .report import RunReport, StreamResult
from .resumable import Connect, Connection, GrpcConnection, ResumableStream, StreamsFailed, run_resumable
from .streamer import Code2WavStreamer, decode

__all__ = [
    "CODEBOOK_SIZE", "DEFAULT_CHUNK_FRAMES", "DEFAULT_RESUME_HISTORY_FRAMES", "DEFAULT_RESUME_PIECE_FRAMES",
    "DEFAULT_RESUME_TIMEOUT_S", "DEFAULT_URL", "FIRST_CHUNK_FRAMES", "FRAME_DURATION_S", "HISTORY_FRAMES_INPUT",
    "MODEL_NAME", "MODES", "NUM_CODEBOOKS", "PCM_OUTPUT", "SAMPLE_RATE_HZ", "SAMPLE_RATE_OUTPUT",
    "SAMPLES_PER_FRAME", "STREAM_KEY_HEADER", "ClientError", "Code2WavStreamer", "Connect", "Connection",
    "GrpcConnection", "PlannedRequest", "ReplayBuffer", "RequestFailure", "Resume", "ResumableStream",
    "RunReport", "Send", "StreamOptions", "StreamPlan", "StreamResult", "StreamsFailed", "chunk_bounds",
    "decode", "random_codes", "request_arrays", "request_failure", "run_resumable", "validate_codes",
]
