"""The models' configs: rendered `mimi_decoder` configs parse as Triton ModelConfigs and match the ONNX graph;
code2wav's, served as it is and rendered, gives the core its default settings; the checked-in ones are fresh."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS, SAMPLE_RATE_HZ, SAMPLES_PER_FRAME
from mimi_code2wav.export.onnx_export import ExportOptions
from mimi_code2wav.export.pipeline import spec_for_options
from mimi_code2wav.export.render import (
    CHECKED_IN_CODE2WAV_CONFIG,
    CHECKED_IN_CONFIG,
    CODE2WAV_IDLE_TIMEOUT_US,
    CODE2WAV_SLOTS_PER_STREAM,
    REPO_ROOT,
    TARGETS,
    DecoderServing,
    render_code2wav_config,
    render_config,
    render_repository,
    set_fields,
)
from mimi_code2wav.export.spec import ONNX_ELEM_TYPES, TRITON_DTYPES, DecoderSpec, StateSpec

from helpers import MODEL_REPOSITORY, export_spec, load_model_module

code2wav_settings = load_model_module(MODEL_REPOSITORY / "code2wav" / "1" / "code2wav_settings.py")
TRITON_TO_ONNX = {TRITON_DTYPES[name]: ONNX_ELEM_TYPES[name] for name in TRITON_DTYPES}


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def dtype_name(value: int) -> str:
    return model_config_pb2.DataType.Name(value)


@pytest.fixture(scope="module")
def spec(onnx_fp32) -> DecoderSpec:
    return export_spec(onnx_fp32)


@pytest.fixture(scope="module")
def default_spec() -> DecoderSpec:
    return spec_for_options(ExportOptions())


@pytest.fixture(scope="module")
def graph(onnx_fp32):
    import onnx

    model = onnx.load(str(onnx_fp32 / "model.onnx"), load_external_data=False)

    def io(values):
        # A symbolic dim (batch, frames, samples) reads as -1, as Triton's dims write a variable one.
        return {v.name: (v.type.tensor_type.elem_type,
                         [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim][1:])
                for v in values}

    return io(model.graph.input), io(model.graph.output)


@pytest.mark.parametrize("target", TARGETS)
def test_rendered_config_matches_the_onnx_graph(spec, graph, target):
    inputs, outputs = graph
    config = parse(render_config(spec, target))
    assert config.name == "mimi_decoder" and config.max_batch_size == 64
    assert config.backend == {"onnxruntime": "onnxruntime", "tensorrt": "tensorrt", "python-ort": "python",
                              "null": "python"}[target]
    for declared, graph_io in ((config.input, inputs), (config.output, outputs)):
        for tensor in declared:
            assert tensor.name in graph_io, f"{tensor.name} is not a graph tensor"
            elem, dims = graph_io[tensor.name]
            assert TRITON_TO_ONNX[dtype_name(tensor.data_type)] == elem, tensor.name
            assert list(tensor.dims) == dims, tensor.name
    assert [t.name for t in config.input] == ["codes"] and [t.name for t in config.output] == ["pcm"]
    batching = config.sequence_batching
    code2wav = parse(CHECKED_IN_CODE2WAV_CONFIG.read_text())
    assert batching.HasField("oldest")
    assert batching.max_sequence_idle_microseconds > code2wav.sequence_batching.max_sequence_idle_microseconds

    if target == "null":
        assert not batching.state and set(config.parameters) == {"samples_per_frame"}
        assert config.parameters["samples_per_frame"].string_value == str(SAMPLES_PER_FRAME)
        return
    if target == "python-ort":
        assert not batching.state, "the Python backend must not get a state block (it copies the initial state)"
        states = json.loads(config.parameters["state_spec"].string_value)
        assert [(s["input"], s["output"]) for s in states] == [(s.input, s.output) for s in spec.states]
        for state in states:
            assert inputs[state["input"]] == outputs[state["output"]] == (ONNX_ELEM_TYPES[state["dtype"]], state["shape"])
        assert json.loads(config.parameters["value_ranges"].string_value) == {"codes": [0, spec.codebook_size]}
        assert json.loads(config.parameters["max_dims"].string_value) == {"codes": [8, spec.max_frames_per_step]}
        # The model reads it as Triton hands it over (strictly: every parameter it knows, no other).
        ort_config = load_model_module(MODEL_REPOSITORY / "mimi_decoder" / "python_ort" / "python_ort_config.py")
        decoder = ort_config.parse_model_config(json_format.MessageToDict(config, preserving_proto_field_name=True),
                                                {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32}.__getitem__)
        assert decoder.max_live_streams == batching.oldest.max_candidate_sequences
        return

    # Triton pairs input and output states by position in two name-sorted lists.
    pairs = {s.input_name: s.output_name for s in batching.state}
    sorted_inputs, sorted_outputs = sorted(pairs), sorted(pairs.values())
    assert [pairs[name] for name in sorted_inputs] == sorted_outputs
    assert set(pairs) | {"codes"} == set(inputs) and set(pairs.values()) | {"pcm"} == set(outputs)
    for state in batching.state:
        elem, dims = inputs[state.input_name]
        assert outputs[state.output_name] == (elem, dims) == (TRITON_TO_ONNX[dtype_name(state.data_type)], list(state.dims))
        assert state.initial_state[0].zero_data and list(state.initial_state[0].dims) == dims
    assert model_config_pb2.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind) == "KIND_GPU"


def test_serving_options_render_and_native_state_shares_one_buffer(spec):
    """Native ORT keeps one buffer per state and slot, TensorRT two; ORT's memory patterns are off (§5.1)."""
    native = render_config(spec, "onnxruntime", DecoderServing(instance_kind="KIND_CPU"))
    assert native.count("use_same_buffer_for_input_output: true") == len(spec.states)
    assert "intra_op_thread_count" not in native
    plan = render_config(spec, "tensorrt")
    assert "use_same_buffer_for_input_output" not in plan and "parameters" not in plan
    config = parse(render_config(spec, "onnxruntime", DecoderServing(
        instance_kind="KIND_CPU", instance_count=3, max_batch_size=16, preferred_batch_sizes=[4, 16], intra_op_threads=1)))
    assert model_config_pb2.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind) == "KIND_CPU"
    assert config.instance_group[0].count == 3 and config.max_batch_size == 16
    assert list(config.sequence_batching.oldest.preferred_batch_size) == [4, 16]
    assert config.parameters["intra_op_thread_count"].string_value == "1"
    assert config.parameters["enable_mem_pattern"].string_value == "0"
    assert all(state.use_same_buffer_for_input_output for state in config.sequence_batching.state)
    with pytest.raises(ValueError, match=r"preferred batch sizes \[32\] exceed max_batch_size 16"):
        render_config(spec, "onnxruntime", DecoderServing(max_batch_size=16, preferred_batch_sizes=[8, 32]))


