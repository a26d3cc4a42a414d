"""The benchmarks, one module per role; each writes a JSON stamped by `provenance.run_meta` that
`record` renders into docs/benchmarks.md.

  decoder   the decoder alone on this machine's CPU: moshi, the step module, ONNX Runtime, rustymimi
  gpu       the step module on a CUDA GPU, eager and as a CUDA graph (torch, numpy and onnx only)
  resume    resume by replay: SNR of a resumed stream against frames of history replayed
  cli       `code2wav-server bench`: the Triton sweep, run by
              sweep (points in order, crash restarts), points (a point as a dataclass),
              client (driving client.stream), perf (driving perf_analyzer),
              profile (/proc CPU time, Triton's statistics), local_server, report (markdown, plot)
  memory    `code2wav-server memory`: the server's memory against live streams and after expiry
  failover  `code2wav-server failover`: streams on replicas, one replica killed
  record    `code2wav-server record`: docs/benchmarks.md and the README's headline from docs/benchmarks/

Nothing is imported here, so that `gpu` runs where only its own dependencies are installed.
"""
