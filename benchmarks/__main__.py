"""`python -m benchmarks COMMAND [options]`, from the repository root with the project installed (`make venv`).

Each command is one module with `add_arguments(parser)` and `run(args) -> exit code`; only the chosen
module is imported, so `gpu` runs where only torch, numpy and onnx are installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "sweep": ("sweep", "streams x request sizes through Triton: the streaming client and perf_analyzer"),
    "duplex": ("duplex", "conversations ticking together every 80 ms: each frame's latency to its PCM, per policy"),
    "failover": ("failover", "paced resumable streams on replicas, one of them killed: what the others feel"),
    "memory": ("memory", "the server's memory against live streams and after they expire"),
    "decoder": ("decoder", "the decoder alone on this CPU: moshi, the step module, ONNX Runtime, rustymimi"),
    "step-profile": ("step_profile", "ONNX Runtime's kernel time by op type, against another export"),
    "python-ort": ("python_ort", "the python-ort decoder's core: what each of its state mechanisms buys"),
    "gpu": ("gpu", "the step module on a CUDA GPU, eager and as a CUDA graph"),
    "tls": ("tls", "what TLS and the inference key cost: requests/s through the null decoder, plaintext against TLS"),
    "front": ("front", "what the code2wav front costs per request and where, against the minimal BLS front"),
    "resume": ("resume", "resume by replay: SNR of a resumed stream against frames of history"),
    "record": ("record", "render docs/benchmarks.md and the README's headline from docs/benchmarks/*.json"),
}


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one command; what it parses carries `handler`, the command's `run`."""
    module = importlib.import_module(f"benchmarks.{COMMANDS[name][0]}")
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    parser.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        listing = "\n".join(f"  {name:13s} {summary}" for name, (_, summary) in COMMANDS.items())
        print(f"usage: python -m benchmarks COMMAND [options]   (COMMAND --help for its options)\n\n{listing}",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    args = command_parser(argv[0]).parse_args(argv[1:])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
