"""The export side's jobs: weights -> model.onnx + manifest -> model repositories; speech -> codes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from mimi_code2wav.client.protocol import SAMPLE_RATE_HZ
from mimi_code2wav.client.wav import WavError, read_wav

from .onnx_export import MODEL_FILE, ExportOptions, build_step, export_onnx, read_manifest, stale_reason, write_manifest
from .render import DecoderServing, render_repository
from .spec import DecoderSpec
from .weights import WeightsError, load_weights, new_model

DEFAULT_EXPORT_DIR = Path("build") / "export"
DEFAULT_HUB_ID = "kyutai/mimi"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def export_dir_for(options: ExportOptions, root: Path = DEFAULT_EXPORT_DIR) -> Path:
    return root / f"f{options.max_frames_per_step}-{options.window}-kv{options.kv_cache_dtype}-k{options.num_codebooks}"


def choose_weights(weights: str | None, random_init: bool, seed: int | None, allow_default: bool = False):
    """Weights from --weights / --random-init; with allow_default, kyutai/mimi, else random seed 0."""
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
    if (reason := stale_reason(out_dir, options, loaded.sha256)) is None and not force:
        log(f"{out_dir}: up to date with {loaded.source} ({loaded.kind}); nothing to do")
        return out_dir
    log(f"exporting to {out_dir}: {reason or 'forced'}")
    spec = export_onnx(build_step(loaded.model, options), out_dir / MODEL_FILE, opset=options.opset, log=log)
    write_manifest(out_dir, spec, options, loaded)
    state_bytes = spec.state_bytes_per_stream()
    log(f"state per stream: {state_bytes / 2**20:.2f} MiB ({state_bytes} bytes) in {len(spec.states)} tensors\n"
        + "\n".join(f"  {state.input:24s} {state.dtype:8s} {list(state.shape)}" for state in spec.states))
    return out_dir


def prepare_local_repository(weights: str | None, random_init: bool, seed: int | None, build_root: Path,
                             target: str = "python-ort", serving: DecoderServing | None = None) -> Path:
    """Export (when missing or stale) with the default options and render a repository for a local server."""
    loaded = choose_weights(weights, random_init, seed, allow_default=True)
    export_dir = build(ExportOptions(), loaded, export_dir_for(ExportOptions(), build_root / "export"))
    serving = serving or DecoderServing(instance_kind="KIND_CPU")
    repository = render_export(export_dir, build_root / "model_repository", target, serving)
    log(f"model repository: {repository} (code2wav + {target} mimi_decoder, weights {loaded.source})")
    return repository


def spec_for_options(options: ExportOptions):
    """The spec an export with these options has: it depends on the architecture, not the weights."""
    return build_step(new_model(), options).spec()


def render_export(export_dir: Path, out_dir: Path, target: str, serving, plan_path: Path | None = None) -> Path:
    if (manifest := read_manifest(export_dir)) is None:
        raise FileNotFoundError(f"{export_dir} holds no export (run `code2wav-export build` first)")
    return render_repository(DecoderSpec.from_dict(manifest["spec"]), export_dir / MODEL_FILE, out_dir, target, serving,
                             plan_path)


def encode_file(input_path: Path, weights: str, out_path: Path, num_codebooks: int = 8) -> np.ndarray:
    """A WAV file (channels averaged, resampled to 24 kHz) -> codes int64 [k, frames] saved as .npy."""
    try:
        wav = read_wav(input_path)
    except (OSError, WavError) as exc:
        raise ValueError(f"cannot read {input_path}: {exc}") from None
    audio = wav.to_float32_mono()
    if wav.channels > 1:
        log(f"note: {input_path} has {wav.channels} channels; encoding their average")
    if wav.sample_rate_hz != SAMPLE_RATE_HZ:
        log(f"note: resampling {wav.sample_rate_hz} Hz -> {SAMPLE_RATE_HZ} Hz by linear interpolation")
        times = np.arange(round(len(audio) / wav.sample_rate_hz * SAMPLE_RATE_HZ)) / SAMPLE_RATE_HZ
        audio = np.interp(times, np.arange(len(audio)) / wav.sample_rate_hz, audio).astype(np.float32)
    model = load_weights(weights).model.eval()
    with torch.no_grad():
        codes = model.encode(torch.from_numpy(audio).view(1, 1, -1), num_quantizers=num_codebooks).audio_codes
    codes = codes[0].numpy().astype(np.int64)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    np.save(out_path, codes)
    print(f"wrote {out_path}: codes {list(codes.shape)} ({codes.shape[1]} frames, "
          f"{len(audio) / SAMPLE_RATE_HZ:.2f} s of audio)")
    return codes
