"""The code2wav client (`mimi_code2wav.client`): codes in, 24 kHz PCM out, over Triton's gRPC API.

    from mimi_code2wav.client import Code2WavClient          # threads; mimi_code2wav.client.aio: asyncio

    client = Code2WavClient("127.0.0.1:8001")                # or several URLs to fail over between
    client.check_ready()
    with client.stream() as stream:                          # one stream = one Triton sequence
        pcm = stream.decode(codes[:, :1])                    # codes int [8, F] -> float32 [F * 1920]
        pcm = stream.decode(codes[:, 1:], end=True)

The public names: `Code2WavClient` and `Code2WavStream` (`sync`; the same API with `await` in `aio`),
`run_streams` (several streams at once, paced or not, one thread each; `RunReport`, `StreamResult`,
`StreamsFailed`), `StreamOptions`, `Credentials` (TLS and the inference key), `ClientError` and
`Resume`. Beside them: the request contract and
its constants (`protocol`), what a stream sends next and how it resumes, without I/O (`plan`), the
`code2wav-client decode` CLI (`decode`), WAV I/O (`wav`) and perf_analyzer inputs (`perf_inputs`,
`perf.sh`).

Needs numpy and tritonclient only: nothing here imports PyTorch, the export or the server side
(a test holds it to that), and tritonclient only once a client talks. Imports inside the package are
relative, so `python -m client.perf_inputs` also runs from a plain checkout (the perf_analyzer SDK
container does that).
"""

from .credentials import Credentials
from .plan import Resume
from .protocol import ClientError, StreamOptions
from .report import RunReport, StreamResult
from .sync import Code2WavClient, Code2WavStream, StreamsFailed, run_streams

__all__ = ["ClientError", "Code2WavClient", "Credentials", "Code2WavStream", "Resume", "RunReport", "StreamOptions", "StreamResult",
           "StreamsFailed", "run_streams"]
