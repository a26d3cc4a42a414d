"""Model repositories around an export: the configs per target (docs/design.md §4) and their serving flags."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .spec import TRITON_DTYPES, DecoderSpec, TensorSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "model_repository"
CHECKED_IN_CONFIG = MODELS_DIR / "mimi_decoder" / "config.pbtxt"
CODE2WAV_DIR = MODELS_DIR / "code2wav"
CHECKED_IN_CODE2WAV_CONFIG = CODE2WAV_DIR / "config.pbtxt"
PYTHON_ORT_FILES = ("model.py", "python_ort_core.py", "python_ort_config.py")
# The Python-backend decoders (no implicit state): their sources, copied into the version folder.
PYTHON_DECODERS = {"python-ort": [MODELS_DIR / "mimi_decoder" / "python_ort" / name for name in PYTHON_ORT_FILES],
                   "null": [MODELS_DIR / "mimi_decoder" / "null" / "model.py"]}
COMMON_DIR = MODELS_DIR / "common"  # no model: its files are copied beside each Python model.py
TARGETS = ("onnxruntime", "tensorrt", "python-ort", "null")
SERVER_ARGS_FILE = "tritonserver.args"  # in the repository root; Triton only loads model folders
MIB = 2**20
DEFAULT_PINNED_POOL_BYTES = 256 * MIB  # Triton's own default; the rendered size never goes below it


def _field(text: str, name: str, where: object) -> re.Match:
    """The one `name: 123` field (`parameter:KEY`: that string parameter) outside comments: (before, value, after)."""
    pattern = (rf'^([^#\n]*key: "{name.removeprefix("parameter:")}"\s+value: \{{ string_value: ")([^"\n]*)(")'
               if name.startswith("parameter:") else rf"^([^#\n]*\b{name}:\s*)(\d+)()")
    found = list(re.finditer(pattern, text, flags=re.M))
    if len(found) != 1:
        raise ValueError(f"{where}: {name} appears {len(found)} times, expected once")
    return found[0]


def set_fields(text: str, values: dict[str, object], where: object) -> str:
    for name, value in values.items():
        match = _field(text, name, where)
        text = text[: match.start()] + f"{match[1]}{value}{match[3]}" + text[match.end() :]
    return text


# code2wav's idle timeout (the decoder's sits above it); it bounds a shutdown, as abandoned streams idle out.
CODE2WAV_IDLE_TIMEOUT_US = int(_field(CHECKED_IN_CODE2WAV_CONFIG.read_text(), "max_sequence_idle_microseconds",
                                      CHECKED_IN_CODE2WAV_CONFIG)[2])
CODE2WAV_SLOTS_PER_STREAM = 2
DECODER_IDLE_MARGIN_US = 2_000_000


@dataclass
class DecoderServing:
    """Serving knobs of the rendered configs (not part of the exported graph)."""

    model_name: str = "mimi_decoder"
    max_batch_size: int = 64
    idle_timeout_us: int = CODE2WAV_IDLE_TIMEOUT_US + DECODER_IDLE_MARGIN_US
    max_candidate_sequences: int = 1024
    preferred_batch_sizes: list[int] = field(default_factory=lambda: [8, 16, 32, 64])
    max_queue_delay_us: int = 2000
    instance_kind: str = "KIND_GPU"
    instance_count: int = 1
    intra_op_threads: int = 0
    front_instances: int = 1  # code2wav's instances (Python processes, each under its own GIL)
    front_queue_delay_us: int = 3000  # code2wav's batcher wait: a batch's decoder calls arrive together

    def validate(self) -> None:
        if self.instance_kind not in ("KIND_GPU", "KIND_CPU"):
            raise ValueError(f"instance_kind must be KIND_GPU or KIND_CPU, got {self.instance_kind!r}")
        counts = (self.max_batch_size, self.instance_count, self.max_candidate_sequences, self.front_instances)
        if min(self.max_queue_delay_us, self.front_queue_delay_us) < 0 or min(counts) < 1:
            raise ValueError(f"queue delays must be >= 0 and instance, batch and stream counts >= 1, got {self}")
        if self.front_instances > self.max_candidate_sequences:
            raise ValueError(f"front_instances ({self.front_instances}) must not exceed the streams the decoder "
                             f"holds ({self.max_candidate_sequences}): each instance admits at least one")
        if too_big := [size for size in self.preferred_batch_sizes if size > self.max_batch_size]:
            raise ValueError(f"preferred batch sizes {too_big} exceed max_batch_size {self.max_batch_size}")


def _int_at_least(minimum: int, text: str) -> int:
    if not text.strip().isdigit() or int(text) < minimum:
        raise argparse.ArgumentTypeError(f"an integer >= {minimum}, got {text!r}")
    return int(text)


positive_int, non_negative_int = functools.partial(_int_at_least, 1), functools.partial(_int_at_least, 0)


# The serving flags besides --instance-kind: (flag, the DecoderServing field it sets, parser, help).
SERVING_FLAGS = (
    ("--instance-count", "instance_count", positive_int, "decoder instances"),
    ("--max-batch-size", "max_batch_size", positive_int, "the decoder's largest batch"),
    ("--max-queue-delay-us", "max_queue_delay_us", non_negative_int,
     "the decoder's batcher wait for more streams' steps; 0 suits a GPU"),
    ("--max-live-streams", "max_candidate_sequences", positive_int,
     "live streams the decoder holds, shared out as code2wav's max_live_streams; sizes the GPU memory pools"),
    ("--front-instances", "front_instances", positive_int, "code2wav instances (processes); more use more cores"),
    ("--intra-op-threads", "intra_op_threads", non_negative_int,
     "ONNX Runtime threads per decoder instance; 0: one per core"),
    ("--front-queue-delay-us", "front_queue_delay_us", non_negative_int,
     "code2wav's batcher wait for more streams' requests"),
)


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("serving (the rendered configs)")
    group.add_argument("--instance-kind", choices=("KIND_GPU", "KIND_CPU"),
                       help="the decoder's instances (default: KIND_CPU for the Python decoders, else KIND_GPU)")
    for flag, name, parse, text in SERVING_FLAGS:
        group.add_argument(flag, type=parse, default=getattr(DecoderServing, name), help=f"{text} (default %(default)s)")


def serving_from_args(args: argparse.Namespace, target: str) -> DecoderServing:
    return DecoderServing(
        instance_kind=args.instance_kind or ("KIND_CPU" if target in PYTHON_DECODERS else "KIND_GPU"),
        preferred_batch_sizes=[s for s in DecoderServing().preferred_batch_sizes if s <= args.max_batch_size],
        **{name: getattr(args, flag[2:].replace("-", "_")) for flag, name, _, _ in SERVING_FLAGS},
    )


def _dims(shape) -> str:
    return ", ".join(map(str, shape))


def _tensor_block(kind: str, tensor: TensorSpec) -> str:
    return f'{kind} [\n  {{ name: "{tensor.name}" data_type: {TRITON_DTYPES[tensor.dtype]} dims: [ {_dims(tensor.shape)} ] }}\n]'


def _state_block(spec: DecoderSpec, same_buffer: bool) -> str:
    """Implicit state; `same_buffer` suits ONNX Runtime's backend, which copies outputs into it after the run (§5.1)."""
    entries = []
    for state in spec.states:
        typed = f"data_type: {TRITON_DTYPES[state.dtype]} dims: [ {_dims(state.shape)} ]"
        entries.append(f'    {{ input_name: "{state.input}" output_name: "{state.output}"\n      {typed}'
                       + (" use_same_buffer_for_input_output: true" if same_buffer else "")
                       + f'\n      initial_state {{ {typed} zero_data: true name: "fresh_stream" }} }}')
    return "  state [\n" + ",\n".join(entries) + "\n  ]"


