"""The export pipeline: weights -> model.onnx + manifest -> rendered Triton model repositories."""

from __future__ import annotations

import sys
from pathlib import Path

from .onnx_export import ExportOptions

DEFAULT_EXPORT_DIR = Path("build") / "export"
DEFAULT_HUB_ID = "kyutai/mimi"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def export_dir_for(options: ExportOptions, root: Path = DEFAULT_EXPORT_DIR) -> Path:
    return root / f"f{options.max_frames_per_step}-{options.window}-kv{options.kv_cache_dtype}-k{options.num_codebooks}"


def choose_weights(weights: str | None, random_init: bool, seed: int | None, allow_default: bool = False):
    """Weights from --weights / --random-init; with allow_default, kyutai/mimi or random seed 0 as fallback."""
    from .weights import WeightsError, load_weights

    if random_init:
        return load_weights(None, seed=0 if seed is None else seed)
    if weights:
        return load_weights(weights)
    if not allow_default:
        raise WeightsError("give --weights (folder, .safetensors file or hub id) or --random-init --seed N")
    try:
        return load_weights(DEFAULT_HUB_ID)
    except WeightsError as error:
        log(f"{DEFAULT_HUB_ID} is not available ({error}); falling back to random weights")
        return load_weights(None, seed=0)


def build(options: ExportOptions, loaded, out_dir: Path, force: bool = False) -> Path:
    """Export model.onnx + manifest.json into out_dir unless an up-to-date export is there."""
    from .onnx_export import MODEL_FILE, build_step, export_onnx, stale_reason, write_manifest

    options.validate()
    reason = stale_reason(out_dir, options, loaded.sha256)
    if reason is None and not force:
        log(f"{out_dir}: up to date with {loaded.source} ({loaded.kind}); nothing to do")
        return out_dir
    log(f"exporting to {out_dir}: {reason or 'forced'}")
    step = build_step(loaded.model, options)
    spec = export_onnx(step, out_dir / MODEL_FILE, opset=options.opset, log=log)
    write_manifest(out_dir, spec, options, loaded.source, loaded.kind, loaded.sha256)
    state_bytes = spec.state_bytes_per_stream()
    log(f"state per stream: {state_bytes / 2**20:.2f} MiB ({state_bytes} bytes) in {len(spec.states)} tensors")
    for state in spec.states:
        log(f"  {state.input:24s} {state.dtype:8s} {list(state.shape)}")
    return out_dir


def prepare_local_repository(weights: str | None = None, random_init: bool = False, seed: int | None = None,
                             build_root: Path = Path("build"), options: ExportOptions | None = None,
                             target: str = "python-ort", serving=None) -> Path:
    """Export (when missing or stale) and render code2wav + the `target` mimi_decoder under `build_root`
    for a local server (`serving` default: CPU instances); weights as `choose_weights` with allow_default."""
    from .render import DecoderServing

    options = options or ExportOptions()
    loaded = choose_weights(weights, random_init, seed, allow_default=True)
    export_dir = build(options, loaded, export_dir_for(options, build_root / "export"))
    serving = serving or DecoderServing(instance_kind="KIND_CPU")
    repository = render_export(export_dir, build_root / "model_repository", target, serving)
    log(f"model repository: {repository} (code2wav + {target} mimi_decoder, weights {loaded.source})")
    return repository


def spec_for_options(options: ExportOptions):
    """The spec an export with these options has; it depends on the architecture, not the weights."""
    from .onnx_export import build_step
    from .weights import new_model

    return build_step(new_model(), options).spec()


def render_export(export_dir: Path, out_dir: Path, target: str, serving, plan_path: Path | None = None) -> Path:
    """Render a complete model repository (code2wav + mimi_decoder for `target`) around an export."""
    from .onnx_export import MODEL_FILE, read_manifest
    from .render import render_repository
    from .spec import DecoderSpec

    manifest = read_manifest(export_dir)
    if manifest is None:
        raise FileNotFoundError(f"{export_dir} holds no export (run `code2wav-export build` first)")
    spec = DecoderSpec.from_dict(manifest["spec"])
    return render_repository(spec, export_dir / MODEL_FILE, out_dir, target, serving, plan_path)


def check_in_config(options: ExportOptions) -> Path:
    """Rewrite the checked-in native ORT config (model_repository/mimi_decoder/config.pbtxt)."""
    from .render import CHECKED_IN_CONFIG, render_config

    CHECKED_IN_CONFIG.write_text(render_config(spec_for_options(options), "onnxruntime"))
    return CHECKED_IN_CONFIG
