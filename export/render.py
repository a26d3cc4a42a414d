"""Render `mimi_decoder` Triton configs from a decoder spec.

Three serving targets and one bench target share one spec:
  onnxruntime  native ORT backend with implicit state (checked in under model_repository/)
  tensorrt     the same state block over a TensorRT plan (rendered into a build folder)
  python-ort   a Python-backend model running the same ONNX with onnxruntime and keeping the state
               itself (rendered into a build folder; for servers without the native ORT backend):
               model_repository/mimi_decoder/python_ort/ holds its model files and config template
  null         (bench only) the decoder's interface returning silence at once, no state: behind
               code2wav it measures the front's own ceiling (model_repository/mimi_decoder/null/)

Templates are filled with `string.Template.substitute`, which raises on a missing key, and never
written over a tracked file except the one checked-in native config, on request.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import string
from dataclasses import dataclass, field
from pathlib import Path

from .spec import TRITON_DTYPES, DecoderSpec, TensorSpec

TEMPLATES = Path(__file__).parent / "templates"
REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKED_IN_CONFIG = REPO_ROOT / "model_repository" / "mimi_decoder" / "config.pbtxt"
CODE2WAV_DIR = REPO_ROOT / "model_repository" / "code2wav"
PYTHON_ORT_DIR = REPO_ROOT / "model_repository" / "mimi_decoder" / "python_ort"
PYTHON_ORT_FILES = ("model.py", "python_ort_core.py")
NULL_DIR = REPO_ROOT / "model_repository" / "mimi_decoder" / "null"
# Shared by both Python models: copied beside each model.py (it is no model itself).
SHARED_MODEL_FILE = REPO_ROOT / "model_repository" / "common" / "triton_streams.py"
TARGETS = ("onnxruntime", "tensorrt", "python-ort", "null")
PYTHON_TARGETS = ("python-ort", "null")  # Python-backend decoders: no implicit state block

# code2wav's own idle timeout (model_repository/code2wav/config.pbtxt); the decoder's sits above it.
CODE2WAV_IDLE_TIMEOUT_US = 30_000_000
DECODER_IDLE_MARGIN_US = 5_000_000


@dataclass
class DecoderServing:
    """Serving knobs of a rendered decoder config (not part of the exported graph)."""

    model_name: str = "mimi_decoder"
    max_batch_size: int = 64
    idle_timeout_us: int = CODE2WAV_IDLE_TIMEOUT_US + DECODER_IDLE_MARGIN_US
    max_candidate_sequences: int = 1024
    preferred_batch_sizes: list[int] = field(default_factory=lambda: [8, 16, 32, 64])
    max_queue_delay_us: int = 2000
    instance_kind: str = "KIND_GPU"
    instance_count: int = 1
    intra_op_threads: int = 0

    def validate(self) -> None:
        if self.instance_kind not in ("KIND_GPU", "KIND_CPU"):
            raise ValueError(f"instance_kind must be KIND_GPU or KIND_CPU, got {self.instance_kind!r}")
        if self.max_batch_size < 1 or self.instance_count < 1:
            raise ValueError("max_batch_size and instance_count must be >= 1")
        too_big = [size for size in self.preferred_batch_sizes if size > self.max_batch_size]
        if too_big:
            raise ValueError(f"preferred batch sizes {too_big} exceed max_batch_size {self.max_batch_size}")


def _tensor_block(kind: str, tensors: tuple[TensorSpec, ...]) -> str:
    items = [
        f'  {{ name: "{t.name}" data_type: {TRITON_DTYPES[t.dtype]} dims: [ {", ".join(map(str, t.shape))} ] }}'
        for t in tensors
    ]
    return f"{kind} [\n" + ",\n".join(items) + "\n]"


def _state_block(spec: DecoderSpec) -> str:
    lines = ["  state ["]
    for index, state in enumerate(spec.states):
        dtype = TRITON_DTYPES[state.dtype]
        dims = ", ".join(map(str, state.shape))
        lines.append(
            f'    {{\n      input_name: "{state.input}"\n      output_name: "{state.output}"\n'
            f"      data_type: {dtype}\n      dims: [ {dims} ]\n"
            f'      initial_state {{ data_type: {dtype} dims: [ {dims} ] zero_data: true name: "fresh_stream" }}\n'
            f"    }}{',' if index < len(spec.states) - 1 else ''}"
        )
    lines.append("  ]")
    return "\n".join(lines)


def _pbtxt_string(value: str) -> str:
    return json.dumps(value)  # a JSON string literal is a valid protobuf text-format string


def render_config(spec: DecoderSpec, target: str, serving: DecoderServing | None = None) -> str:
    """The config.pbtxt text of `mimi_decoder` for one target."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    serving = serving or DecoderServing()
    serving.validate()
    spec.validate()
    common = {
        "spec_sha256": spec.sha256(),
        "model_name": serving.model_name,
        "max_batch_size": serving.max_batch_size,
        "inputs": _tensor_block("input", (spec.codes,)),
        "outputs": _tensor_block("output", (spec.pcm,)),
        "idle_timeout_us": serving.idle_timeout_us,
        "max_candidate_sequences": serving.max_candidate_sequences,
        "preferred_batch_sizes": ", ".join(map(str, serving.preferred_batch_sizes)),
        "max_queue_delay_us": serving.max_queue_delay_us,
        "instance_count": serving.instance_count,
    }
    if target == "python-ort":
        state_spec = [
            {"input": s.input, "output": s.output, "dtype": s.dtype, "shape": list(s.shape)} for s in spec.states
        ]
        template = (PYTHON_ORT_DIR / "config.pbtxt.tmpl").read_text()
        return string.Template(template).substitute(
            common,
            intra_op_threads=serving.intra_op_threads,
            state_spec_json=_pbtxt_string(json.dumps(state_spec, separators=(",", ":"))),
            value_ranges_json=_pbtxt_string(json.dumps({spec.codes.name: [0, spec.codebook_size]})),
            max_dims_json=_pbtxt_string(json.dumps({spec.codes.name: [spec.num_codebooks, spec.max_frames_per_step]})),
        )
    if target == "null":
        template = (NULL_DIR / "config.pbtxt.tmpl").read_text()
        return string.Template(template).substitute(common, samples_per_frame=spec.samples_per_frame)
    if target == "onnxruntime":
        backend_line = 'backend: "onnxruntime"'
    else:
        backend_line = 'backend: "tensorrt"\nplatform: "tensorrt_plan"\ndefault_model_filename: "model.plan"'
    template = (TEMPLATES / "decoder_native.pbtxt.tmpl").read_text()
    return string.Template(template).substitute(
        common,
        target=target,
        backend_line=backend_line,
        states=_state_block(spec),
        instance_kind=serving.instance_kind,
    ).rstrip() + "\n"


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        target.unlink()
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def set_string_parameter(config_text: str, key: str, value: str) -> str:
    """`config_text` (a config.pbtxt) with the string value of parameter `key` replaced; the parameter
    must appear exactly once, written as `key: "KEY"` then `value: { string_value: "..." }`."""
    pattern = re.compile(r'(key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*)"[^"]*"')
    replaced, count = pattern.subn(lambda match: match.group(1) + json.dumps(value), config_text)
    if count != 1:
        raise ValueError(f"parameter '{key}' appears {count} times in the config, expected once")
    return replaced


