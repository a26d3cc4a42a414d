"""The code2wav client (`mimi_code2wav.client`): codes in, 24 kHz PCM out, over Triton's gRPC API; threads
here (`sync`), asyncio in `aio`. Needs numpy and tritonclient only (a test holds it to that). Relative
imports let `python -m client.perf_inputs` run from a plain checkout, as the perf_analyzer SDK container does.
"""

from .credentials import Credentials
from .plan import Resume
from .protocol import ClientError, StreamOptions
from .report import RunReport, StreamResult
from .sync import Code2WavClient, Code2WavStream, StreamsFailed, run_streams

__all__ = ["ClientError", "Code2WavClient", "Code2WavStream", "Credentials", "Resume", "RunReport", "StreamOptions",
           "StreamResult", "StreamsFailed", "run_streams"]
