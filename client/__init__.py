"""The code2wav client: codes in, 24 kHz PCM out over Triton's gRPC; threads (`sync`) or asyncio (`aio`); numpy and
tritonclient only. Relative imports let `python -m client.perf_inputs` run from a plain checkout (perf_analyzer's)."""

from .credentials import Credentials
from .plan import Resume
from .protocol import ClientError, StreamOptions
from .report import RunReport, StreamResult
from .sync import Code2WavClient, Code2WavStream, StreamsFailed, run_streams

__all__ = ["ClientError", "Code2WavClient", "Code2WavStream", "Credentials", "Resume", "RunReport", "StreamOptions",
           "StreamResult", "StreamsFailed", "run_streams"]