def test_spec_refuses_names_that_sort_differently():
    good = DecoderSpec(NUM_CODEBOOKS, CODEBOOK_SIZE, 1, SAMPLES_PER_FRAME, SAMPLE_RATE_HZ, "moshi", "float32",
                       (StateSpec("state_in_00_a", "state_out_00_a", "float32", (1,)),
                        StateSpec("state_in_01_b", "state_out_01_b", "int32", (1,))))
    good.validate()
    bad = DecoderSpec(NUM_CODEBOOKS, CODEBOOK_SIZE, 1, SAMPLES_PER_FRAME, SAMPLE_RATE_HZ, "moshi", "float32",
                      (StateSpec("x", "x_next", "float32", (1,)), StateSpec("x_len", "x_len_next", "int32", (1,))))
    with pytest.raises(ValueError, match="sort differently"):
        bad.validate()
    assert DecoderSpec.from_dict(json.loads(good.to_json())) == good


def test_rendered_repository_layout(spec, onnx_fp32, tmp_path):
    """Both models' files, never into the tracked repository; code2wav's frames per call are the export's."""
    with pytest.raises(ValueError, match="refusing to render into the tracked model repository"):
        render_repository(spec, onnx_fp32 / "model.onnx", REPO_ROOT / "model_repository", "python-ort")
    smaller = DecoderSpec.from_dict({**spec.to_dict(), "max_frames_per_step": 4})
    out = render_repository(smaller, onnx_fp32 / "model.onnx", tmp_path / "repo", "python-ort")
    for path in ("code2wav/config.pbtxt", "code2wav/1/model.py", "code2wav/1/code2wav_core.py",
                 "code2wav/1/model_errors.py", "code2wav/1/idle_sweeper.py", "mimi_decoder/config.pbtxt",
                 "mimi_decoder/1/model.py", "mimi_decoder/1/python_ort_core.py", "mimi_decoder/1/python_ort_config.py",
                 "mimi_decoder/1/model_metrics.py", "mimi_decoder/1/model.onnx"):
        assert (out / path).is_file(), path
    with pytest.raises(ValueError, match="needs a plan file"):
        render_repository(spec, onnx_fp32 / "model.onnx", tmp_path / "trt", "tensorrt")
    assert Path(out / "mimi_decoder/1/model.onnx").stat().st_size == (onnx_fp32 / "model.onnx").stat().st_size
    rendered = parse((out / "code2wav" / "config.pbtxt").read_text())
    assert rendered.parameters["decoder_max_frames_per_step"].string_value == "4"


