"""Command line: export the streaming decoder step and render Triton configs.

  python -m export build  [--weights SRC | --random-init --seed N] [--frames-per-step F] [--window moshi|exact]
                          [--kv-cache-dtype float32|float16] [--opset 17] [--out DIR] [--force]
  python -m export render --target onnxruntime|tensorrt|python-ort --export-dir DIR --out DIR
  python -m export render --check-in      (rewrites model_repository/mimi_decoder/config.pbtxt)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from export.onnx_export import OPSETS, ExportOptions

DEFAULT_EXPORT_DIR = Path("build") / "export"
DEFAULT_HUB_ID = "kyutai/mimi"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def export_dir_for(options: ExportOptions, root: Path = DEFAULT_EXPORT_DIR) -> Path:
    return root / f"f{options.frames_per_step}-{options.window}-kv{options.kv_cache_dtype}-k{options.num_codebooks}"


def load_weights_arg(weights: str | None, random_init: bool, seed: int | None, allow_default: bool = False):
    """Weights from --weights / --random-init; with allow_default, kyutai/mimi or random seed 0 as fallback."""
    from export.weights import WeightsError, load_weights

    if random_init:
        return load_weights(None, seed=0 if seed is None else seed)
    if weights:
        return load_weights(weights)
    if not allow_default:
        raise WeightsError("give --weights (folder, .safetensors file or hub id) or --random-init --seed N")
    try:
        return load_weights(DEFAULT_HUB_ID)
    except WeightsError as error:
        _log(f"{DEFAULT_HUB_ID} is not available ({error}); falling back to random weights")
        return load_weights(None, seed=0)


def build(options: ExportOptions, loaded, out_dir: Path, force: bool = False) -> Path:
    """Export model.onnx + manifest.json into out_dir unless an up-to-date export is there."""
    from export.onnx_export import MODEL_FILE, build_step, export_onnx, stale_reason, write_manifest

    options.validate()
    reason = stale_reason(out_dir, options, loaded.sha256)
    if reason is None and not force:
        _log(f"{out_dir}: up to date with {loaded.source} ({loaded.kind}); nothing to do")
        return out_dir
    _log(f"exporting to {out_dir}: {reason or 'forced'}")
    step = build_step(loaded.model, options)
    spec = export_onnx(step, out_dir / MODEL_FILE, opset=options.opset, log=_log)
    write_manifest(out_dir, spec, options, loaded.source, loaded.kind, loaded.sha256)
    state_bytes = spec.state_bytes_per_stream()
    _log(f"state per stream: {state_bytes / 2**20:.2f} MiB ({state_bytes} bytes) in {len(spec.states)} tensors")
    for state in spec.states:
        _log(f"  {state.input:24s} {state.dtype:8s} {list(state.shape)}")
    return out_dir


def prepare_local_repository(weights: str | None = None, random_init: bool = False, seed: int | None = None,
                             build_root: Path = Path("build"), options: ExportOptions | None = None) -> Path:
    """Export (when missing or stale) and render the python-ort model repository for a local server.

    Weights: `weights` (folder, .safetensors file or hub id), else random when `random_init`, else
    kyutai/mimi from the local hub cache or the hub, else seeded random weights with a loud warning.
    """
    from export.onnx_export import MODEL_FILE, read_manifest
    from export.render import DecoderServing, render_repository
    from export.spec import DecoderSpec

    options = options or ExportOptions()
    loaded = load_weights_arg(weights, random_init, seed, allow_default=True)
    export_dir = build(options, loaded, export_dir_for(options, build_root / "export"))
    spec = DecoderSpec.from_dict(read_manifest(export_dir)["spec"])
    serving = DecoderServing(instance_kind="KIND_CPU")
    repository = render_repository(spec, export_dir / MODEL_FILE, build_root / "model_repository", "python-ort", serving)
    _log(f"model repository: {repository} (code2wav + python-ort mimi_decoder, weights {loaded.source})")
    return repository


def spec_for_options(options: ExportOptions):
    """The spec an export with these options has; it depends on the architecture, not the weights."""
    from export.onnx_export import build_step
    from export.weights import new_model

    return build_step(new_model(), options).spec()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_options(p):
        p.add_argument("--num-codebooks", type=int, default=8)
        p.add_argument("--frames-per-step", type=int, default=1, help="frames per decoder call (serving uses 1)")
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
    r.add_argument("--target", choices=("onnxruntime", "tensorrt", "python-ort"), default="python-ort")
    r.add_argument("--export-dir", type=Path, help="an export folder (model.onnx + manifest.json)")
    r.add_argument("--out", type=Path, help="model repository folder to write (code2wav + mimi_decoder)")
    r.add_argument("--plan", type=Path, help="TensorRT plan for --target tensorrt")
    r.add_argument("--instance-kind", choices=("KIND_GPU", "KIND_CPU"))
    r.add_argument("--instance-count", type=int, default=1)
    r.add_argument("--max-batch-size", type=int, default=64)
    r.add_argument("--check-in", action="store_true",
                   help="rewrite the checked-in native ORT config from the default options")
    add_options(r)

    args = parser.parse_args(argv)
    from export.weights import WeightsError

    try:
        if args.command == "build":
            options = ExportOptions(args.num_codebooks, args.frames_per_step, args.window, args.kv_cache_dtype, args.opset)
            loaded = load_weights_arg(args.weights, args.random_init, args.seed)
            out = build(options, loaded, args.out or export_dir_for(options), args.force)
            print(out)
            return 0
        return _render(args)
    except (WeightsError, ValueError, FileNotFoundError) as error:
        _log(f"error: {error}")
        return 2


def _render(args) -> int:
    from export.onnx_export import MODEL_FILE, read_manifest
    from export.render import CHECKED_IN_CONFIG, DecoderServing, render_config, render_repository
    from export.spec import DecoderSpec

    options = ExportOptions(args.num_codebooks, args.frames_per_step, args.window, args.kv_cache_dtype, args.opset)
    if args.check_in:
        CHECKED_IN_CONFIG.write_text(render_config(spec_for_options(options), "onnxruntime"))
        print(CHECKED_IN_CONFIG)
        return 0
    if args.export_dir is None or args.out is None:
        raise ValueError("render needs --export-dir and --out (or --check-in)")
    manifest = read_manifest(args.export_dir)
    if manifest is None:
        raise FileNotFoundError(f"{args.export_dir} holds no export (run `python -m export build` first)")
    spec = DecoderSpec.from_dict(manifest["spec"])
    kind = args.instance_kind or ("KIND_CPU" if args.target == "python-ort" else "KIND_GPU")
    serving = DecoderServing(instance_kind=kind, instance_count=args.instance_count, max_batch_size=args.max_batch_size,
                             preferred_batch_sizes=[s for s in DecoderServing().preferred_batch_sizes if s <= args.max_batch_size])
    out = render_repository(spec, args.export_dir / MODEL_FILE, args.out, args.target, serving, args.plan)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
