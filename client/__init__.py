"""Client side of code2wav (`mimi_code2wav.client`): the public names in `stream` (the request contract
in `protocol`, resume planning in `plan`, the benchmarks' `streamer`, the `resumable` client, run
`report`s), the asyncio client (`aio`), the `code2wav-client decode` CLI (`decode`), WAV I/O (`wav`)
and perf_analyzer inputs (`perf_inputs`, `perf.sh`).

Needs numpy and tritonclient only: nothing here imports PyTorch, the export or the server side
(a test holds it to that). Imports inside the package are relative, so `python -m client.perf_inputs`
also runs from a plain checkout (the perf_analyzer SDK container does that).
"""