def test_stream_capacity_renders_into_both_models_and_the_gpu_pools(onnx_fp32, tmp_path, capsys):
    """`render --max-live-streams N`: the decoder holds N, code2wav admits N with 2N slots (a START past the cap
    reaches it and is refused), and a GPU repository carries the pool flags for N streams."""
    from mimi_code2wav.export.__main__ import main

    def render(target: str, out: Path, *flags: str) -> tuple[model_config_pb2.ModelConfig, ...]:
        assert main(["render", "--target", target, "--export-dir", str(onnx_fp32), "--out", str(out), *flags]) == 0
        return tuple(parse((out / model / "config.pbtxt").read_text()) for model in ("code2wav", "mimi_decoder"))

    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    gpu_configs = render("onnxruntime", gpu, "--max-live-streams", "256")
    cpu_configs = render("python-ort", cpu, "--max-live-streams", "256", "--max-queue-delay-us", "0")
    assert cpu_configs[1].sequence_batching.oldest.max_queue_delay_microseconds == 0
    assert gpu_configs[1].sequence_batching.oldest.max_queue_delay_microseconds == 2000
    for code2wav, decoder in (gpu_configs, cpu_configs):
        assert code2wav.parameters["max_live_streams"].string_value == "256"
        assert code2wav.sequence_batching.oldest.max_candidate_sequences == 512
        assert decoder.sequence_batching.oldest.max_candidate_sequences == 256
    state = 8177156  # bytes per stream, fp32 KV cache
    mib = 2**20
    assert (gpu / "tritonserver.args").read_text().splitlines() == [
        f"--cuda-memory-pool-byte-size=0:{-(-(2 * 256 + 64) * state // mib) * mib}",  # 4.39 GiB
        f"--pinned-memory-pool-byte-size={-(-64 * (state + 16 * (NUM_CODEBOOKS + SAMPLES_PER_FRAME) * 4) // mib) * mib}",
    ]
    assert not (cpu / "tritonserver.args").exists()
    assert code2wav.instance_group[0].count == 1
    # Several front instances share the streams out: each admits its share, with 2x the slots.
    shared = tmp_path / "shared"
    assert code2wav.sequence_batching.oldest.max_queue_delay_microseconds == 3000  # as checked in
    assert parse(CHECKED_IN_CODE2WAV_CONFIG.read_text()).sequence_batching.oldest.max_queue_delay_microseconds == 3000
    code2wav = render("null", shared, "--max-live-streams", "255", "--front-instances", "2", "--front-queue-delay-us", "0")[0]
    assert code2wav.instance_group[0].count == 2
    assert code2wav.sequence_batching.oldest.max_queue_delay_microseconds == 0
    assert code2wav.parameters["max_live_streams"].string_value == "127"  # 2 x 127 <= 255
    assert code2wav.sequence_batching.oldest.max_candidate_sequences == 254
    assert main(["render", "--target", "null", "--export-dir", str(onnx_fp32), "--out", str(shared),
                 "--max-live-streams", "2", "--front-instances", "3"]) == 2
    assert "front_instances (3) must not exceed the streams the decoder holds (2)" in capsys.readouterr().err
    # The python-ort decoder holds state for as many streams as it has sequence slots.
    assert cpu_configs[1].parameters["max_live_streams"].string_value == "256"


# ---- code2wav ---------------------------------------------------------------------------------------

