"""ONNX export of the decoder step (dynamic batch and frames only) and its manifest, which tells a stale
export. Opset 17-20 and IR <= 10 keep it loadable by the NGC 24.10 image's ONNX Runtime 1.19."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .spec import DecoderSpec
from .step import MimiDecoderStep

OPSETS = (17, 18, 19, 20)
MAX_IR_VERSION = 10
MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"
# Ops that must never appear: they would make shapes depend on values, not on (batch, frames).
FORBIDDEN_OPS = ("NonZero", "Unique", "Compress", "Loop", "If", "Scan")
# The symbolic dims of the dynamic axes, in the graph and in the TensorRT profile.
BATCH_DIM, FRAMES_DIM, SAMPLES_DIM = "batch", "frames", "samples"


@dataclass(frozen=True)
class ExportOptions:
    num_codebooks: int = 8
    max_frames_per_step: int = 16
    window: str = "moshi"
    kv_cache_dtype: str = "float32"
    opset: int = 17

    def __post_init__(self) -> None:
        if self.opset not in OPSETS:
            raise ValueError(f"opset must be one of {OPSETS} (what the NGC image's runtimes read), got {self.opset}")


def build_step(model, options: ExportOptions) -> MimiDecoderStep:
    return MimiDecoderStep(model, **{name: value for name, value in asdict(options).items() if name != "opset"}).eval()


def export_onnx(step: MimiDecoderStep, path: Path, opset: int = 17, log=print) -> DecoderSpec:
    """Write `path` (an .onnx file) for `step`, checked by onnx.checker in full; returns its spec."""
    import onnx
    from onnx.helper import make_tensor_type_proto

    spec = step.spec()
    spec.validate()
    # Sizes > 1 where the step allows them, so the tracer cannot specialise a dynamic dimension.
    batch, frames = 2, min(3, spec.max_frames_per_step)
    codes = torch.zeros(batch, spec.num_codebooks, frames, dtype=torch.int32)
    args = (codes, *step.zero_state(batch))
    input_names, output_names = [t.name for t in spec.inputs], [t.name for t in spec.outputs]
    dynamic_axes = {name: {0: BATCH_DIM} for name in input_names + output_names}
    dynamic_axes[spec.codes.name][2] = FRAMES_DIM
    dynamic_axes[spec.pcm.name][1] = SAMPLES_DIM
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log(f"exporting ONNX (opset {opset}, 1-{spec.max_frames_per_step} frames per call, window {spec.window}, "
        f"kv cache {spec.kv_cache_dtype}) ...")
    with torch.no_grad():
        torch.onnx.export(step, args, str(path), input_names=input_names, output_names=output_names,
                          dynamic_axes=dynamic_axes, opset_version=opset, dynamo=False, do_constant_folding=True)
    log(f"  traced in {time.monotonic() - started:.1f} s; checking ...")
    model = onnx.load(str(path))
    # Every graph input and output [batch, *spec shape]: the tracer leaves the conv state's size symbolic.
    by_name = {t.name: t for t in (*spec.inputs, *spec.outputs)}
    variable = {spec.codes.name: FRAMES_DIM, spec.pcm.name: SAMPLES_DIM}
    for value in (*model.graph.input, *model.graph.output):
        shape = [BATCH_DIM, *(variable[value.name] if size == -1 else size for size in by_name[value.name].shape)]
        value.type.CopyFrom(make_tensor_type_proto(value.type.tensor_type.elem_type, shape))
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    if found := sorted({node.op_type for node in model.graph.node} & set(FORBIDDEN_OPS)):
        raise RuntimeError(f"exported graph contains data-dependent ops: {found}")
    log(f"  {path} ({path.stat().st_size / 2**20:.1f} MiB) passed onnx.checker (full check)")
    return spec


def exporter_sha256() -> str:
    """Hash of the code that shapes the graph: an export made by other code is stale."""
    files = ("step.py", "spec.py", "onnx_export.py")
    return hashlib.sha256(b"".join((Path(__file__).parent / name).read_bytes() for name in files)).hexdigest()


def write_manifest(folder: Path, spec: DecoderSpec, options: ExportOptions, weights) -> None:
    """manifest.json beside the export: what it was made from (`weights`: a `LoadedMimi`) and its spec."""
    import onnx

    manifest = {"weights": {"source": weights.source, "kind": weights.kind, "sha256": weights.sha256},
                "options": asdict(options), "spec": spec.to_dict(), "spec_sha256": spec.sha256(),
                "exporter_sha256": exporter_sha256(), "created_unix": int(time.time()),
                "versions": {"torch": torch.__version__, "onnx": onnx.__version__}}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def read_manifest(folder: Path) -> dict | None:
    """The manifest of the export in `folder`; None where there is none (or no model.onnx beside it)."""
    try:
        return json.loads((folder / MANIFEST_FILE).read_text()) if (folder / MODEL_FILE).is_file() else None
    except (OSError, json.JSONDecodeError):
        return None


def stale_reason(folder: Path, options: ExportOptions, weights_sha256: str) -> str | None:
    """Why the export in `folder` does not match these weights and options (None if it does)."""
    manifest = read_manifest(folder)
    if manifest is None:
        return f"no export in {folder}"
    if manifest["weights"]["sha256"] != weights_sha256:
        return "the weights changed"
    if manifest.get("exporter_sha256") != exporter_sha256():
        return "the export code changed"
    if manifest["options"] != asdict(options):
        return f"the options changed ({manifest['options']} -> {asdict(options)})"
    if DecoderSpec.from_dict(manifest["spec"]).sha256() != manifest["spec_sha256"]:
        return "the manifest's spec does not match its hash"
    return None
