"""Render the Triton configs of `mimi_decoder` and `code2wav` from a decoder spec, for the targets of
docs/design.md §4 and `null` (bench only: silence at once, no state, to measure the front's ceiling).
Templates are filled with `string.Template.substitute` (raises on a missing key) and never written
over a tracked file except the checked-in native config, on request.
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
# code2wav's config for every target: the template, and its rendering with the default options.
CODE2WAV_TEMPLATE = TEMPLATES / "code2wav.pbtxt.tmpl"
CHECKED_IN_CODE2WAV_CONFIG = CODE2WAV_DIR / "config.pbtxt"
PYTHON_ORT_DIR = REPO_ROOT / "model_repository" / "mimi_decoder" / "python_ort"
PYTHON_ORT_FILES = ("model.py", "python_ort_core.py", "python_ort_config.py")
NULL_DIR = REPO_ROOT / "model_repository" / "mimi_decoder" / "null"
# Shared by the Python models: every file of it is copied beside each model.py (it is no model itself).
COMMON_DIR = REPO_ROOT / "model_repository" / "common"
TARGETS = ("onnxruntime", "tensorrt", "python-ort", "null")
PYTHON_TARGETS = ("python-ort", "null")  # Python-backend decoders: no implicit state block

_IDLE_TIMEOUT = re.compile(r"(max_sequence_idle_microseconds:\s*)(\d+)")


def idle_timeout_us(config: Path) -> int:
    """The `max_sequence_idle_microseconds` of a model config (config.pbtxt), which sets it once."""
    found = _IDLE_TIMEOUT.findall(Path(config).read_text())
    if len(found) != 1:
        raise ValueError(f"{config}: max_sequence_idle_microseconds appears {len(found)} times, expected once")
    return int(found[0][1])


# code2wav's own idle timeout, from its template; the decoder's sits above it. It also bounds a shutdown:
# while the server exits no request can reach the decoder to END a stream, so abandoned ones idle out.
CODE2WAV_IDLE_TIMEOUT_US = idle_timeout_us(CODE2WAV_TEMPLATE)
# code2wav's Triton sequence slots per stream it admits (see render_code2wav_config).
CODE2WAV_SLOTS_PER_STREAM = 2
DECODER_IDLE_MARGIN_US = 2_000_000


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
    # code2wav's model instances (Python processes): one carries a few thousand requests/s under its GIL.
    front_instances: int = 1
    # code2wav's batcher wait; a batch's decoder calls reach the decoder together, shaping its batches.
    front_queue_delay_us: int = 3000

    def validate(self) -> None:
        if self.instance_kind not in ("KIND_GPU", "KIND_CPU"):
            raise ValueError(f"instance_kind must be KIND_GPU or KIND_CPU, got {self.instance_kind!r}")
        if min(self.max_queue_delay_us, self.front_queue_delay_us) < 0:
            raise ValueError(f"max_queue_delay_us and front_queue_delay_us must be >= 0, got "
                             f"{self.max_queue_delay_us} and {self.front_queue_delay_us}")
        if min(self.max_batch_size, self.instance_count, self.max_candidate_sequences, self.front_instances) < 1:
            raise ValueError("max_batch_size, instance_count, max_candidate_sequences and front_instances must be >= 1")
        if self.front_instances > self.max_candidate_sequences:
            raise ValueError(f"front_instances ({self.front_instances}) must not exceed the streams the decoder "
                             f"holds ({self.max_candidate_sequences}): each instance admits at least one")
        too_big = [size for size in self.preferred_batch_sizes if size > self.max_batch_size]
        if too_big:
            raise ValueError(f"preferred batch sizes {too_big} exceed max_batch_size {self.max_batch_size}")


def _dims(shape: tuple[int, ...]) -> str:
    return ", ".join(map(str, shape))


def _tensor_block(kind: str, tensors: tuple[TensorSpec, ...]) -> str:
    items = (f'  {{ name: "{t.name}" data_type: {TRITON_DTYPES[t.dtype]} dims: [ {_dims(t.shape)} ] }}'
             for t in tensors)
    return f"{kind} [\n" + ",\n".join(items) + "\n]"


def _state_block(spec: DecoderSpec, same_buffer: bool) -> str:
    """Triton's implicit state, one entry per state tensor of the spec. `same_buffer`: one buffer per
    state and sequence slot instead of two, right for a backend that copies its outputs into the state
    after the run, as the ONNX Runtime backend does (docs/design.md §5.1)."""
    entries = []
    for state in spec.states:
        dtype, dims = TRITON_DTYPES[state.dtype], _dims(state.shape)
        entries.append(
            f'    {{\n      input_name: "{state.input}"\n      output_name: "{state.output}"\n'
            f"      data_type: {dtype}\n      dims: [ {dims} ]\n"
            + ("      use_same_buffer_for_input_output: true\n" if same_buffer else "")
            + f'      initial_state {{ data_type: {dtype} dims: [ {dims} ] zero_data: true name: "fresh_stream" }}\n'
            "    }")
    return "  state [\n" + ",\n".join(entries) + "\n  ]"


def _pbtxt_string(value: str) -> str:
    return json.dumps(value)  # a JSON string literal is a valid protobuf text-format string


def render_config(spec: DecoderSpec, target: str, serving: DecoderServing | None = None) -> str:
    """The config.pbtxt text of `mimi_decoder` for one target."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    serving = serving or DecoderServing()
    serving.validate()
    spec.validate()
    common = dict(
        spec_sha256=spec.sha256(), model_name=serving.model_name, max_batch_size=serving.max_batch_size,
        inputs=_tensor_block("input", (spec.codes,)), outputs=_tensor_block("output", (spec.pcm,)),
        idle_timeout_us=serving.idle_timeout_us, max_candidate_sequences=serving.max_candidate_sequences,
        preferred_batch_sizes=_dims(serving.preferred_batch_sizes), max_queue_delay_us=serving.max_queue_delay_us,
        instance_count=serving.instance_count,
    )
    if target == "python-ort":
        state_spec = [{"input": s.input, "output": s.output, "dtype": s.dtype, "shape": list(s.shape)}
                      for s in spec.states]
        return string.Template((PYTHON_ORT_DIR / "config.pbtxt.tmpl").read_text()).substitute(
            common, intra_op_threads=serving.intra_op_threads,
            state_spec_json=_pbtxt_string(json.dumps(state_spec, separators=(",", ":"))),
            value_ranges_json=_pbtxt_string(json.dumps({spec.codes.name: [0, spec.codebook_size]})),
            max_dims_json=_pbtxt_string(json.dumps({spec.codes.name: [spec.num_codebooks, spec.max_frames_per_step]})),
        )
    if target == "null":
        template = (NULL_DIR / "config.pbtxt.tmpl").read_text()
        return string.Template(template).substitute(common, samples_per_frame=spec.samples_per_frame)
    backend_line = ('backend: "onnxruntime"' if target == "onnxruntime" else
                    'backend: "tensorrt"\nplatform: "tensorrt_plan"\ndefault_model_filename: "model.plan"')
    text = string.Template((TEMPLATES / "decoder_native.pbtxt.tmpl").read_text()).substitute(
        common, target=target, backend_line=backend_line, instance_kind=serving.instance_kind,
        states=_state_block(spec, same_buffer=target == "onnxruntime"),
    ).rstrip() + "\n"
    if target == "onnxruntime":
        # No memory patterns: blocks planned per input shape, taken whole from the arena every run,
        # fragment it over the many batch shapes (docs/design.md §5.1).
        text += 'parameters { key: "enable_mem_pattern" value: { string_value: "0" } }\n'
    if target == "onnxruntime" and serving.intra_op_threads:
        # ONNX Runtime's threads per decoder instance (0, the default: one per core).
        text += (f'parameters {{ key: "intra_op_thread_count" value: {{ string_value: "{serving.intra_op_threads}" }} '
                 "}\n")
    return text


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        target.unlink()
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def set_idle_timeout(repository: Path, idle_timeout_s: float, decoder_model_name: str = "mimi_decoder") -> None:
    """Set the stream idle timeout of a rendered repository: code2wav's to `idle_timeout_s`, the
    decoder's to that plus DECODER_IDLE_MARGIN_US (the decoder must outlive the front's streams)."""
    front_us = round(idle_timeout_s * 1e6)
    if front_us <= 0:
        raise ValueError(f"the idle timeout must be positive, got {idle_timeout_s!r}")
    for name, value in (("code2wav", front_us), (decoder_model_name, front_us + DECODER_IDLE_MARGIN_US)):
        config = Path(repository) / name / "config.pbtxt"
        text, count = _IDLE_TIMEOUT.subn(lambda match, value=value: f"{match.group(1)}{value}", config.read_text())
        if count != 1:
            raise ValueError(f"{config}: max_sequence_idle_microseconds appears {count} times, expected once")
        config.write_text(text)


