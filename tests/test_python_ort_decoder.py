"""The python-ort decoder model: its core directly, then served by the real tritonserver as render lays it out
(parity with moshi: tests/test_serving.py). A tiny ONNX step stands in for Mimi: S = sum(codes); acc' = acc + S;
count' = count + 1; pcm = [acc' x4, count', S], so every output follows from the codes since the START."""

from __future__ import annotations

import json
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS
from mimi_code2wav.export.render import PYTHON_ORT_FILES

from helpers import MODEL_REPOSITORY, FakeClock, load_model_module, metric, raw_input, triton_model_config

MODEL_DIR = MODEL_REPOSITORY / "mimi_decoder" / "python_ort"
COMMON_FILES = sorted((MODEL_REPOSITORY / "common").glob("*.py"))
ort_core = load_model_module(MODEL_DIR / "python_ort_core.py")
ort_config = load_model_module(MODEL_DIR / "python_ort_config.py")

ACC = 4
PCM = ACC + 2
STATE_SPEC = [
    {"input": "state_in_00_acc", "output": "state_out_00_acc", "dtype": "float32", "shape": [ACC]},
    {"input": "state_in_01_count", "output": "state_out_01_count", "dtype": "int64", "shape": [1]},
]
IDLE_TIMEOUT_US = 2_000_000
# ONNX text format; `to = 1` casts to float.
STEP_ONNX = f"""
<ir_version: 8, opset_import: ["" : 17]>
tiny_step (int32[batch, {NUM_CODEBOOKS}, 1] codes, float[batch, {ACC}] state_in_00_acc, int64[batch, 1] state_in_01_count)
    => (float[batch, {PCM}] pcm, float[batch, {ACC}] state_out_00_acc, int64[batch, 1] state_out_01_count)
    <int64[1] codebook_axis = {{1}}, int64[1] one = {{1}}> {{
    codes_f = Cast<to = 1>(codes)
    code_sum = ReduceSum<keepdims = 0>(codes_f, codebook_axis)
    state_out_00_acc = Add(state_in_00_acc, code_sum)
    state_out_01_count = Add(state_in_01_count, one)
    count_f = Cast<to = 1>(state_out_01_count)
    pcm = Concat<axis = 1>(state_out_00_acc, count_f, code_sum)
}}
"""


def build_step_onnx(path: Path) -> Path:
    import onnx
    import onnx.parser

    model = onnx.parser.parse_model(STEP_ONNX)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def count_state(**change) -> str:  # the state_spec parameter with the count state's entry changed
    return json.dumps([STATE_SPEC[0], {**STATE_SPEC[1], **change}])


def codes_for(seed) -> np.ndarray:
    """One frame of codes [1, k, 1] drawn from `seed` (codes given instead pass as they are)."""
    if not isinstance(seed, int):
        return seed
    return np.random.default_rng(seed).integers(0, CODEBOOK_SIZE, size=(1, NUM_CODEBOOKS, 1), dtype=np.int32)


def check_pcm(references: dict, sequence_id, codes, start: bool, pcm) -> None:
    """`pcm` follows `codes` from the sequence's (acc, count) in `references` (reset on START), updated."""
    acc, count = (0.0, 0) if start else references[sequence_id]
    code_sum = float(codes.sum())
    references[sequence_id] = acc + code_sum, count + 1
    np.testing.assert_array_equal(pcm, [[acc + code_sum] * ACC + [count + 1, code_sum]])


def check_error(error, kind: str, code: str, message: str) -> None:
    assert (error.kind, error.code) == (kind, code) and message in str(error), error


# --- the config and the core, without a server ------------------------------------------------------
PARAMETERS = {
    "onnx_file": "model.onnx",
    "intra_op_threads": "1",
    "state_spec": json.dumps(STATE_SPEC),
    "value_ranges": '{"codes": [0, 2048]}',
    "max_dims": '{"codes": [8, 1]}',
    "max_live_streams": "16",
}


