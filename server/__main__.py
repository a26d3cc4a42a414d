"""Command line of the server side (`code2wav-server`, or `python -m mimi_code2wav.server`).

Each command is a module (`security` for `certs`) with `add_arguments(parser)` and `run(args) -> exit code`.
"""

from __future__ import annotations

import argparse
import sys

from . import security, serve, verify

COMMANDS = {
    "serve": (serve, "run the local tritonserver in the foreground (Ctrl-C or SIGTERM stops it)"),
    "certs": (security, "make a private CA with server and client certificates, for trying TLS"),
    "verify": (verify, "check a running server against a streaming reference decode of the same weights"),
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
