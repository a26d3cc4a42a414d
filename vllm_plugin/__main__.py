"""python -m mimi_code2wav.vllm_plugin overlay: write the vLLM-Omni deploy overlay for this environment."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from . import ARCHITECTURE

# base_config is absolute (vLLM-Omni resolves a relative one against the overlay); deploy/vllm-omni/ holds a copy.
OVERLAY = """\
# vLLM-Omni deploy overlay: PersonaPlex with its codec stage (stage 1) decoded by the code2wav Triton
# service instead of an in-process Mimi. Serve it with `--deploy-config <this file>`; everything not
# named here comes from the base config. Needs `pip install 'mimi-code2wav[vllm-omni]'` in the
# pipeline's environment (the plugin registers {architecture}). Written by
# `python -m mimi_code2wav.vllm_plugin overlay`, which fills in base_config for that environment.
base_config: {base_config}
stages:
  - stage_id: 1
    model_arch: {architecture}
    additional_config:
      code2wav:
        url: "{url}"  # gRPC address: a proxy, or servers to fail over between (comma-separated)
        response_timeout_s: {response_timeout_s:g}  # a request's deadline before its stream resumes elsewhere
        resume_timeout_s: {resume_timeout_s:g}  # how long a stream tries to resume before the stage fails
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimi_code2wav.vllm_plugin", description=__doc__)
    overlay = parser.add_subparsers(dest="command", required=True).add_parser(
        "overlay", help="the overlay sending stage 1 to the code2wav service, over the installed personaplex.yaml")
    overlay.add_argument("--url", default="127.0.0.1:8001", help="the code2wav service's gRPC address (default %(default)s)")
    overlay.add_argument("--response-timeout-s", type=float, default=10.0)
    overlay.add_argument("--resume-timeout-s", type=float, default=30.0)
    overlay.add_argument("--out", type=Path, help="file to write (default: stdout)")
    args = parser.parse_args(argv)
    spec = importlib.util.find_spec("vllm_omni")  # its shipped PersonaPlex config, found without importing it
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: vllm_omni is not installed in this environment (pip install 'mimi-code2wav[vllm-omni]')")
    base_config = Path(next(iter(spec.submodule_search_locations))) / "deploy" / "personaplex.yaml"
    if not base_config.is_file():
        sys.exit(f"error: this vLLM-Omni has no {base_config}")
    text = OVERLAY.format(architecture=ARCHITECTURE, base_config=base_config, **vars(args))
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
