"""Client side of code2wav: the gRPC streaming helper (`client.stream`), the `python -m client` CLI
(decode codes to WAV, encode WAV to codes), `client.verify` (server vs reference), perf_analyzer inputs
(`client.perf_inputs`, `client/perf.sh`) and `client.bench`.

Installs without PyTorch: numpy and tritonclient, matplotlib for the benchmark plot. `encode` and
`verify` import PyTorch lazily (the export extra) and say so when it is missing.
"""
