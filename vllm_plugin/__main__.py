"""python -m mimi_code2wav.vllm_plugin overlay: write the vLLM-Omni deploy overlay for this environment."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import installed_base_config, render_overlay


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimi_code2wav.vllm_plugin", description=__doc__)
    overlay = parser.add_subparsers(dest="command", required=True).add_parser(
        "overlay", help="the overlay sending stage 1 to the code2wav service, over the installed personaplex.yaml")
    overlay.add_argument("--url", default="127.0.0.1:8001", help="the code2wav service's gRPC address (default %(default)s)")
    overlay.add_argument("--response-timeout-s", type=float, default=10.0)
    overlay.add_argument("--resume-timeout-s", type=float, default=30.0)
    overlay.add_argument("--out", type=Path, help="file to write (default: stdout)")
    args = parser.parse_args(argv)
    try:
        text = render_overlay(args.url, installed_base_config(), args.response_timeout_s, args.resume_timeout_s)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