def config_with(dims=("8", "-1"), **parameters):
    """The model config of the tiny model, with some parameters replaced (None: removed)."""
    return {
        "name": "decoder",
        "max_batch_size": 8,
        "input": [{"name": "codes", "data_type": "TYPE_INT32", "dims": list(dims)}],
        "output": [{"name": "pcm", "data_type": "TYPE_FP32", "dims": [str(PCM)]}],
        **triton_model_config({**PARAMETERS, **parameters}, str(IDLE_TIMEOUT_US)),
    }


def parse(config):
    return ort_config.parse_model_config(config, {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32}.__getitem__)


@pytest.fixture(scope="module")
def onnx_session(tmp_path_factory):
    import onnxruntime as ort

    path = build_step_onnx(tmp_path_factory.mktemp("onnx") / "model.onnx")
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def make_core(session, config=None, clock=None, log_error=lambda message: None):
    """A core as model.py builds it, running `session`; `core.run_sizes` lists the rows of each run."""
    config = config or parse(config_with())
    ort_config.check_against_onnx(config, session.get_inputs(), session.get_outputs())
    return ort_core.StreamingDecoderCore(config, lambda feeds: session.run(config.output_names, feeds),
                                         clock=clock or FakeClock(), model_name="decoder", log_error=log_error)


def request(sequence_id, codes, start=False, end=False):  # a step of `codes` (or codes_for(seed))
    return ort_core.StepRequest(sequence_id, start, end, {"codes": codes_for(codes)})


def step_all(core, references: dict, batch: list) -> None:
    """core.step(batch), each result checked against its sequence's expected pcm."""
    for req, result in zip(batch, core.step(batch)):
        check_pcm(references, req.sequence_id, req.inputs["codes"], req.start, result["pcm"])


# Each fails the load with its message; a parameter's names it ("parameter '<name>': ..."). None: left out.
BAD_CONFIGS = {
    "no-state-spec": (config_with(state_spec=None), "parameter 'state_spec': missing from the model config's parameters"),
    "no-cap": (config_with(max_live_streams=None), "parameter 'max_live_streams': missing"),
    "unknown": (config_with(codebook_size="2048"), "parameter 'codebook_size': unknown parameter (known: onnx_file, intra_op_threads, state_spec, value_ranges, max_dims, max_live_streams)"),
    "cap-0": (config_with(max_live_streams="0"), "parameter 'max_live_streams': must be >= 1, got 0"),
    "cap-auto": (config_with(max_live_streams="auto"), "parameter 'max_live_streams': not an integer: 'auto'"),
    "threads": (config_with(intra_op_threads="-1"), "parameter 'intra_op_threads': must be >= 0, got -1"),
    "dims-0": (config_with(max_dims='{"codes": [8, 0]}'), "parameter 'max_dims': input 'codes': expected a list of positive integers, got [8, 0]"),
    "dims-fit": (config_with(max_dims='{"codes": [7, 1]}'), "parameter 'max_dims': input 'codes': [7, 1] does not fit its dims [8, -1]"),
    "dims-input": (config_with(max_dims='{"tokens": [4]}'), "parameter 'max_dims': ['tokens'] are not config inputs"),
    "empty-range": (config_with(value_ranges='{"codes": [5, 5]}'), "parameter 'value_ranges': input 'codes': expected [low, high] with integers low < high, got [5, 5]"),
    "range-list": (config_with(value_ranges="[0, 2048]"), "parameter 'value_ranges': must be a JSON object"),
    "state-keys": (config_with(state_spec='[{"input": "a"}]'), "parameter 'state_spec': entry 0 must have exactly the keys"),
    "state-dtype": (config_with(state_spec=count_state(dtype="float64")), "parameter 'state_spec': entry 1 dtype 'float64' is not one of"),
    "state-twice": (config_with(state_spec=json.dumps([STATE_SPEC[0], STATE_SPEC[0]])), "parameter 'state_spec': reuses a tensor name"),
    "state-json": (config_with(state_spec="[{"), "parameter 'state_spec': not valid JSON"),
    "no-sequence-batching": ({k: v for k, v in config_with().items() if k != "sequence_batching"}, "needs sequence_batching"),
    "no-idle": ({**config_with(), "sequence_batching": {}}, "parameter 'sequence_batching.max_sequence_idle_microseconds': missing: set it explicitly"),
    "state-block": ({**config_with(), "sequence_batching": {"state": [{"input_name": "a"}]}}, "remove sequence_batching.state"),
    "no-batching": ({**config_with(), "max_batch_size": 0}, "max_batch_size must be > 0"),
    # Parsed, then refused by the check against the ONNX graph.
    "onnx-state-dtype": (config_with(state_spec=count_state(dtype="int32")), "state input 'state_in_01_count': ONNX type tensor(int64), expected int32"),
    "onnx-state-shape": (config_with(state_spec=count_state(shape=[2])), "state input 'state_in_01_count': ONNX shape ['batch', 1] is not [batch] + [2]"),
    "onnx-names": (config_with(state_spec=count_state(input="state_in_01_other")), "ONNX inputs ['codes', 'state_in_00_acc', 'state_in_01_count'] are not the config's inputs"),
    "onnx-input-dims": (config_with(dims=("7", "-1"), max_dims="{}"), "input 'codes': ONNX shape ['batch', 8, 1] is not [batch] + [7, -1]"),
}