SERVER_ARGS_FILE = "tritonserver.args"  # in the repository root; Triton only loads model folders
MIB = 2**20
# Triton's own pinned-pool default; the rendered size never goes below it.
DEFAULT_PINNED_POOL_BYTES = 256 * MIB


@dataclass(frozen=True)
class MemoryPools:
    """tritonserver's memory pools for `streams` live sequences of a KIND_GPU decoder with implicit state
    (docs/design.md §5.1): CUDA, two state buffers per sequence plus a batch's new outputs (past it, state
    falls back to host memory); pinned, a batch's host-side tensors (fresh zero state, codes, PCM)."""

    streams: int
    state_bytes: int
    max_batch_size: int
    io_bytes_per_row: int

    @classmethod
    def for_spec(cls, spec: DecoderSpec, streams: int, max_batch_size: int) -> MemoryPools:
        # Codes int32 and PCM float32 of a full step (max_frames_per_step frames).
        io = 4 * spec.max_frames_per_step * (spec.num_codebooks + spec.samples_per_frame)
        return cls(streams, spec.state_bytes_per_stream(), max_batch_size, io)

    @property
    def cuda_pool_bytes(self) -> int:
        return _round_up_mib((2 * self.streams + self.max_batch_size) * self.state_bytes)

    @property
    def pinned_pool_bytes(self) -> int:
        return max(DEFAULT_PINNED_POOL_BYTES, _round_up_mib(self.max_batch_size * (self.state_bytes + self.io_bytes_per_row)))

    def server_args(self, gpu: int = 0) -> list[str]:
        return [f"--cuda-memory-pool-byte-size={gpu}:{self.cuda_pool_bytes}",
                f"--pinned-memory-pool-byte-size={self.pinned_pool_bytes}"]