# The Python decoders get the sequence controls as inputs; the native ones keep the state instead.
_CONTROL_INPUTS = """  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]"""
_NATIVE = "Triton keeps the state (implicit state, docs/design.md §4)."
_TARGET_HEADERS = {  # target: (its note, its backend)
    "onnxruntime": (f"{_NATIVE} With the default options this is\n# model_repository/mimi_decoder/config.pbtxt "
                    "(`render --check-in`; tests/test_configs.py checks it).", 'backend: "onnxruntime"'),
    "tensorrt": (_NATIVE, 'backend: "tensorrt"\nplatform: "tensorrt_plan"\ndefault_model_filename: "model.plan"'),
    "python-ort": ("No `state` block: the Python backend would copy the initial state into every\n# request; "
                   "model.py keeps the state itself.", 'backend: "python"'),
    "null": ("A bench target: the decoder's interface, silence at once, no decoding and no state.",
             'backend: "python"'),
}


def _parameters(comment: str, values: dict[str, object]) -> str:
    # A JSON string literal is a valid protobuf text-format string.
    items = ",\n".join(f'  {{ key: "{key}" value: {{ string_value: {json.dumps(str(value))} }} }}'
                       for key, value in values.items())
    return f"# {comment}\nparameters [\n{items}\n]\n"