@pytest.mark.parametrize("config, message", list(BAD_CONFIGS.values()), ids=list(BAD_CONFIGS))
def test_a_bad_config_fails_the_load_naming_what_is_wrong(onnx_session, config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ort_config.check_against_onnx(parse(config), onnx_session.get_inputs(), onnx_session.get_outputs())


def test_core_runs_a_sequence_s_steps_in_order_and_ends(onnx_session):
    """Two steps of one sequence in one batch: two runs, in order; END decodes its step, then drops the state."""
    core = make_core(onnx_session)
    step_all(core, {}, [request(5, 1, start=True), request(6, 9, start=True), request(5, 2, end=True)])
    assert list(core.run_sizes) == [2, 1] and set(core._streams) == {6} and core.live_streams == 1


def test_streams_stepping_in_changing_groups_are_batched_and_never_mix(onnx_session):
    """However streams group, start, end and expire, every output follows from its own stream's codes."""
    clock = FakeClock()
    core = make_core(onnx_session, clock=clock)
    rng = np.random.default_rng(7)
    references = {}
    for step in range(200):
        sids = [int(sid) for sid in rng.permutation(np.arange(1, 9))[: rng.integers(1, 9)]]
        batch = [request(sid, 1000 * step + sid, start=sid not in references or rng.random() < 0.05,
                         end=rng.random() < 0.05) for sid in sids]
        step_all(core, references, batch)
        assert (core.runs_total, core.run_sizes[-1]) == (step + 1, len(batch))  # each batch is one run
        for req in batch:
            if req.end:
                del references[req.sequence_id]
        if step % 50 == 49:  # every stream idles past the timeout
            clock.now += 3.0
            core.expire_idle()
            references.clear()
        assert set(core._streams) == set(references)
    assert core.rows_total == sum(core.run_sizes)


# What the core rejects per request, past Triton's own checks of dtypes and dims against the config.
BAD_CODES = {
    "range": (np.full((1, NUM_CODEBOOKS, 1), CODEBOOK_SIZE, np.int32), "value_range", "input 'codes' holds values in [2048, 2048], outside [0, 2048) (parameter value_ranges)"),
    "max-dims": (np.zeros((1, NUM_CODEBOOKS, 2), np.int32), "shape", "input 'codes' has shape [1, 8, 2], at most [1, 8, 1] per request (parameter max_dims)"),
}


@pytest.mark.parametrize("codes, kind, message", list(BAD_CODES.values()), ids=list(BAD_CODES))
def test_a_bad_request_fails_alone_and_changes_nothing(onnx_session, codes, kind, message):
    core = make_core(onnx_session)
    references = {}
    step_all(core, references, [request(sid, sid, start=True) for sid in (1, 2)])
    error, other = core.step([request(1, codes), request(2, 3)])
    check_error(error, kind, "INVALID_ARG", message)
    check_pcm(references, 2, codes_for(3), False, other["pcm"])
    step_all(core, references, [request(1, 4)])  # stream 1 untouched
    # A rejected START on a new sequence creates nothing; a rejected END still ends its sequence.
    new, ending = core.step([request(9, codes, start=True), request(1, codes, end=True)])
    assert new.kind == ending.kind == kind and set(core._streams) == {2}
    assert list(core.run_sizes) == [2, 1, 1]


@pytest.mark.parametrize("sequence_id", [0, "stream-1", None])
def test_core_needs_a_uint64_correlation_id(onnx_session, sequence_id):
    core = make_core(onnx_session)
    (error,) = core.step([request(sequence_id, 1, start=True)])
    check_error(error, "correlation_id", "INVALID_ARG", f"send a non-zero uint64 correlation id, got {sequence_id!r}")
    assert core.runs_total == core.live_streams == 0


def test_steps_of_different_frame_counts_run_apart():
    runs = []

    def run(feeds):
        rows, _, frames = feeds["codes"].shape
        runs.append((rows, frames))
        return [np.full((rows, PCM), frames, np.float32), feeds["state_in_00_acc"] + 1, feeds["state_in_01_count"] + 1]

    core = ort_core.StreamingDecoderCore(parse(config_with(max_dims='{"codes": [8, 4]}')), run, clock=FakeClock())
    frames = {1: 2, 2: 1, 3: 2}
    results = core.step([request(sid, np.zeros((1, NUM_CODEBOOKS, f), np.int32), start=True) for sid, f in frames.items()])
    assert sorted(runs) == [(1, 1), (2, 2)] and [float(result["pcm"][0, 0]) for result in results] == [2.0, 1.0, 2.0]


def test_core_expires_idle_streams(onnx_session):
    clock = FakeClock()
    core = make_core(onnx_session, clock=clock)
    core.step([request(1, 1, start=True), request(2, 2, start=True)])
    clock.now += 1.5
    core.step([request(2, 3)])
    clock.now += 1.0  # sequence 1 idle 2.5 s > 2 s, sequence 2 idle 1.0 s
    assert core.expire_idle() == 1 and set(core._streams) == {2}
    (error,) = core.step([request(1, 4)])  # as after an END, or with no START
    check_error(error, "unknown_sequence", "INVALID_ARG", "sequence 1 has no decoder state in model 'decoder': send its "
                "first request with the START flag (it was never started, has ended, or was idle for more than 2 s)")
    # A stream whose request is in the batch is not expired before it runs, however late it is.
    clock.now += 10.0
    (result,) = core.step([request(2, 5)])
    assert isinstance(result, dict) and core.expired_total == 1


def test_core_step_failure_ends_the_batch_sequences(onnx_session):
    logged = []
    core = make_core(onnx_session, log_error=logged.append)
    core.step([request(1, 1, start=True), request(2, 2, start=True)])

    def fail(feeds):
        raise RuntimeError("boom")

    core._run = fail
    for error in core.step([request(1, 3), request(2, 4)]):
        check_error(error, "decoder", "INTERNAL",
                    "decoder step failed (RuntimeError: boom); the sequence was ended, START it again")
    assert core.live_streams == 0 and "batched step of 2 rows failed" in logged[0] and "boom" in logged[0]


def test_core_refuses_starts_past_the_cap_and_harms_no_live_stream(onnx_session):
    core = make_core(onnx_session, config=parse(config_with(max_live_streams="2")))
    references = {}
    *results, refused = core.step([request(sid, sid, start=True) for sid in (1, 2, 3)])
    for sid, result in zip((1, 2), results):
        check_pcm(references, sid, codes_for(sid), True, result["pcm"])
    check_error(refused, "stream_cap", "UNAVAILABLE", "resource exhausted: model 'decoder' already holds 2 live streams, its "
                "limit (max_live_streams=2 per instance); this START was refused and no stream was affected")
    assert set(core._streams) == {1, 2} and core.refused_total == 1 and list(core.run_sizes) == [2]
    # The live streams go on; a START on a live stream (a restart) takes no new room, nor does START+END.
    for batch in ([request(1, 11)], [request(2, 12)], [request(1, 20, start=True)], [request(4, 4, start=True, end=True)]):
        step_all(core, references, batch)
    # Once a stream ends there is room again.
    core.step([request(2, 21, end=True)])
    (result,) = core.step([request(3, 22, start=True)])
    assert isinstance(result, dict) and core.live_streams == 2 and core.refused_total == 1


# --- served by the real tritonserver --------------------------------------------------------------
DECODER_CONFIG = """\
name: "decoder"
backend: "python"
max_batch_size: 8
# Frames per step (-1 here) are fixed to 1 by the ONNX graph: max_dims bounds them.
input [ {{ name: "codes" data_type: TYPE_INT32 dims: [ 8, -1 ] }} ]
output [ {{ name: "pcm" data_type: TYPE_FP32 dims: [ {pcm} ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  oldest {{ max_candidate_sequences: 64 preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 5000 }}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
}}
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""


def write_repository(repository: Path, **parameters: str) -> Path:
    """The tiny model served as `decoder` (PARAMETERS, 64 live streams, `parameters` replaced), as render lays it out."""
    version_dir = repository / "decoder" / "1"
    version_dir.mkdir(parents=True)
    build_step_onnx(version_dir / "model.onnx")
    for source in (*(MODEL_DIR / name for name in PYTHON_ORT_FILES), *COMMON_FILES):
        shutil.copyfile(source, version_dir / source.name)
    parameters = {**PARAMETERS, "max_live_streams": "64", **parameters}
    (repository / "decoder" / "config.pbtxt").write_text(DECODER_CONFIG.format(pcm=PCM, idle_us=IDLE_TIMEOUT_US) + "".join(
        f"parameters {{ key: \"{key}\" value: {{ string_value: '{value}' }} }}\n" for key, value in parameters.items()))
    return repository


@pytest.fixture(scope="module")
def decoder_server(tmp_path_factory, triton_server_factory):
    repository = write_repository(tmp_path_factory.mktemp("python_ort_repo"))
    return triton_server_factory(repository, log_path=repository / "server.log")


class Client:
    """Steps of the served `decoder`; `check` compares each answer with its sequence's expected pcm."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.grpc, self.references = grpcclient.InferenceServerClient(url), {}

    def step(self, sequence_id, codes, start=False, end=False) -> np.ndarray:
        inputs = [raw_input("codes", codes_for(codes), "INT32")]
        return self.grpc.infer("decoder", inputs, sequence_id=sequence_id, sequence_start=start, sequence_end=end).as_numpy("pcm")

    def check(self, sequence_id, seed: int, start=False, end=False) -> None:
        check_pcm(self.references, sequence_id, codes_for(seed), start, self.step(sequence_id, seed, start, end))

    def error(self, sequence_id, codes, start=False):
        from tritonclient.utils import InferenceServerException

        with pytest.raises(InferenceServerException) as failure:
            self.step(sequence_id, codes, start)
        return failure.value

    def close(self):
        self.grpc.close()


@pytest.fixture
def client(decoder_server):
    with closing(Client(decoder_server.grpc_url)) as c:
        yield c


def decoder_metric(server, name, **labels) -> float:
    return metric(server, name, model="decoder", **labels)


@pytest.mark.server
def test_served_bad_request_fails_alone_and_state_carries_resets_and_ends(client):
    client.check(31, 1, start=True)
    client.check(32, 2, start=True)
    for codes, _, message in BAD_CODES.values():  # rejected by the model, the stream untouched
        error = client.error(31, codes)
        assert error.status() == "StatusCode.INVALID_ARGUMENT" and message in error.message()
    # Shapes that contradict the config: rejected by Triton before the model.
    assert "shape" in client.error(31, np.zeros((1, NUM_CODEBOOKS - 1, 1), np.int32)).message()
    assert "batch-size 1" in client.error(31, np.concatenate([codes_for(3), codes_for(4)])).message()
    client.check(31, 3)
    client.check(31, 4, start=True)  # a START on a live sequence starts it afresh
    for sid in (31, 32):
        client.check(sid, sid + 5, end=True)
        assert "START" in client.error(sid, 7).message()
    # A START the model rejects leaves no state, though Triton holds the sequence: the model's own error answers.
    assert "at most [1, 8, 1]" in client.error(33, BAD_CODES["max-dims"][0], start=True).message()
    assert "sequence 33 has no decoder state in model 'decoder'" in client.error(33, 1).message()
    client.check(33, 1, start=True, end=True)  # START and END in one request
    assert "START" in client.error(987654, 1).message()  # never started: Triton answers that one itself


@pytest.mark.server
def test_served_concurrent_sequences_are_batched(decoder_server):
    counters = ("mimi_decoder_batches_total", "mimi_decoder_batched_requests_total")
    before = [decoder_metric(decoder_server, name) for name in counters]
    sequences, steps = list(range(41, 49)), 12
    barrier = threading.Barrier(len(sequences), timeout=120)

    def stream(sid):
        with closing(Client(decoder_server.grpc_url)) as c:
            barrier.wait()
            for step in range(steps):
                c.check(sid, sid * 100 + step, start=step == 0, end=step == steps - 1)

    with ThreadPoolExecutor(len(sequences)) as pool:
        list(pool.map(stream, sequences))  # raises a sequence's failure
    runs, rows = (decoder_metric(decoder_server, name) - old for name, old in zip(counters, before))
    assert rows == len(sequences) * steps
    assert runs < rows, f"{rows} requests ran in {runs} session runs: no batch had two rows"
    count = decoder_metric(decoder_server, "mimi_decoder_batch_size_count")
    single = decoder_metric(decoder_server, "mimi_decoder_batch_size_bucket", le="1")
    assert count == decoder_metric(decoder_server, counters[0]) and count > single


@pytest.mark.server
def test_served_bad_parameter_fails_the_load(tmp_path):
    from mimi_code2wav.server.processes import ServerError
    from mimi_code2wav.server.supervise import running_server

    write_repository(tmp_path / "repo", state_spec=count_state(dtype="int32"))
    with pytest.raises(ServerError, match=re.escape(BAD_CONFIGS["onnx-state-dtype"][1])):
        with running_server(tmp_path / "repo", log_path=tmp_path / "server.log"):
            pass


@pytest.mark.server
def test_served_start_past_the_cap_is_refused_with_unavailable(tmp_path, triton_server_factory):
    # Triton holds 64 sequence slots: the model's cap of 2 refuses the third START, not Triton.
    server = triton_server_factory(write_repository(tmp_path / "repo", max_live_streams="2"))
    with closing(Client(server.grpc_url)) as client:
        for sid in (81, 82):
            client.check(sid, sid, start=True)
        refused = client.error(83, 83, start=True)
        assert refused.status() == "StatusCode.UNAVAILABLE"
        assert "resource exhausted: model 'decoder' already holds 2 live streams" in refused.message()
        for sid in (81, 82):
            client.check(sid, sid + 1, end=True)
    assert decoder_metric(server, "mimi_decoder_refused_streams_total") == 1
