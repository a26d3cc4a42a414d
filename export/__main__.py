"""Command line of the export side (`code2wav-export`, or `python -m mimi_code2wav.export`): build an export,
render model repositories around it, encode WAV files into codes."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from . import pipeline
from .onnx_export import OPSETS, ExportOptions
from .render import CHECKED_IN_CONFIG, TARGETS, add_serving_arguments, render_config, serving_from_args

WEIGHTS_HELP = "transformers folder, moshi .safetensors file, or hub id (e.g. kyutai/mimi)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="code2wav-export", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="export model.onnx and its manifest")
    b.add_argument("--weights", help=WEIGHTS_HELP)
    b.add_argument("--random-init", action="store_true", help="seeded random weights: the audio is noise")
    b.add_argument("--seed", type=int)
    b.add_argument("--out", type=Path, help=f"output folder (default {pipeline.DEFAULT_EXPORT_DIR}/<options>)")
    b.add_argument("--force", action="store_true", help="export even if the manifest matches")
    b.add_argument("--num-codebooks", type=int, default=8)
    b.add_argument("--max-frames-per-step", type=int, default=16,
                   help="the most frames one decoder call takes (any 1..N per call, one state)")
    b.add_argument("--window", choices=("moshi", "exact"), default="moshi",
                   help="moshi: equal to moshi's streaming decoder; exact: equal to offline decoding")
    b.add_argument("--kv-cache-dtype", choices=("float32", "float16"), default="float32")
    b.add_argument("--opset", type=int, choices=OPSETS, default=17)

    r = sub.add_parser("render", help="render mimi_decoder config(s) / a model repository")
    r.add_argument("--target", choices=TARGETS, default="python-ort",
                   help="null: the bench decoder (silence at once) that measures the front's ceiling")
    r.add_argument("--export-dir", type=Path, help="an export folder (model.onnx + manifest.json)")
    r.add_argument("--out", type=Path, help="model repository folder to write (code2wav + mimi_decoder)")
    r.add_argument("--plan", type=Path, help="TensorRT plan for --target tensorrt")
    add_serving_arguments(r)
    r.add_argument("--check-in", action="store_true",
                   help="rewrite model_repository/mimi_decoder/config.pbtxt from the default options")

    e = sub.add_parser("encode", help="turn a WAV file into codes with Mimi's encoder", description="Encode audio "
                       "into Mimi codes [k, frames] (.npy); rates besides 24000 Hz are resampled linearly.")
    e.add_argument("input", type=Path, help="WAV file (PCM 8/16/24/32-bit or float; channels are averaged)")
    e.add_argument("--weights", required=True, help=WEIGHTS_HELP)
    e.add_argument("--out", type=Path, required=True, help=".npy file to write")
    e.add_argument("--num-codebooks", type=int, default=8, help="codebooks to keep (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "encode":
            pipeline.encode_file(args.input, args.weights, args.out, args.num_codebooks)
        elif args.command == "build":
            options = ExportOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ExportOptions)})
            loaded = pipeline.choose_weights(args.weights, args.random_init, args.seed)
            print(pipeline.build(options, loaded, args.out or pipeline.export_dir_for(options), args.force))
        elif args.check_in:
            CHECKED_IN_CONFIG.write_text(render_config(pipeline.spec_for_options(ExportOptions()), "onnxruntime"))
            print(CHECKED_IN_CONFIG)
        elif args.export_dir is None or args.out is None:
            raise ValueError("render needs --export-dir and --out (or --check-in)")
        else:
            serving = serving_from_args(args, args.target)
            print(pipeline.render_export(args.export_dir, args.out, args.target, serving, args.plan))
        return 0
    except (ValueError, FileNotFoundError) as error:  # WeightsError is a ValueError
        pipeline.log(f"error: {error}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
