"""The code2wav client (`mimi_code2wav.client`): codes in, 24 kHz PCM out, over Triton's gRPC API.

    from mimi_code2wav.client import Code2WavClient          # threads; mimi_code2wav.client.aio: asyncio

    client = Code2WavClient("127.0.0.1:8001")                # or several URLs to fail over between
    client.check_ready()
    with client.stream() as stream:                          # one stream = one Triton sequence
        pcm = stream.decode(codes[:, :1])                    # codes int [8, F] -> float32 [F * 1920]
        pcm = stream.decode(codes[:, 1:], end=True)

`run_streams` decodes several streams at once (paced or not, one thread each). Modules: the request
contract (`protocol`), what a stream sends and how it resumes, without I/O (`plan`), the CLI
(`decode`), WAV I/O (`wav`), perf_analyzer inputs (`perf_inputs`, `perf.sh`).

Needs numpy and tritonclient only (a test holds it to that; tritonclient is imported once a client
talks). Relative imports let `python -m client.perf_inputs` run from a plain checkout, as the
perf_analyzer SDK container does.
"""

from .credentials import Credentials
from .plan import Resume
from .protocol import ClientError, StreamOptions
from .report import RunReport, StreamResult
from .sync import Code2WavClient, Code2WavStream, StreamsFailed, run_streams

__all__ = ["ClientError", "Code2WavClient", "Credentials", "Code2WavStream", "Resume", "RunReport", "StreamOptions", "StreamResult",
           "StreamsFailed", "run_streams"]
