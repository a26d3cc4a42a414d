"""The python-ort decoder model (`model_repository/mimi_decoder/python_ort/`): implicit state done by hand.

A tiny ONNX step model with known arithmetic stands in for the Mimi decoder:
    S = sum(codes); acc' = acc + S; count' = count + 1; pcm = [acc' x4, count', S]
so every expected output follows from the codes a sequence has sent since its START.
The core (`python_ort_core.py`) is tested directly, then the model files are served, laid out as
render lays them out, by the real tritonserver.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS
from mimi_code2wav.export.render import PYTHON_ORT_FILES

from helpers import MODEL_REPOSITORY, FakeClock, load_model_module, triton_model_config

MODEL_DIR = MODEL_REPOSITORY / "mimi_decoder" / "python_ort"
COMMON_FILES = sorted((MODEL_REPOSITORY / "common").glob("*.py"))

ACC = 4
PCM = ACC + 2
STATE_SPEC = [
    {"input": "state_in_00_acc", "output": "state_out_00_acc", "dtype": "float32", "shape": [ACC]},
    {"input": "state_in_01_count", "output": "state_out_01_count", "dtype": "int64", "shape": [1]},
]
IDLE_TIMEOUT_US = 2_000_000


ort_core = load_model_module(MODEL_DIR / "python_ort_core.py")
ort_config = load_model_module(MODEL_DIR / "python_ort_config.py")
ort_memory = load_model_module(MODEL_DIR / "python_ort_memory.py")


def install_model(version_dir: Path) -> None:
    """The model files of a rendered python-ort version folder (render copies the same ones)."""
    for source in (*(MODEL_DIR / name for name in PYTHON_ORT_FILES), *COMMON_FILES):
        shutil.copyfile(source, version_dir / source.name)


def build_step_onnx(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    batch = "batch"
    graph = helper.make_graph(
        nodes=[
            helper.make_node("Cast", ["codes"], ["codes_f"], to=TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["codes_f", "sum_axes"], ["sum3"], keepdims=1),
            helper.make_node("Squeeze", ["sum3", "squeeze_axes"], ["code_sum"]),
            helper.make_node("Add", ["state_in_00_acc", "code_sum"], ["state_out_00_acc"]),
            helper.make_node("Add", ["state_in_01_count", "one"], ["state_out_01_count"]),
            helper.make_node("Cast", ["state_out_01_count"], ["count_f"], to=TensorProto.FLOAT),
            helper.make_node("Concat", ["state_out_00_acc", "count_f", "code_sum"], ["pcm"], axis=1),
        ],
        name="tiny_step",
        inputs=[
            helper.make_tensor_value_info("codes", TensorProto.INT32, [batch, NUM_CODEBOOKS, 1]),
            helper.make_tensor_value_info("state_in_00_acc", TensorProto.FLOAT, [batch, ACC]),
            helper.make_tensor_value_info("state_in_01_count", TensorProto.INT64, [batch, 1]),
        ],
        outputs=[
            helper.make_tensor_value_info("pcm", TensorProto.FLOAT, [batch, PCM]),
            helper.make_tensor_value_info("state_out_00_acc", TensorProto.FLOAT, [batch, ACC]),
            helper.make_tensor_value_info("state_out_01_count", TensorProto.INT64, [batch, 1]),
        ],
        initializer=[
            helper.make_tensor("sum_axes", TensorProto.INT64, [2], [1, 2]),
            helper.make_tensor("squeeze_axes", TensorProto.INT64, [1], [2]),
            helper.make_tensor("one", TensorProto.INT64, [1], [1]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


class Reference:
    """Expected outputs of one sequence of the tiny model."""

    def __init__(self):
        self.acc = 0.0
        self.count = 0

    def step(self, codes: np.ndarray) -> np.ndarray:
        code_sum = float(codes.sum())
        self.acc += code_sum
        self.count += 1
        return np.array([[self.acc] * ACC + [self.count, code_sum]], dtype=np.float32)


def codes_for(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CODEBOOK_SIZE, size=(1, NUM_CODEBOOKS, 1), dtype=np.int32)


# --- the core, without a server -------------------------------------------------------------------
PARAMETERS = {
    "onnx_file": "model.onnx",
    "intra_op_threads": "1",
    "intra_op_spinning": "off",
    "state_spec": json.dumps(STATE_SPEC),
    "value_ranges": "{}",
    "max_dims": "{}",
    "max_live_streams": "16",
    "max_rows_per_run": "8",
}


def config_with(**parameters):
    """The model config of the tiny model, with some parameters replaced (None: removed)."""
    return {
        "name": "decoder",
        "max_batch_size": 8,
        "input": [{"name": "codes", "data_type": "TYPE_INT32", "dims": ["8", "1"]}],
        "output": [{"name": "pcm", "data_type": "TYPE_FP32", "dims": [str(PCM)]}],
        **triton_model_config({**PARAMETERS, **parameters}, str(IDLE_TIMEOUT_US)),
    }


MODEL_CONFIG = config_with()
TRITON_TYPES = {"TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_FP32": np.float32}


@pytest.fixture(scope="module")
def onnx_session(tmp_path_factory):
    import onnxruntime as ort

    path = build_step_onnx(tmp_path_factory.mktemp("onnx") / "model.onnx")
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def has_stream(core, sequence_id):
    """Whether the core holds the stream's state (no public reader: streams are the core's alone)."""
    return sequence_id in core._streams


def make_core(session, clock=None, run_wrapper=None, config=None):
    config = config or ort_config.parse_model_config(MODEL_CONFIG, TRITON_TYPES.__getitem__)
    config = ort_config.check_against_onnx(config, session.get_inputs(), session.get_outputs())
    names = config.output_names
    calls = []

    def run(feeds):
        calls.append({name: array.shape for name, array in feeds.items()})
        if run_wrapper is not None:
            run_wrapper(feeds)
        return session.run(names, feeds)

    core = ort_core.StreamingDecoderCore(config, run, clock=clock or FakeClock(), model_name="decoder")
    return core, calls


def request(sequence_id, codes, start=False, end=False):
    return ort_core.StepRequest(sequence_id, start, end, {"codes": codes})


def test_parse_model_config_reads_parameters_and_timeout():
    config = ort_config.parse_model_config(MODEL_CONFIG, TRITON_TYPES.__getitem__)
    assert config.idle_timeout_s == 2.0
    assert config.intra_op_threads == 1
    assert config.onnx_file == "model.onnx"
    assert [s.input for s in config.states] == ["state_in_00_acc", "state_in_01_count"]
    assert config.states[1].dtype == np.int64 and config.states[1].shape == (1,)
    assert config.inputs[0].dims == (8, 1) and config.max_batch_size == 8
    assert config.value_ranges == {}
    assert config.max_live_streams == 16 and config.max_rows_per_run == 8 and config.instance_count == 1
    assert config.state_bytes_per_stream == ACC * 4 + 8
    assert ort_config.parse_model_config(config_with(max_live_streams="auto"), TRITON_TYPES.__getitem__).max_live_streams is None
    ranged = ort_config.parse_model_config(config_with(value_ranges='{"codes": [0, 2048]}'), TRITON_TYPES.__getitem__)
    assert ranged.value_ranges == {"codes": (0, 2048)}


# Each of these fails the load with "parameter '<name>': <message>" (a value of None: the parameter left out).
BAD_PARAMETERS = [
    pytest.param("state_spec", None, "missing from the model config's parameters", id="no-state-spec"),
    pytest.param("value_ranges", None, "missing from the model config's parameters", id="no-value-ranges"),
    pytest.param("codebook_size", "2048", "unknown parameter (known: onnx_file, intra_op_threads, intra_op_spinning, "
                 "state_spec, value_ranges, max_dims, max_live_streams, max_rows_per_run)", id="unknown"),
    pytest.param("max_live_streams", "0", "must be a positive integer or 'auto', got '0'", id="cap-0"),
    pytest.param("max_live_streams", "many", "must be a positive integer or 'auto', got 'many'", id="cap-word"),
    pytest.param("max_rows_per_run", "0", "must be a positive integer, got 0", id="rows-0"),
    pytest.param("max_dims", None, "missing from the model config's parameters", id="no-max-dims"),
    pytest.param("max_dims", '{"codes": [8, 0]}', "input 'codes': expected a list of positive integers, got [8, 0]",
                 id="max-dims-zero"),
    pytest.param("max_dims", '{"codes": [8, 2]}', "input 'codes': [8, 2] does not fit its dims [8, 1]",
                 id="max-dims-fixed"),
    pytest.param("max_dims", '{"tokens": [4]}', "['tokens'] are not config inputs (['codes'])", id="max-dims-not-input"),
    pytest.param("state_spec", '[{"input": "a"}]', "entry 0 must have exactly the keys", id="state-spec-keys"),
    pytest.param("state_spec", json.dumps([{**STATE_SPEC[0], "dtype": "float64"}]),
                 "entry 0 dtype 'float64' is not one of", id="state-dtype"),
    pytest.param("state_spec", "[{", "not valid JSON", id="state-json"),
    pytest.param("intra_op_threads", "x", "not an integer: 'x'", id="threads"),
    pytest.param("intra_op_threads", "-1", "must be >= 0", id="threads-<0"),
    pytest.param("intra_op_spinning", "yes", "must be 'on' or 'off', got 'yes'", id="spinning-word"),
    pytest.param("value_ranges", '{"codes": [5, 5]}',
                 "input 'codes': expected [low, high] with integers low < high, got [5, 5]", id="empty-range"),
    pytest.param("value_ranges", '{"tokens": [0, 10]}', "['tokens'] are not config inputs (['codes'])",
                 id="range-not-input"),
    pytest.param("value_ranges", "[0, 2048]", "must be a JSON object", id="range-not-object"),
]


@pytest.mark.parametrize("name, value, message", BAD_PARAMETERS)
def test_parse_model_config_rejects_a_bad_parameter(name, value, message):
    with pytest.raises(ValueError) as failure:
        ort_config.parse_model_config(config_with(**{name: value}), TRITON_TYPES.__getitem__)
    assert f"parameter '{name}': {message}" in str(failure.value)


@pytest.mark.parametrize(
    "config, message",
    [
        pytest.param({**MODEL_CONFIG, "sequence_batching": {}},
                     "parameter 'sequence_batching.max_sequence_idle_microseconds': missing: set it explicitly",
                     id="no-idle-timeout"),
        pytest.param({**MODEL_CONFIG, "max_batch_size": 0}, "max_batch_size must be > 0", id="no-batching"),
        pytest.param({**MODEL_CONFIG, "sequence_batching": None}, "needs sequence_batching", id="no-sequence-batching"),
        pytest.param({**MODEL_CONFIG, "sequence_batching": {"state": [{"input_name": "a"}]}},
                     "remove sequence_batching.state", id="state-block"),
    ],
)
def test_parse_model_config_rejects(config, message):
    config = {key: value for key, value in config.items() if value is not None}
    with pytest.raises(ValueError) as failure:
        ort_config.parse_model_config(config, TRITON_TYPES.__getitem__)
    assert message in str(failure.value)


def test_check_against_onnx_rejects_mismatched_state(onnx_session):
    spec = [STATE_SPEC[0], {**STATE_SPEC[1], "dtype": "int32"}]
    config = ort_config.parse_model_config(config_with(state_spec=json.dumps(spec)), TRITON_TYPES.__getitem__)
    with pytest.raises(ValueError, match="state input 'state_in_01_count'"):
        ort_config.check_against_onnx(config, onnx_session.get_inputs(), onnx_session.get_outputs())
    renamed = [STATE_SPEC[0], {**STATE_SPEC[1], "input": "state_in_01_other"}]
    config = ort_config.parse_model_config(config_with(state_spec=json.dumps(renamed)), TRITON_TYPES.__getitem__)
    with pytest.raises(ValueError, match="not fed"):
        ort_config.check_against_onnx(config, onnx_session.get_inputs(), onnx_session.get_outputs())


def test_core_carries_resets_and_ends(onnx_session):
    core, _ = make_core(onnx_session)
    reference = Reference()
    for step in range(3):
        codes = codes_for(step)
        (result,) = core.step([request(7, codes, start=step == 0)])
        np.testing.assert_array_equal(result["pcm"], reference.step(codes))
    # START on a live sequence resets it.
    reference = Reference()
    (result,) = core.step([request(7, codes_for(10), start=True)])
    np.testing.assert_array_equal(result["pcm"], reference.step(codes_for(10)))
    # END decodes its step, then drops the state.
    (result,) = core.step([request(7, codes_for(11), end=True)])
    np.testing.assert_array_equal(result["pcm"], reference.step(codes_for(11)))
    assert core.live_streams == 0
    (error,) = core.step([request(7, codes_for(12))])
    assert isinstance(error, ort_core.ModelError) and "START" in str(error) and "sequence 7" in str(error)


def test_core_batches_streams_and_keeps_them_independent(onnx_session):
    core, calls = make_core(onnx_session)
    references = {sid: Reference() for sid in (1, 2, 3)}
    for step in range(4):
        batch = [request(sid, codes_for(100 * sid + step), start=step == 0) for sid in (3, 1, 2)]
        results = core.step(batch)
        for req, result in zip(batch, results):
            np.testing.assert_array_equal(
                result["pcm"], references[req.sequence_id].step(req.inputs["codes"])
            )
    assert [call["codes"] for call in calls] == [(3, 8, 1)] * 4
    assert core.runs_total == 4 and core.rows_total == 12 and list(core.run_sizes) == [3] * 4


def test_core_reuses_previous_run_states_without_copy(onnx_session):
    fed = []
    core, _ = make_core(onnx_session, run_wrapper=lambda feeds: fed.append(feeds["state_in_00_acc"]))
    references = {1: Reference(), 2: Reference()}
    for step, order in enumerate([(1, 2), (2, 1), (1, 2)]):
        batch = [request(sid, codes_for(10 * sid + step), start=step == 0) for sid in order]
        if step == 2:
            previous_output = core._streams[1].rows.arrays[0]
        for req, result in zip(batch, core.step(batch)):
            np.testing.assert_array_equal(
                result["pcm"], references[req.sequence_id].step(req.inputs["codes"])
            )
    # The same two streams again: the previous run's state output is fed back as it is.
    assert fed[2] is previous_output


def test_core_runs_two_steps_of_one_sequence_in_order(onnx_session):
    core, calls = make_core(onnx_session)
    reference = Reference()
    results = core.step(
        [request(5, codes_for(1), start=True), request(6, codes_for(9), start=True),
         request(5, codes_for(2), end=True)]
    )
    np.testing.assert_array_equal(results[0]["pcm"], reference.step(codes_for(1)))
    np.testing.assert_array_equal(results[2]["pcm"], reference.step(codes_for(2)))
    assert [call["codes"][0] for call in calls] == [2, 1]
    assert not has_stream(core, 5) and has_stream(core, 6)


def test_core_bad_request_fails_alone_and_leaves_state(onnx_session):
    core, _ = make_core(onnx_session)
    reference = Reference()
    other = Reference()
    core.step([request(1, codes_for(1), start=True), request(2, codes_for(2), start=True)])
    reference.step(codes_for(1))
    other.step(codes_for(2))
    bad_batch = np.zeros((2, NUM_CODEBOOKS, 1), dtype=np.int32)
    bad_dtype = np.zeros((1, NUM_CODEBOOKS, 1), dtype=np.int64)
    results = core.step(
        [request(1, bad_batch), request(2, codes_for(3)), request(1, bad_dtype)]
    )
    assert "has shape [2, 8, 1], expected [1, 8, 1]" in str(results[0])
    assert "dtype int64" in str(results[2])
    np.testing.assert_array_equal(results[1]["pcm"], other.step(codes_for(3)))
    (result,) = core.step([request(1, codes_for(4))])
    np.testing.assert_array_equal(result["pcm"], reference.step(codes_for(4)))
    # A rejected START on a new sequence creates nothing; a rejected END still ends.
    (error,) = core.step([request(9, bad_batch, start=True)])
    assert isinstance(error, ort_core.ModelError) and not has_stream(core, 9)
    (error,) = core.step([request(1, bad_batch, end=True)])
    assert isinstance(error, ort_core.ModelError) and not has_stream(core, 1)


@pytest.mark.parametrize("sequence_id", [0, "stream-1", None])
def test_core_needs_a_uint64_correlation_id(onnx_session, sequence_id):
    core, calls = make_core(onnx_session)
    (error,) = core.step([request(sequence_id, codes_for(1), start=True)])
    assert isinstance(error, ort_core.ModelError) and error.kind == "correlation_id" and error.code == "INVALID_ARG"
    assert f"send a non-zero uint64 correlation id, got {sequence_id!r}" in str(error)
    assert calls == [] and core.live_streams == 0


def test_core_expires_idle_streams(onnx_session):
    clock = FakeClock()
    core, _ = make_core(onnx_session, clock=clock)
    core.step([request(1, codes_for(1), start=True), request(2, codes_for(2), start=True)])
    clock.now += 1.5
    core.step([request(2, codes_for(3))])
    clock.now += 1.0  # sequence 1 idle 2.5 s > 2 s, sequence 2 idle 1.0 s
    assert core.expire_idle() == 1
    assert not has_stream(core, 1) and has_stream(core, 2)
    (error,) = core.step([request(1, codes_for(4))])
    assert "idle for more than 2 s" in str(error)
    # A stream whose request is in the batch is not expired before it runs, however late it is.
    clock.now += 10.0
    (result,) = core.step([request(2, codes_for(5))])
    assert isinstance(result, dict) and core.expired_total == 1


def test_core_step_failure_ends_the_batch_sequences(onnx_session):
    def fail(feeds):
        raise RuntimeError("boom")

    core, _ = make_core(onnx_session)
    core.step([request(1, codes_for(1), start=True)])
    failing, _ = make_core(onnx_session, run_wrapper=fail)
    failing._streams = core._streams
    (error,) = failing.step([request(1, codes_for(2))])
    assert error.code == "INTERNAL" and error.kind == "decoder"
    assert "boom" in str(error) and "START it again" in str(error)
    assert not has_stream(failing, 1)


# --- served by the real tritonserver --------------------------------------------------------------
DECODER_CONFIG = """\
name: "decoder"
backend: "python"
max_batch_size: 8
# Frames per step (-1 here) are fixed to 1 by the ONNX graph: the model checks that itself.
input [ {{ name: "codes" data_type: TYPE_INT32 dims: [ 8, -1 ] }} ]
output [ {{ name: "pcm" data_type: TYPE_FP32 dims: [ {pcm} ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  oldest {{
    max_candidate_sequences: 64
    preferred_batch_size: [ 8 ]
    max_queue_delay_microseconds: 5000
  }}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
}}
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
parameters {{ key: "state_spec" value: {{ string_value: '{state_spec}' }} }}
parameters {{ key: "onnx_file" value: {{ string_value: "model.onnx" }} }}
parameters {{ key: "intra_op_threads" value: {{ string_value: "1" }} }}
parameters {{ key: "intra_op_spinning" value: {{ string_value: "off" }} }}
parameters {{ key: "value_ranges" value: {{ string_value: '{{"codes": [0, 2048]}}' }} }}
parameters {{ key: "max_dims" value: {{ string_value: '{{"codes": [8, 1]}}' }} }}
parameters {{ key: "max_live_streams" value: {{ string_value: "{max_live_streams}" }} }}
parameters {{ key: "max_rows_per_run" value: {{ string_value: "8" }} }}
"""


def write_repository(repository: Path, state_spec=STATE_SPEC, max_live_streams: int = 64) -> Path:
    """A repository serving the tiny model as `decoder`, laid out as render lays out python-ort."""
    version_dir = repository / "decoder" / "1"
    version_dir.mkdir(parents=True)
    build_step_onnx(version_dir / "model.onnx")
    install_model(version_dir)
    (repository / "decoder" / "config.pbtxt").write_text(DECODER_CONFIG.format(
        pcm=PCM, idle_us=IDLE_TIMEOUT_US, state_spec=json.dumps(state_spec), max_live_streams=max_live_streams))
    return repository


@pytest.fixture(scope="module")
def decoder_server(tmp_path_factory, triton_server_factory):
    repository = write_repository(tmp_path_factory.mktemp("python_ort_repo"))
    return triton_server_factory(repository, log_path=repository / "server.log")


class Client:
    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)

    def step(self, sequence_id, codes, start=False, end=False) -> np.ndarray:
        tensor = self._grpc.InferInput("codes", list(codes.shape), "INT32")
        tensor.set_data_from_numpy(codes)
        result = self.client.infer(
            "decoder", [tensor], sequence_id=sequence_id, sequence_start=start, sequence_end=end
        )
        return result.as_numpy("pcm")

    def close(self):
        self.client.close()


@pytest.fixture
def client(decoder_server):
    c = Client(decoder_server.grpc_url)
    yield c
    c.close()


def server_error(call) -> str:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as failure:
        call()
    return str(failure.value)


def metrics(server) -> dict[str, float]:
    from mimi_code2wav.server.triton import fetch_metrics

    return fetch_metrics(server.metrics_url)


def metric(server, name) -> float | None:
    from mimi_code2wav.server.triton import metric_value

    return metric_value(metrics(server), name, model="decoder")


@pytest.mark.server
def test_served_state_carries_resets_and_ends(client):
    reference = Reference()
    for step in range(3):
        codes = codes_for(step)
        np.testing.assert_array_equal(client.step(11, codes, start=step == 0), reference.step(codes))
    reference = Reference()
    np.testing.assert_array_equal(
        client.step(11, codes_for(5), start=True), reference.step(codes_for(5))
    )
    np.testing.assert_array_equal(client.step(11, codes_for(6), end=True), reference.step(codes_for(6)))
    message = server_error(lambda: client.step(11, codes_for(7)))
    assert "START" in message


@pytest.mark.server
def test_served_start_and_end_in_one_request(client):
    np.testing.assert_array_equal(
        client.step(12, codes_for(1), start=True, end=True), Reference().step(codes_for(1))
    )
    assert "START" in server_error(lambda: client.step(12, codes_for(2)))


@pytest.mark.server
def test_served_unknown_sequence_is_told_to_start(client):
    message = server_error(lambda: client.step(987654, codes_for(1)))
    assert "START" in message


@pytest.mark.server
def test_served_model_reports_sequence_without_state(client):
    # Triton starts the sequence, the model rejects its first request (two frames where the graph
    # takes one), so the model has no state for a sequence that Triton considers live: the model's
    # own error answers.
    two_frames = np.zeros((1, NUM_CODEBOOKS, 2), dtype=np.int32)
    assert "expected [1, 8, 1]" in server_error(lambda: client.step(13, two_frames, start=True))
    message = server_error(lambda: client.step(13, codes_for(1)))
    assert "sequence 13 has no decoder state in model 'decoder'" in message
    assert "START" in message
    client.step(13, codes_for(1), start=True, end=True)


@pytest.mark.server
def test_served_interleaved_sequences_are_independent(client):
    references = {21: Reference(), 22: Reference()}
    order = [21, 22, 22, 21, 21, 22]
    started = set()
    for n, sid in enumerate(order):
        codes = codes_for(sid * 10 + n)
        out = client.step(sid, codes, start=sid not in started)
        started.add(sid)
        np.testing.assert_array_equal(out, references[sid].step(codes))
    for sid in references:
        client.step(sid, codes_for(0), end=True)


@pytest.mark.server
def test_served_bad_request_fails_alone(client):
    reference = Reference()
    other = Reference()
    np.testing.assert_array_equal(
        client.step(31, codes_for(1), start=True), reference.step(codes_for(1))
    )
    np.testing.assert_array_equal(client.step(32, codes_for(2), start=True), other.step(codes_for(2)))
    # Two frames where the graph takes one: rejected by the model, the stream untouched.
    two_frames = np.zeros((1, NUM_CODEBOOKS, 2), dtype=np.int32)
    message = server_error(lambda: client.step(31, two_frames))
    assert "input 'codes' has shape [1, 8, 2], expected [1, 8, 1]" in message
    # Shapes that contradict the config: rejected by Triton before the model.
    seven_codebooks = np.zeros((1, NUM_CODEBOOKS - 1, 1), dtype=np.int32)
    assert "shape" in server_error(lambda: client.step(31, seven_codebooks))
    two_rows = np.concatenate([codes_for(3), codes_for(4)])
    assert "batch-size 1" in server_error(lambda: client.step(31, two_rows))
    # Codes outside the value range the config gives: rejected by the model, the stream untouched.
    too_big = np.full((1, NUM_CODEBOOKS, 1), CODEBOOK_SIZE, dtype=np.int32)
    assert "input 'codes' holds values in [2048, 2048], outside [0, 2048)" in server_error(
        lambda: client.step(31, too_big)
    )
    np.testing.assert_array_equal(client.step(32, codes_for(5)), other.step(codes_for(5)))
    np.testing.assert_array_equal(client.step(31, codes_for(6), end=True), reference.step(codes_for(6)))
    np.testing.assert_array_equal(client.step(32, codes_for(7), end=True), other.step(codes_for(7)))


@pytest.mark.server
def test_served_concurrent_sequences_are_batched(decoder_server):
    before_runs = metric(decoder_server, "mimi_decoder_batches_total") or 0.0
    before_rows = metric(decoder_server, "mimi_decoder_batched_requests_total") or 0.0
    sequences = list(range(41, 49))
    steps = 12
    failures = []
    barrier = threading.Barrier(len(sequences))

    def stream(sid):
        c = Client(decoder_server.grpc_url)
        try:
            reference = Reference()
            barrier.wait()
            for step in range(steps):
                codes = codes_for(sid * 100 + step)
                out = c.step(sid, codes, start=step == 0, end=step == steps - 1)
                np.testing.assert_array_equal(out, reference.step(codes))
        except Exception as exc:  # reported below, with the sequence
            failures.append((sid, exc))
        finally:
            c.close()

    threads = [threading.Thread(target=stream, args=(sid,)) for sid in sequences]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    runs = metric(decoder_server, "mimi_decoder_batches_total") - before_runs
    rows = metric(decoder_server, "mimi_decoder_batched_requests_total") - before_rows
    assert rows == len(sequences) * steps
    assert runs < rows, f"{rows} requests ran in {runs} session runs: no batch had two rows"
    samples = metrics(decoder_server)
    from mimi_code2wav.server.triton import metric_value

    count = metric_value(samples, "mimi_decoder_batch_size_count", model="decoder")
    single = metric_value(samples, "mimi_decoder_batch_size_bucket", model="decoder", le="1")
    assert count is not None and single is not None and count > single


@pytest.mark.server
def test_served_idle_sequences_expire(decoder_server, client):
    client.step(51, codes_for(1), start=True)
    client.step(52, codes_for(2), start=True)
    assert metric(decoder_server, "mimi_decoder_live_streams") >= 2
    expired_before = metric(decoder_server, "mimi_decoder_expired_streams_total") or 0.0
    deadline = time.monotonic() + IDLE_TIMEOUT_US / 1e6 + 5
    while time.monotonic() < deadline and metric(decoder_server, "mimi_decoder_live_streams") != 0:
        time.sleep(0.2)
    assert metric(decoder_server, "mimi_decoder_live_streams") == 0
    assert metric(decoder_server, "mimi_decoder_expired_streams_total") >= expired_before + 2
    assert "START" in server_error(lambda: client.step(51, codes_for(3)))
    reference = Reference()
    np.testing.assert_array_equal(
        client.step(51, codes_for(4), start=True, end=True), reference.step(codes_for(4))
    )


@pytest.mark.server
def test_served_bad_parameter_fails_the_load(tmp_path):
    from mimi_code2wav.server.processes import ServerError
    from mimi_code2wav.server.triton import running_server

    wrong_dtype = [STATE_SPEC[0], {**STATE_SPEC[1], "dtype": "int32"}]
    write_repository(tmp_path / "repo", state_spec=wrong_dtype)
    with pytest.raises(ServerError) as failure:
        with running_server(tmp_path / "repo", log_path=tmp_path / "server.log"):
            pass
    assert "state input 'state_in_01_count': ONNX type tensor(int64), expected int32" in str(
        failure.value
    )


def test_values_out_of_range_fail_their_row_alone(onnx_session):
    """With a value range for an input, a bad row is rejected before the batched run: its batch-mates step."""
    config = ort_config.parse_model_config(config_with(value_ranges='{"codes": [0, 2048]}'), TRITON_TYPES.__getitem__)
    core, _ = make_core(onnx_session, config=config)
    good = np.zeros((1, NUM_CODEBOOKS, 1), np.int32)
    bad = np.full((1, NUM_CODEBOOKS, 1), CODEBOOK_SIZE, np.int32)
    results = core.step([
        ort_core.StepRequest(sequence_id=1, start=True, end=False, inputs={"codes": good}),
        ort_core.StepRequest(sequence_id=2, start=True, end=False, inputs={"codes": bad}),
    ])
    assert isinstance(results[1], ort_core.ModelError) and results[1].kind == "value_range"
    assert "input 'codes' holds values in [2048, 2048], outside [0, 2048) (parameter value_ranges)" in str(results[1])
    assert not isinstance(results[0], ort_core.ModelError) and has_stream(core, 1) and not has_stream(core, 2)


def test_variable_frames_are_bounded_and_rows_of_equal_shape_run_together():
    """With a variable frame dim, a request over `max_dims` fails alone, and steps of different
    frame counts run in separate session runs, each with all the rows of its shape."""
    config = ort_config.parse_model_config(
        {**config_with(max_dims='{"codes": [8, 4]}'),
         "input": [{"name": "codes", "data_type": "TYPE_INT32", "dims": ["8", "-1"]}]},
        TRITON_TYPES.__getitem__,
    )
    runs = []

    def run(feeds):
        rows, frames = feeds["codes"].shape[0], feeds["codes"].shape[2]
        runs.append((rows, frames))
        return [np.full((rows, PCM), frames, np.float32), feeds["state_in_00_acc"] + 1, feeds["state_in_01_count"] + frames]

    core = ort_core.StreamingDecoderCore(config, run, clock=FakeClock(), model_name="decoder")
    frames = {1: 2, 2: 1, 3: 2, 4: 5}
    results = core.step([request(sid, np.zeros((1, NUM_CODEBOOKS, f), np.int32), start=True) for sid, f in frames.items()])
    assert sorted(runs) == [(1, 1), (2, 2)]
    assert [float(results[i]["pcm"][0, 0]) for i in range(3)] == [2.0, 1.0, 2.0]
    assert isinstance(results[3], ort_core.ModelError) and results[3].kind == "shape"
    assert "input 'codes' has shape [1, 8, 5], at most [1, 8, 4] per request (parameter max_dims)" in str(results[3])
    assert not has_stream(core, 4)


def test_streams_left_behind_do_not_keep_a_whole_batch_alive(onnx_session):
    core, _ = make_core(onnx_session)
    codes = np.zeros((1, NUM_CODEBOOKS, 1), np.int32)
    core.step([ort_core.StepRequest(sequence_id=i, start=True, end=False, inputs={"codes": codes}) for i in range(1, 5)])
    # Only stream 1 steps again: streams 2-4 must not share the 4-row arrays any more.
    core.step([ort_core.StepRequest(sequence_id=1, start=False, end=False, inputs={"codes": codes})])
    for sequence_id in (2, 3, 4):
        stream = core._streams[sequence_id]
        assert stream.rows.arrays[0].shape[0] == 1 and stream.row == 0


# --- memory: the stream cap, runs of bounded size, state outside ONNX Runtime's arena ---------------
def test_core_refuses_starts_past_the_cap_and_harms_no_live_stream(onnx_session):
    config = ort_config.parse_model_config(config_with(max_live_streams="2"), TRITON_TYPES.__getitem__)
    core, _ = make_core(onnx_session, config=config)
    references = {1: Reference(), 2: Reference()}
    results = core.step([request(sid, codes_for(sid), start=True) for sid in (1, 2, 3)])
    for sid in (1, 2):
        np.testing.assert_array_equal(results[sid - 1]["pcm"], references[sid].step(codes_for(sid)))
    refused = results[2]
    assert isinstance(refused, ort_core.ModelError)
    assert (refused.kind, refused.code) == ("stream_cap", "UNAVAILABLE")
    assert ("resource exhausted: model 'decoder' already holds 2 live streams, its limit "
            "(max_live_streams=2 per instance); this START was refused and no stream was affected") in str(refused)
    assert not has_stream(core, 3) and core.refused_total == 1
    # The live streams go on; a START on a live stream (a restart) takes no new room.
    for sid in (1, 2):
        (result,) = core.step([request(sid, codes_for(10 + sid))])
        np.testing.assert_array_equal(result["pcm"], references[sid].step(codes_for(10 + sid)))
    references[1] = Reference()
    (result,) = core.step([request(1, codes_for(20), start=True)])
    np.testing.assert_array_equal(result["pcm"], references[1].step(codes_for(20)))
    # Once a stream ends there is room again.
    core.step([request(2, codes_for(21), end=True)])
    (result,) = core.step([request(3, codes_for(22), start=True)])
    assert isinstance(result, dict) and core.live_streams == 2


def test_auto_stream_cap_comes_from_the_available_memory():
    config = ort_config.parse_model_config(
        {**config_with(max_live_streams="auto"), "instance_group": [{"count": 2}],
         "sequence_batching": {**MODEL_CONFIG["sequence_batching"], "oldest": {"max_candidate_sequences": "1000"}}},
        TRITON_TYPES.__getitem__,
    )
    per_stream = 2 * config.state_bytes_per_stream  # 2 x 24 bytes
    kept = ort_memory.state_buffer_limit(config)  # 4 runs of 8 rows: 32 x 24 bytes
    assert kept == 32 * 24
    # Half of it, over 2 instances, less the arrays each may keep.
    cap, reason = ort_memory.auto_stream_cap(config, (48 * per_stream + kept) * 2 * 2)
    assert cap == 48 and "2 instance(s)" in reason
    assert ort_memory.auto_stream_cap(config, (48 * per_stream + kept) * 2 * 2 - 1)[0] == 47
    cap, reason = ort_memory.auto_stream_cap(config, 10**9)
    assert cap == 1000 and reason.startswith("1000 (max_candidate_sequences; memory would allow")
    cap, reason = ort_memory.auto_stream_cap(config, None)
    assert (cap, reason) == (1000, "1000 (max_candidate_sequences; available memory unknown)")


def test_available_memory_is_the_tighter_of_host_and_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert ort_memory.available_memory_bytes(str(meminfo), str(cgroup)) == 20000000 * 1024
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert ort_memory.available_memory_bytes(str(meminfo), str(cgroup)) == 20000000 * 1024
    (cgroup / "memory.max").write_text(f"{2**30}\n")
    assert ort_memory.available_memory_bytes(str(meminfo), str(cgroup)) == 2**30 - 1000
    assert ort_memory.available_memory_bytes(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_batches_run_in_pieces_of_max_rows_per_run(onnx_session):
    config = ort_config.parse_model_config(config_with(max_rows_per_run="2"), TRITON_TYPES.__getitem__)
    core, calls = make_core(onnx_session, config=config)
    references = {sid: Reference() for sid in range(1, 6)}
    for step in range(2):
        batch = [request(sid, codes_for(10 * sid + step), start=step == 0) for sid in range(1, 6)]
        for req, result in zip(batch, core.step(batch)):
            np.testing.assert_array_equal(result["pcm"], references[req.sequence_id].step(req.inputs["codes"]))
    assert [call["codes"][0] for call in calls] == [2, 2, 1, 2, 2, 1]


def test_bound_runner_writes_states_into_arrays_of_its_own(onnx_session):
    config = ort_config.parse_model_config(MODEL_CONFIG, TRITON_TYPES.__getitem__)
    config = ort_config.check_against_onnx(config, onnx_session.get_inputs(), onnx_session.get_outputs())
    runner = ort_memory.BoundRunner(onnx_session, config)
    rng = np.random.default_rng(0)
    feeds = {"codes": rng.integers(0, CODEBOOK_SIZE, (3, NUM_CODEBOOKS, 1), dtype=np.int32),
             "state_in_00_acc": rng.standard_normal((3, ACC)).astype(np.float32),
             "state_in_01_count": np.arange(3, dtype=np.int64).reshape(3, 1)}
    bound = runner(feeds)
    plain = onnx_session.run(["pcm", "state_out_00_acc", "state_out_01_count"], feeds)
    for got, want in zip(bound, plain):
        np.testing.assert_array_equal(got, want)
        assert got.flags.owndata and got.flags.writeable
    # Fed back as the next run's input, as the core does.
    np.testing.assert_array_equal(runner({**feeds, "state_in_00_acc": bound[1]})[1], bound[1] + plain[0][:, -1:])


def bound_core(session, config=None, clock=None, limit_bytes=None):
    """A core as model.py builds it: BoundRunner allocating its state outputs from the core's buffers."""
    config = config or ort_config.parse_model_config(MODEL_CONFIG, TRITON_TYPES.__getitem__)
    config = ort_config.check_against_onnx(config, session.get_inputs(), session.get_outputs())
    buffers = ort_memory.StateBuffers(limit_bytes or ort_memory.state_buffer_limit(config))
    runner = ort_memory.BoundRunner(session, config, allocate=buffers.take)
    core = ort_core.StreamingDecoderCore(config, runner, clock=clock or FakeClock(), buffers=buffers,
                                         release=runner.release)
    return core, buffers


def test_state_buffers_hand_back_what_they_were_given_up_to_their_limit():
    buffers = ort_memory.StateBuffers(limit_bytes=3 * 64)
    first = buffers.take((2, 8), np.float32)  # 64 bytes
    assert first.shape == (2, 8) and buffers.allocated_total == 1
    buffers.give([first])
    assert buffers.take((2, 8), np.float32).base is first.base and buffers.reused_total == 1
    assert buffers.take((2, 8), np.float64).base is not first.base  # another dtype: a new array
    a, b, c, d = (buffers.take((2, 8), np.float32) for _ in range(4))
    buffers.give([a, b, c])
    assert buffers.held_bytes == 3 * 64
    buffers.give([d])  # over the limit: the oldest (a) goes
    assert buffers.held_bytes == 3 * 64
    assert {id(buffers.take((2, 8), np.float32).base) for _ in range(3)} == {id(b.base), id(c.base), id(d.base)}
    # Arrays it did not make are never kept, nor arrays larger than the limit.
    buffers.give([np.empty((2, 8), np.float32), buffers.take((8, 8), np.float32)])
    assert buffers.held_bytes == 0
    buffers.give([a])
    buffers.clear()
    assert buffers.held_bytes == 0 and buffers.take((2, 8), np.float32).base is not a.base


def test_state_buffers_serve_runs_of_any_rows_from_power_of_two_classes():
    buffers = ort_memory.StateBuffers(limit_bytes=1 << 20)
    five = buffers.take((5, 3), np.float32)
    assert five.shape == (5, 3) and five.flags.c_contiguous and five.base.shape == (8, 3)
    buffers.give([five])
    seven = buffers.take((7, 3), np.float32)  # the same 8-row class
    assert seven.base is five.base and buffers.allocated_total == 1
    assert buffers.take((1, 3), np.float32).base.shape == (1, 3)  # one row stays one row
    assert buffers.take((3, 3), np.float32).base.shape == (4, 3)


def test_reused_state_arrays_never_mix_streams(onnx_session):
    """Streams step in changing groups, orders and sizes, start, restart, end and expire, while state
    arrays go round through the buffers: every output still follows from its own stream's codes."""
    clock = FakeClock()
    core, buffers = bound_core(onnx_session, clock=clock)
    rng = np.random.default_rng(7)
    references: dict[int, Reference] = {}
    for step in range(300):
        chosen = [int(sid) for sid in rng.permutation(np.arange(1, 9))[: rng.integers(1, 9)]]
        batch = []
        for sid in chosen:
            start = sid not in references or rng.random() < 0.05
            if start:
                references[sid] = Reference()
            batch.append(request(sid, codes_for(1000 * step + sid), start=start, end=rng.random() < 0.05))
        for req, result in zip(batch, core.step(batch)):
            np.testing.assert_array_equal(result["pcm"], references[req.sequence_id].step(req.inputs["codes"]))
            if req.end:
                del references[req.sequence_id]
        if step % 50 == 49:  # streams idle past the timeout are dropped, their arrays freed
            clock.now += 3.0
            core.expire_idle()
            references.clear()
        assert set(core._streams) == set(references)
    # The arrays did go round, even in this worst case of random groups (a steady group: below).
    assert buffers.reused_total > 5 * buffers.allocated_total
    assert buffers.held_bytes <= ort_memory.state_buffer_limit(core.config)


def test_a_steady_group_of_streams_allocates_no_new_state(onnx_session):
    clock = FakeClock()
    core, buffers = bound_core(onnx_session, clock=clock)
    for step in range(5):
        core.step([request(sid, codes_for(step), start=step == 0) for sid in (1, 2, 3)])
    allocated = buffers.allocated_total
    for step in range(5, 25):
        order = (1, 2, 3) if step % 2 else (3, 2, 1)
        core.step([request(sid, codes_for(step)) for sid in order])
    assert buffers.allocated_total == allocated
    # Once the instance is idle the kept arrays go.
    assert buffers.held_bytes > 0
    clock.now += 1.5
    assert core.release_idle_memory(idle_s=1.0) and buffers.held_bytes == 0


def test_idle_memory_is_released_once_per_idle_period(onnx_session):
    clock = FakeClock()
    released = []
    config = ort_config.parse_model_config(MODEL_CONFIG, TRITON_TYPES.__getitem__)
    config = ort_config.check_against_onnx(config, onnx_session.get_inputs(), onnx_session.get_outputs())
    runner = ort_memory.BoundRunner(onnx_session, config)
    core = ort_core.StreamingDecoderCore(config, runner, clock=clock, release=lambda feeds: released.append(runner(feeds)))
    assert not core.release_idle_memory()  # nothing ran yet
    core.step([request(1, codes_for(1), start=True)])
    clock.now += 0.5
    assert not core.release_idle_memory(idle_s=1.0)  # not idle long enough
    clock.now += 0.6
    assert core.release_idle_memory(idle_s=1.0)
    assert len(released) == 1 and released[0][1].shape == (1, ACC)
    clock.now += 5.0
    assert not core.release_idle_memory(idle_s=1.0)  # once per idle period
    # The throw-away step touched no stream.
    (result,) = core.step([request(1, codes_for(2))])
    np.testing.assert_array_equal(result["pcm"][0, ACC], 2.0)


@pytest.mark.server
def test_served_start_past_the_cap_is_refused_with_unavailable(tmp_path, triton_server_factory):
    """Served with max_live_streams=2 (and 64 Triton slots): the third START is refused with
    UNAVAILABLE naming the cap; the two live sequences go on untouched."""
    from tritonclient.utils import InferenceServerException

    server = triton_server_factory(write_repository(tmp_path / "repo", max_live_streams=2))
    client = Client(server.grpc_url)
    try:
        references = {81: Reference(), 82: Reference()}
        for sid in references:
            np.testing.assert_array_equal(client.step(sid, codes_for(sid), start=True), references[sid].step(codes_for(sid)))
        with pytest.raises(InferenceServerException) as failure:
            client.step(83, codes_for(83), start=True)
        assert failure.value.status() == "StatusCode.UNAVAILABLE"
        assert "resource exhausted: model 'decoder' already holds 2 live streams" in failure.value.message()
        for sid in references:
            np.testing.assert_array_equal(client.step(sid, codes_for(sid + 1), end=True), references[sid].step(codes_for(sid + 1)))
        assert metric(server, "mimi_decoder_refused_streams_total") == 1
    finally:
        client.close()
