"""`python -m benchmarks COMMAND [options]`: each command is the module of its name, with
`add_arguments(parser)` and `run(args) -> exit code`; only the chosen module is imported."""

from __future__ import annotations

import argparse
import importlib
import sys

from mimi_code2wav.client.protocol import ClientError
from mimi_code2wav.server.processes import ServerError, report

COMMANDS = {
    "sweep": "streams x request sizes through Triton: the streaming client and perf_analyzer",
    "duplex": "conversations ticking together every 80 ms: each frame's latency to its PCM, per policy",
    "failover": "paced resumable streams on replicas, one of them killed: what the others feel",
    "memory": "the server's memory against live streams and after they expire",
    "decoder": "the decoder alone on this CPU: moshi, the step module, ONNX Runtime, rustymimi",
    "gpu": "the step module on a CUDA GPU, eager and as a CUDA graph",
    "front": "what the code2wav front costs per request and where, against the minimal BLS front",
    "record": "render docs/benchmarks.md and the README's headline from docs/benchmarks/*.json",
}


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one command; what it parses carries `handler`, the command's `run`."""
    module = importlib.import_module(f"benchmarks.{name}")
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    parser.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        unknown, help_asked = argv[:1] not in ([], ["-h"], ["--help"]), argv[:1] in (["-h"], ["--help"])
        print("usage: python -m benchmarks COMMAND [options]   (COMMAND --help for its options)\n\n" + "\n".join(
            f"  {name:9s} {summary}" for name, summary in COMMANDS.items()), file=sys.stderr if unknown else sys.stdout)
        return 0 if help_asked else 2
    args = command_parser(argv[0]).parse_args(argv[1:])
    try:
        return args.handler(args)
    except (ClientError, ServerError) as exc:  # a server or a request that failed: one line, no traceback
        return report(exc)


if __name__ == "__main__":
    sys.exit(main())