def render_config(spec: DecoderSpec, target: str, serving: DecoderServing | None = None) -> str:
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    serving = serving or DecoderServing()
    serving.validate()
    spec.validate()
    python = target in PYTHON_DECODERS
    text = f"""# Rendered by `code2wav-export render` (export/render.py) from the export's spec: do not edit by hand.
# Target: {target}. Spec sha256: {spec.sha256()}
# {_TARGET_HEADERS[target][0]}
name: "{serving.model_name}"
{_TARGET_HEADERS[target][1]}
max_batch_size: {serving.max_batch_size}
{_tensor_block("input", spec.codes)}
{_tensor_block("output", spec.pcm)}
sequence_batching {{
  # Above code2wav's idle timeout, so the BLS always forgets a stream first.
  max_sequence_idle_microseconds: {serving.idle_timeout_us}
  oldest {{
    max_candidate_sequences: {serving.max_candidate_sequences}
    preferred_batch_size: [ {_dims(serving.preferred_batch_sizes)} ]
    max_queue_delay_microseconds: {serving.max_queue_delay_us}
  }}
{_CONTROL_INPUTS if python else _state_block(spec, same_buffer=target == "onnxruntime")}
}}
instance_group [ {{ kind: {"KIND_CPU" if python else serving.instance_kind} count: {serving.instance_count} }} ]
"""
    if target == "python-ort":
        text += _parameters(
            "All required, no other accepted (python_ort_config.py); max_live_streams is max_candidate_sequences.",
            {"onnx_file": "model.onnx", "intra_op_threads": serving.intra_op_threads,
             "state_spec": json.dumps(spec.to_dict()["states"], separators=(",", ":")),
             "value_ranges": json.dumps({spec.codes.name: [0, spec.codebook_size]}),
             "max_dims": json.dumps({spec.codes.name: [spec.num_codebooks, spec.max_frames_per_step]}),
             "max_live_streams": serving.max_candidate_sequences})
    elif target == "null":
        text += _parameters("All required; an unknown one fails the load.", {"samples_per_frame": spec.samples_per_frame})
    elif target == "onnxruntime":
        threads = {"intra_op_thread_count": serving.intra_op_threads} if serving.intra_op_threads else {}
        text += _parameters("ONNX Runtime: no memory patterns (they fragment the arena over the batch shapes, "
                            "docs/design.md §5.1)" + ("; threads per instance" if threads else "") + ".",
                            {"enable_mem_pattern": 0, **threads})
    return text


def set_idle_timeout(repository: Path, idle_timeout_s: float, decoder_model_name: str = "mimi_decoder") -> None:
    """code2wav's stream idle timeout; the decoder's DECODER_IDLE_MARGIN_US above (it outlives the front's streams)."""
    if (front_us := round(idle_timeout_s * 1e6)) <= 0:
        raise ValueError(f"the idle timeout must be positive, got {idle_timeout_s!r}")
    for name, value in (("code2wav", front_us), (decoder_model_name, front_us + DECODER_IDLE_MARGIN_US)):
        config = Path(repository) / name / "config.pbtxt"
        config.write_text(set_fields(config.read_text(), {"max_sequence_idle_microseconds": value}, config))


