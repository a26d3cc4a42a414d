"""Command line of the server side (`code2wav-server`, or `python -m mimi_code2wav.server`).

    code2wav-server serve   [--model-repository DIR] [--weights PATH | --random-init] [--http-port 8000] ...
    code2wav-server serve-replicas [--replicas 2] [--restart] [--grpc-port 8001] ...   (needs nginx)
    code2wav-server verify  [--url 127.0.0.1:8001] [--weights PATH | --random-init] [--streams 2] ...
    code2wav-server bench   [--url HOST:PORT] [--streams 1,2,4,8] [--frames 64] ...
    code2wav-server memory  [--streams 16,32,64] [--idle-timeout-s 4] ...
    code2wav-server failover [--replicas 3] [--streams 12] [--chunk-frames 4] [--signal KILL|STOP] ...
    code2wav-server duplex  [--decoder python-ort|null] [--conversations 4,8,...,200] [--policies per-frame,ramp,catch-up] ...
    code2wav-server record  [--add bench_results/bench.json ...] [--check]

Argument parsing only: each command is a module (`serve`, `replicas`, `verify`; the benchmarks' `bench.cli`,
`bench.duplex`, `bench.memory`, `bench.failover`, `bench.record`) with `add_arguments(parser)` and `run(args) -> exit code`.
"""

from __future__ import annotations

import argparse
import sys

from . import replicas, serve, verify
from .bench import cli as bench
from .bench import duplex, failover, memory, record

COMMANDS = {
    "serve": (serve, "run the local tritonserver in the foreground (Ctrl-C or SIGTERM stops it)"),
    "serve-replicas": (replicas, "N tritonserver replicas behind nginx, every stream kept on one replica"),
    "verify": (verify, "check a running server against a streaming reference decode of the same weights"),
    "bench": (bench, "sweep concurrent streams with the streaming client and perf_analyzer"),
    "duplex": (duplex, "conversations ticking together every 80 ms: each frame's latency to its PCM, per policy"),
    "failover": (failover, "paced resumable streams on replicas, one of them killed: what the others feel"),
    "memory": (memory, "the server's memory against live streams and after they expire"),
    "record": (record, "render docs/benchmarks.md and the README's headline from docs/benchmarks/*.json"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="code2wav-server", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, summary) in COMMANDS.items():
        command = commands.add_parser(name, help=summary, description=module.__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
