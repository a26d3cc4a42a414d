"""Command line of the server side (`code2wav-server`, or `python -m mimi_code2wav.server`)."""

from __future__ import annotations

import argparse
import sys

from . import security, serve, verify
from .processes import ServerError, report

# Each command's module has `add_arguments(parser)`, `run(args) -> exit code` and its help as its docstring.
COMMANDS = {"serve": serve, "certs": security, "verify": verify}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="code2wav-server", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        command = commands.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(handler=module.run)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ServerError as error:  # one line "error: ..." and exit 1
        return report(error)


if __name__ == "__main__":
    sys.exit(main())
