"""Command line of the export side (`code2wav-export`, or `python -m mimi_code2wav.export`).

  code2wav-export build  [--weights SRC | --random-init --seed N] [--max-frames-per-step 16] [--window moshi|exact]
                         [--kv-cache-dtype float32|float16] [--opset 17] [--out DIR] [--force]
  code2wav-export render --target onnxruntime|tensorrt|python-ort|null --export-dir DIR --out DIR [--max-streams 1024]
  code2wav-export render --check-in      (rewrites model_repository/mimi_decoder/config.pbtxt)
  code2wav-export encode --weights SRC in.wav --out codes.npy

Argument parsing only: the work is in `pipeline` (build, render) and `encode`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .onnx_export import OPSETS, ExportOptions
from .pipeline import DEFAULT_EXPORT_DIR, build, check_in_config, choose_weights, export_dir_for, log, render_export
from .render import PYTHON_TARGETS, TARGETS, DecoderServing


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="code2wav-export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_options(p):
        p.add_argument("--num-codebooks", type=int, default=8)
        p.add_argument("--max-frames-per-step", type=int, default=16,
                       help="the most frames one decoder call takes (any 1..N per call, one state)")
        p.add_argument("--window", choices=("moshi", "exact"), default="moshi",
                       help="moshi: equal to moshi's streaming decoder; exact: equal to offline decoding")
        p.add_argument("--kv-cache-dtype", choices=("float32", "float16"), default="float32")
        p.add_argument("--opset", type=int, choices=OPSETS, default=17)

    b = sub.add_parser("build", help="export model.onnx and its manifest")
    b.add_argument("--weights", help="transformers folder, moshi .safetensors file, or hub id (e.g. kyutai/mimi)")
    b.add_argument("--random-init", action="store_true", help="seeded random weights: the audio is noise")
    b.add_argument("--seed", type=int, default=None)
    b.add_argument("--out", type=Path, help=f"output folder (default {DEFAULT_EXPORT_DIR}/<options>)")
    b.add_argument("--force", action="store_true", help="export even if the manifest matches")
    add_options(b)

    r = sub.add_parser("render", help="render mimi_decoder config(s) / a model repository")
    r.add_argument("--target", choices=TARGETS, default="python-ort",
                   help="null: the bench decoder (silence at once) that measures the front's ceiling")
    r.add_argument("--export-dir", type=Path, help="an export folder (model.onnx + manifest.json)")
    r.add_argument("--out", type=Path, help="model repository folder to write (code2wav + mimi_decoder)")
    r.add_argument("--plan", type=Path, help="TensorRT plan for --target tensorrt")
    r.add_argument("--instance-kind", choices=("KIND_GPU", "KIND_CPU"))
    r.add_argument("--instance-count", type=int, default=1)
    r.add_argument("--max-batch-size", type=int, default=64)
    r.add_argument("--max-queue-delay-us", type=int, default=DecoderServing.max_queue_delay_us,
                   help="how long the decoder's batcher waits for more streams' steps (default %(default)s): "
                   "0 cuts a lone request's latency by up to that much, at the cost of smaller batches under load")
    r.add_argument("--max-streams", type=int, default=1024,
                   help="live streams the decoder holds (its max_candidate_sequences; code2wav's max_live_streams; "
                   "the GPU memory pools are sized for it) (default %(default)s)")
    r.add_argument("--front-instances", type=int, default=DecoderServing.front_instances,
                   help="code2wav model instances (Python processes; the streams are shared out among them): "
                   "one carries a few thousand requests/s, more use more cores (default %(default)s)")
    r.add_argument("--front-queue-delay-us", type=int, default=DecoderServing.front_queue_delay_us,
                   help="how long code2wav's batcher waits for more streams' requests (default %(default)s)")
    r.add_argument("--check-in", action="store_true",
                   help="rewrite the checked-in native ORT config from the default options")
    add_options(r)

    e = sub.add_parser(
        "encode", help="turn a WAV file into codes with Mimi's encoder",
        description="Encode audio into Mimi codes [k, frames] saved as .npy. Mimi takes 24000 Hz: other "
        "rates are resampled by linear interpolation (no anti-aliasing), with a note.",
    )
    e.add_argument("input", type=Path, help="WAV file (PCM 8/16/24/32-bit or float; channels are averaged)")
    e.add_argument("--weights", required=True, help="Mimi weights: transformers folder, moshi .safetensors file or hub id")
    e.add_argument("--out", type=Path, required=True, help=".npy file to write")
    e.add_argument("--num-codebooks", type=int, default=8, help="codebooks to keep (default %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .weights import WeightsError

    try:
        if args.command == "encode":
            from .encode import EncodeError, encode_file

            try:
                encode_file(args.input, args.weights, args.out, args.num_codebooks)
            except EncodeError as error:
                log(f"error: {error}")
                return 1
            return 0
        options = ExportOptions(args.num_codebooks, args.max_frames_per_step, args.window, args.kv_cache_dtype, args.opset)
        if args.command == "build":
            loaded = choose_weights(args.weights, args.random_init, args.seed)
            print(build(options, loaded, args.out or export_dir_for(options), args.force))
            return 0
        if args.check_in:
            print(check_in_config(options))
            return 0
        if args.export_dir is None or args.out is None:
            raise ValueError("render needs --export-dir and --out (or --check-in)")

        kind = args.instance_kind or ("KIND_CPU" if args.target in PYTHON_TARGETS else "KIND_GPU")
        serving = DecoderServing(
            instance_kind=kind, instance_count=args.instance_count, max_batch_size=args.max_batch_size,
            max_candidate_sequences=args.max_streams, max_queue_delay_us=args.max_queue_delay_us,
            front_instances=args.front_instances, front_queue_delay_us=args.front_queue_delay_us,
            preferred_batch_sizes=[s for s in DecoderServing().preferred_batch_sizes if s <= args.max_batch_size],
        )
        print(render_export(args.export_dir, args.out, args.target, serving, args.plan))
        return 0
    except (WeightsError, ValueError, FileNotFoundError) as error:
        log(f"error: {error}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