def memory_pool_args(spec: DecoderSpec, streams: int, max_batch_size: int) -> list[str]:
    """tritonserver's pool flags for a KIND_GPU decoder with implicit state (docs/design.md §5.1): CUDA, two
    state buffers per stream plus a batch's outputs; pinned, a batch's host tensors (zero state, codes, PCM)."""
    state = spec.state_bytes_per_stream()
    io_per_row = 4 * spec.max_frames_per_step * (spec.num_codebooks + spec.samples_per_frame)  # int32, fp32
    cuda, pinned = (2 * streams + max_batch_size) * state, max_batch_size * (state + io_per_row)
    return [f"--cuda-memory-pool-byte-size=0:{-(-cuda // MIB) * MIB}",
            f"--pinned-memory-pool-byte-size={max(DEFAULT_PINNED_POOL_BYTES, -(-pinned // MIB) * MIB)}"]


def render_code2wav_config(spec: DecoderSpec, serving: DecoderServing | None = None) -> str:
    """code2wav's config: each instance admits its share of the decoder's streams (docs/design.md §5.1)."""
    serving = serving or DecoderServing()
    serving.validate()
    # Spare slots let a START past the cap reach the front, which refuses it instead of Triton queueing it.
    per_instance = serving.max_candidate_sequences // serving.front_instances
    geometry = {f"parameter:{name}": getattr(spec, name)
                for name in ("num_codebooks", "codebook_size", "samples_per_frame", "sample_rate_hz")}
    return set_fields(CHECKED_IN_CODE2WAV_CONFIG.read_text(), {
        **geometry, "parameter:decoder_model_name": serving.model_name,
        "parameter:decoder_max_frames_per_step": spec.max_frames_per_step, "parameter:max_live_streams": per_instance,
        "max_candidate_sequences": CODE2WAV_SLOTS_PER_STREAM * per_instance,
        "max_queue_delay_microseconds": serving.front_queue_delay_us, "count": serving.front_instances,
    }, CHECKED_IN_CODE2WAV_CONFIG)


def render_repository(spec: DecoderSpec, onnx_path: Path, out_dir: Path, target: str = "python-ort",
                      serving: DecoderServing | None = None, plan_path: Path | None = None) -> Path:
    """code2wav + mimi_decoder for `target` in `out_dir`, and a native KIND_GPU decoder's `tritonserver.args`."""
    out_dir, tracked = out_dir.resolve(), MODELS_DIR.resolve()
    if out_dir == tracked or tracked in out_dir.parents:
        raise ValueError(f"refusing to render into the tracked model repository: {out_dir}")
    serving = serving or DecoderServing(instance_kind="KIND_CPU" if target in PYTHON_DECODERS else "KIND_GPU")
    serving.validate()
    if target == "tensorrt" and plan_path is None:
        raise ValueError("the tensorrt target needs a plan file (export/tensorrt_build.py builds one)")
    code2wav, decoder = out_dir / "code2wav", out_dir / serving.model_name
    for folder in (code2wav, decoder):
        shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(CODE2WAV_DIR / "1", code2wav / "1", ignore=shutil.ignore_patterns("__pycache__"))
    (code2wav / "config.pbtxt").write_text(render_code2wav_config(spec, serving))
    (decoder / "1").mkdir(parents=True)
    (decoder / "config.pbtxt").write_text(render_config(spec, target, serving))
    if target != "null":
        model, name = (plan_path, "model.plan") if target == "tensorrt" else (onnx_path, "model.onnx")
        try:  # a hard link where it can, else a copy
            os.link(model, decoder / "1" / name)
        except OSError:
            shutil.copy2(model, decoder / "1" / name)
    common = sorted(COMMON_DIR.glob("*.py"))
    decoder_sources = [*PYTHON_DECODERS[target], *common] if target in PYTHON_DECODERS else []
    for version, sources in ((code2wav / "1", common), (decoder / "1", decoder_sources)):
        for source in sources:
            shutil.copy2(source, version / source.name)
    (out_dir / SERVER_ARGS_FILE).unlink(missing_ok=True)
    if serving.instance_kind == "KIND_GPU" and target not in PYTHON_DECODERS:
        pools = memory_pool_args(spec, serving.max_candidate_sequences, serving.max_batch_size)
        (out_dir / SERVER_ARGS_FILE).write_text("".join(f"{arg}\n" for arg in pools))
    return out_dir