def _round_up_mib(size: int) -> int:
    return -(-size // MIB) * MIB


def render_code2wav_config(spec: DecoderSpec, serving: DecoderServing | None = None) -> str:
    """The config.pbtxt text of `code2wav` in front of a decoder of `spec` served with `serving`: per
    instance, max_live_streams is its share of the decoder's max_candidate_sequences (rounded down) and
    its own max_candidate_sequences CODE2WAV_SLOTS_PER_STREAM times that (docs/design.md §5.1)."""
    serving = serving or DecoderServing()
    serving.validate()
    # Spare slots let a START past the cap reach the front, which refuses it instead of Triton queueing it.
    per_instance = serving.max_candidate_sequences // serving.front_instances
    # The decoder's geometry, under the names code2wav's parameters share with the spec.
    geometry = {name: getattr(spec, name) for name in ("num_codebooks", "codebook_size", "samples_per_frame",
                                                        "sample_rate_hz")}
    return string.Template(CODE2WAV_TEMPLATE.read_text()).substitute(
        geometry, decoder_model_name=serving.model_name, decoder_max_frames_per_step=spec.max_frames_per_step,
        max_live_streams=per_instance, max_candidate_sequences=CODE2WAV_SLOTS_PER_STREAM * per_instance,
        instance_count=serving.front_instances, max_queue_delay_us=serving.front_queue_delay_us,
    )


def _copy_common(version: Path) -> None:
    for source in sorted(COMMON_DIR.glob("*.py")):
        shutil.copy2(source, version / source.name)


def render_repository(spec: DecoderSpec, onnx_path: Path, out_dir: Path, target: str = "python-ort",
                      serving: DecoderServing | None = None, plan_path: Path | None = None) -> Path:
    """A complete model repository in `out_dir` (not inside the tracked model_repository/): code2wav
    plus mimi_decoder for `target`, model_repository/common/ beside each Python model's model.py, and
    for a KIND_GPU decoder with implicit state `tritonserver.args`, the `MemoryPools` flags one per line."""
    out_dir = out_dir.resolve()
    if out_dir == (REPO_ROOT / "model_repository").resolve() or (REPO_ROOT / "model_repository").resolve() in out_dir.parents:
        raise ValueError(f"refusing to render into the tracked model repository: {out_dir}")
    serving = serving or DecoderServing(instance_kind="KIND_CPU" if target in PYTHON_TARGETS else "KIND_GPU")
    serving.validate()
    code2wav = out_dir / "code2wav"
    if code2wav.exists():
        shutil.rmtree(code2wav)
    shutil.copytree(CODE2WAV_DIR / "1", code2wav / "1", ignore=shutil.ignore_patterns("__pycache__"))
    _copy_common(code2wav / "1")
    (code2wav / "config.pbtxt").write_text(render_code2wav_config(spec, serving))
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
        _copy_common(version)
    args_file = out_dir / SERVER_ARGS_FILE
    if serving.instance_kind == "KIND_GPU" and target not in PYTHON_TARGETS:
        pools = MemoryPools.for_spec(spec, serving.max_candidate_sequences, serving.max_batch_size)
        args_file.write_text("".join(f"{arg}\n" for arg in pools.server_args()))
    elif args_file.exists():
        args_file.unlink()
    return out_dir