def test_render_sets_each_field_where_it_is_set_once():
    """Strict: a field is set only outside comments, and one that is not there exactly once is an error."""
    text = 'count: 1\n# count: 3\n{ key: "dedupe_mode"\n  value: { string_value: "delta" } }\n'
    assert set_fields(text, {"count": 5, "parameter:dedupe_mode": "auto"}, "x") == text.replace("1", "5").replace("delta", "auto")
    with pytest.raises(ValueError, match="x: parameter:max_live_streams appears 0 times, expected once"):
        set_fields(text, {"parameter:max_live_streams": 1}, "x")
    with pytest.raises(ValueError, match="count appears 2 times"):
        set_fields(text + "count: 2\n", {"count": 5}, "x")


def test_the_rendering_follows_the_spec_and_the_serving_options(default_spec):
    spec = dataclasses.replace(default_spec, num_codebooks=16, codebook_size=1024, samples_per_frame=960,
                               sample_rate_hz=12000, max_frames_per_step=4)
    serving = DecoderServing(model_name="other_decoder", max_candidate_sequences=100, front_instances=3,
                             front_queue_delay_us=500)
    config = parse(render_code2wav_config(spec, serving))
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    assert parameters["decoder_model_name"] == "other_decoder"
    assert [parameters[name] for name in ("num_codebooks", "codebook_size", "samples_per_frame", "sample_rate_hz",
                                          "decoder_max_frames_per_step")] == ["16", "1024", "960", "12000", "4"]
    # Each of the 3 instances admits its share of the decoder's 100 streams, rounded down.
    assert parameters["max_live_streams"] == "33"
    assert config.sequence_batching.oldest.max_candidate_sequences == CODE2WAV_SLOTS_PER_STREAM * 33
    assert config.sequence_batching.oldest.max_queue_delay_microseconds == 500
    assert config.instance_group[0].count == 3
    assert config.sequence_batching.max_sequence_idle_microseconds == CODE2WAV_IDLE_TIMEOUT_US


def test_the_checked_in_configs_are_the_default_rendering_and_give_the_core_its_default_settings(default_spec):
    """code2wav's initialize reads (uint64 fields as strings) the core's default settings and its tensors."""
    assert CHECKED_IN_CONFIG.read_text() == render_config(default_spec, "onnxruntime"), (
        "model_repository/mimi_decoder/config.pbtxt is stale: run `code2wav-export render --check-in`")
    assert CHECKED_IN_CODE2WAV_CONFIG.read_text() == render_code2wav_config(default_spec), (
        "model_repository/code2wav/config.pbtxt disagrees with the default export and render options")
    config = parse(CHECKED_IN_CODE2WAV_CONFIG.read_text())
    assert set(config.parameters) == set(code2wav_settings.PARAMETER_TYPES)
    settings = code2wav_settings.settings_from_config(json_format.MessageToDict(config, preserving_proto_field_name=True))
    assert settings == code2wav_settings.Code2WavSettings()
    assert (settings.max_live_streams, config.sequence_batching.oldest.max_candidate_sequences) == (1024, 2048)
    assert parse(CHECKED_IN_CONFIG.read_text()).sequence_batching.oldest.max_candidate_sequences == 1024
    assert settings.stream_idle_timeout_s * 1e6 == CODE2WAV_IDLE_TIMEOUT_US < DecoderServing().idle_timeout_us
    assert config.max_batch_size > 0 and config.sequence_batching.WhichOneof("strategy_choice") == "oldest"
    controls = {c.name: c.control[0] for c in config.sequence_batching.control_input}
    assert set(controls) == {"START", "END", "READY", "CORRID"}
    assert controls["CORRID"].data_type == model_config_pb2.TYPE_UINT64
    inputs = {t.name: (t.data_type, list(t.dims), t.optional) for t in config.input}
    assert inputs["input_ids"][:2] == (model_config_pb2.TYPE_INT64, [-1])
    assert inputs["frame_offset"][1:] == ([1], True)
    assert inputs["history_frames"] == (model_config_pb2.TYPE_INT64, [1], True)
    outputs = {t.name: t.data_type for t in config.output}
    assert (outputs["model_outputs"], outputs["sr"]) == (model_config_pb2.TYPE_FP32, model_config_pb2.TYPE_INT32)