def render_repository(spec: DecoderSpec, onnx_path: Path, out_dir: Path, target: str = "python-ort",
                      serving: DecoderServing | None = None, plan_path: Path | None = None) -> Path:
    """A complete model repository in `out_dir`: code2wav (copied, its decoder_max_frames_per_step set to
    the export's max_frames_per_step) plus mimi_decoder for `target`,
    with model_repository/common/triton_streams.py beside each Python model's model.py.

    `out_dir` must not be inside the tracked model_repository/ folder.
    """
    out_dir = out_dir.resolve()
    if out_dir == (REPO_ROOT / "model_repository").resolve() or (REPO_ROOT / "model_repository").resolve() in out_dir.parents:
        raise ValueError(f"refusing to render into the tracked model repository: {out_dir}")
    serving = serving or DecoderServing(instance_kind="KIND_CPU" if target in PYTHON_TARGETS else "KIND_GPU")
    code2wav = out_dir / "code2wav"
    if code2wav.exists():
        shutil.rmtree(code2wav)
    shutil.copytree(CODE2WAV_DIR, code2wav, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(SHARED_MODEL_FILE, code2wav / "1" / SHARED_MODEL_FILE.name)
    config = code2wav / "config.pbtxt"
    config.write_text(set_string_parameter(config.read_text(), "decoder_max_frames_per_step",
                                           str(spec.max_frames_per_step)))
    decoder = out_dir / serving.model_name
    version = decoder / "1"
    if decoder.exists():
        shutil.rmtree(decoder)
    version.mkdir(parents=True)
    (decoder / "config.pbtxt").write_text(render_config(spec, target, serving))
    if target == "tensorrt":
        if plan_path is None:
            raise ValueError("the tensorrt target needs a plan file (export/tensorrt_build.py builds one)")
        _link_or_copy(plan_path, version / "model.plan")
    elif target != "null":
        _link_or_copy(onnx_path, version / "model.onnx")
    if target == "python-ort":
        for name in PYTHON_ORT_FILES:
            shutil.copy2(PYTHON_ORT_DIR / name, version / name)
    elif target == "null":
        shutil.copy2(NULL_DIR / "model.py", version / "model.py")
    if target in PYTHON_TARGETS:
        shutil.copy2(SHARED_MODEL_FILE, version / SHARED_MODEL_FILE.name)
    return out_dir
