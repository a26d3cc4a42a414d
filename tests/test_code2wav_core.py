"""Unit tests of model_repository/code2wav/1/code2wav_core.py (no server).

A fake decoder stands in for mimi_decoder: it records every step (stream, codes, flags) and returns
PCM whose samples encode the frame they came from, so the tests can check exactly which frames were
decoded, in which order, with which flags, and where their audio landed in the output.
"""

import asyncio

import numpy as np
import pytest

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS, SAMPLES_PER_FRAME
from mimi_code2wav.export.render import idle_timeout_us

from helpers import MODEL_REPOSITORY, FakeClock, load_model_module, triton_model_config

MODEL_DIR = MODEL_REPOSITORY / "code2wav" / "1"
CONFIG_PATH = MODEL_REPOSITORY / "code2wav" / "config.pbtxt"

# Each name from the file that defines it (the sibling files import one another by module name).
core = load_model_module(MODEL_DIR / "code2wav_core.py")
code2wav_settings = load_model_module(MODEL_DIR / "code2wav_settings.py")
code2wav_plan = load_model_module(MODEL_DIR / "code2wav_plan.py")
code2wav_replay = load_model_module(MODEL_DIR / "code2wav_replay.py")
code2wav_stream = load_model_module(MODEL_DIR / "code2wav_stream.py")
model_errors = load_model_module(MODEL_REPOSITORY / "common" / "model_errors.py")

START = code2wav_settings.FLAG_SEQUENCE_START
END = code2wav_settings.FLAG_SEQUENCE_END
StreamRequest = code2wav_plan.StreamRequest
DecoderError = code2wav_settings.DecoderError
RequestError = code2wav_settings.RequestError
StreamCapError = code2wav_settings.StreamCapError
SAMPLES = 4  # samples per frame in most tests: small, so outputs are easy to read


# --------------------------------------------------------------------------------------------------
# helpers


def make_codes(frames, seed=0, codebook_size=CODEBOOK_SIZE):
    """Random codes [NUM_CODEBOOKS, frames] whose frames are all distinct (codebook 0 holds the frame index).
    Drawn frame by frame, so make_codes(n, seed) is a prefix of make_codes(n + m, seed)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, codebook_size, size=(frames, NUM_CODEBOOKS), dtype=np.int64).T.copy()
    codes[0] = (np.arange(frames) + 7 * seed) % codebook_size
    return codes


def flat(codes):
    """codes [NUM_CODEBOOKS, F] -> input_ids INT64 [1, NUM_CODEBOOKS*F], codebook-major."""
    return np.ascontiguousarray(codes, dtype=np.int64).reshape(1, -1)


def offset(value):
    return np.array([[value]], dtype=np.int64)


def frame_signature(codes):
    """One float per frame of codes [NUM_CODEBOOKS, F], identifying it (the fake decoder's PCM value)."""
    codes = np.asarray(codes, dtype=np.float64)
    return (codes[0] + codes[1] / 4096.0 + codes[2] / 4096.0**2).astype(np.float32)


def expected_pcm(codes, samples_per_frame=SAMPLES):
    return np.repeat(frame_signature(codes), samples_per_frame)[None, :]


class FakeDecoder:
    """Async stand-in for the BLS helper: records steps, returns PCM [1, samples * S]."""

    def __init__(self, samples_per_frame=SAMPLES, fail_on_call=None, wrong_size_on_call=None):
        self.samples_per_frame = samples_per_frame
        self.fail_on_call = fail_on_call
        self.wrong_size_on_call = wrong_size_on_call
        self.calls = []  # (correlation_id, codes int32 [1, NUM_CODEBOOKS, S], flags)
        self.events = []  # ("begin"/"end", correlation_id) in execution order
        self.in_flight = 0
        self.max_in_flight = 0

    async def __call__(self, correlation_id, codes, flags):
        assert codes.dtype == np.int32 and codes.ndim == 3 and codes.shape[:2] == (1, NUM_CODEBOOKS)
        assert codes.flags.c_contiguous
        self.calls.append((correlation_id, codes.copy(), flags))
        call_number = len(self.calls)
        self.events.append(("begin", correlation_id))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # let other streams' steps start
            if call_number == self.fail_on_call:
                raise DecoderError("simulated decoder failure")
            pcm = np.repeat(frame_signature(codes[0]), self.samples_per_frame)[None, :]
            if call_number == self.wrong_size_on_call:
                pcm = pcm[:, :-1]
            return pcm
        finally:
            self.in_flight -= 1
            self.events.append(("end", correlation_id))

    def flags(self):
        return [flags for _, _, flags in self.calls]

    def decoded_codes(self, correlation_id=None):
        """The codes of every non-discarded step, concatenated: [NUM_CODEBOOKS, frames]."""
        chunks = [
            codes[0]
            for cid, codes, flags in self.calls
            if correlation_id is None or cid == correlation_id
        ]
        return np.concatenate(chunks, axis=1) if chunks else np.zeros((NUM_CODEBOOKS, 0), np.int32)


def make_table(clock=None, **overrides):
    # One frame per decoder call unless a test says otherwise: the step-by-step tests below read
    # flags and failures per frame; the multi-frame tests set decoder_max_frames_per_step.
    settings = dict(samples_per_frame=SAMPLES, decoder_max_frames_per_step=1)
    settings.update(overrides)
    if clock is None:
        return core.StreamTable(code2wav_settings.Code2WavSettings(**settings))
    return core.StreamTable(code2wav_settings.Code2WavSettings(**settings), clock=clock)


def is_live(table, correlation_id):
    """Whether the table holds the stream (no public reader: streams are the table's alone)."""
    return correlation_id in table._streams


def decoded_of(table, correlation_id):
    """The decoded codes [k, frames] of a live stream (read-only view), from its base on."""
    return table._streams[correlation_id].decoded.codes()


def base_of(table, correlation_id):
    """Stream index of a live stream's first held frame: 0, or where it was resumed."""
    return table._streams[correlation_id].base


def plan_of(table, correlation_id, flags, input_ids, frame_offset=None, history_frames=None):
    """What decoding one request takes against the table's stream (`code2wav_plan`); changes nothing."""
    entry = table._streams.get(correlation_id)
    request = StreamRequest(correlation_id, flags, input_ids, frame_offset, history_frames)
    return code2wav_plan.plan_request(table.settings, entry, request)


async def process_batch(table, requests, decode_step):
    """One batch through `submit_batch`, waited for: per request, its PCM or the exception it failed with."""
    return list(await asyncio.gather(*table.submit_batch(requests, decode_step)))


def requests_in_flight(table):
    """Streams with a request submitted and not yet finished (the table's queue; no public reader)."""
    return len(table._queued)


def send(table, decoder, correlation_id, flags, codes=None, frame_offset=None, input_ids=None, history_frames=None):
    """Process one request; returns its PCM (or raises its error)."""
    if input_ids is None:
        input_ids = flat(codes if codes is not None else np.zeros((NUM_CODEBOOKS, 0), np.int64))
    request = StreamRequest(
        correlation_id=correlation_id,
        flags=flags,
        input_ids=input_ids,
        frame_offset=None if frame_offset is None else offset(frame_offset),
        history_frames=None if history_frames is None else offset(history_frames),
    )
    return asyncio.run(table.process(request, decoder))


def send_error(table, decoder, correlation_id, flags, codes=None, frame_offset=None, input_ids=None,
               error=RequestError, history_frames=None):
    with pytest.raises(error) as info:
        send(table, decoder, correlation_id, flags, codes, frame_offset, input_ids, history_frames)
    return info.value


def open_stream(table, decoder, correlation_id, codes):
    """START a stream with `codes` decoded."""
    send(table, decoder, correlation_id, START, codes, frame_offset=0)
    np.testing.assert_array_equal(decoded_of(table, correlation_id), codes)


# --------------------------------------------------------------------------------------------------
# settings and config


def test_shipped_config_parses_to_the_default_settings():
    text_format = pytest.importorskip("google.protobuf.text_format", reason="needs protobuf (tritonclient[grpc])")
    model_config_pb2 = pytest.importorskip(
        "tritonclient.grpc.model_config_pb2", reason="needs tritonclient[grpc]"
    )
    json_format = pytest.importorskip("google.protobuf.json_format")
    config = text_format.Parse(CONFIG_PATH.read_text(), model_config_pb2.ModelConfig())
    assert set(config.parameters) == set(code2wav_settings.PARAMETER_TYPES)
    # The JSON form Triton hands to initialize (uint64 fields as strings).
    settings = code2wav_settings.settings_from_config(
        json_format.MessageToDict(config, preserving_proto_field_name=True)
    )
    assert settings == code2wav_settings.Code2WavSettings()
    assert settings.stream_idle_timeout_s == idle_timeout_us(CONFIG_PATH) / 1e6
    assert config.max_batch_size > 0
    assert config.sequence_batching.WhichOneof("strategy_choice") == "oldest"
    controls = {c.name: c.control[0] for c in config.sequence_batching.control_input}
    assert set(controls) == {"START", "END", "READY", "CORRID"}
    assert controls["CORRID"].data_type == model_config_pb2.TYPE_UINT64
    tensors = {t.name: t for t in list(config.input) + list(config.output)}
    assert tensors["input_ids"].data_type == model_config_pb2.TYPE_INT64
    assert list(tensors["input_ids"].dims) == [-1]
    assert tensors["frame_offset"].optional and list(tensors["frame_offset"].dims) == [1]
    assert tensors["history_frames"].optional and list(tensors["history_frames"].dims) == [1]
    assert tensors["history_frames"].data_type == model_config_pb2.TYPE_INT64
    assert tensors["model_outputs"].data_type == model_config_pb2.TYPE_FP32
    assert tensors["sr"].data_type == model_config_pb2.TYPE_INT32


def model_config(idle_us=30_000_000, **changes):
    """A model config as Triton hands it to initialize, with the default settings; a change of None
    removes that parameter."""
    settings = code2wav_settings.Code2WavSettings()
    parameters = {name: str(getattr(settings, name)) for name in code2wav_settings.PARAMETER_TYPES}
    return triton_model_config({**parameters, **changes}, idle_us)


def test_parameters_are_parsed_from_strings():
    config = model_config(idle_us="5000000", decoder_model_name="other_decoder", dedupe_mode="delta")
    settings = code2wav_settings.settings_from_config(config)  # the idle timeout in the JSON form of a uint64
    assert settings.decoder_model_name == "other_decoder"
    assert settings.dedupe_mode == "delta"
    assert settings.stream_idle_timeout_s == 5.0


@pytest.mark.parametrize(
    "change, idle_us, parameter, message",
    [
        pytest.param({"num_codebooks": None}, 30_000_000, "num_codebooks", "missing", id="missing"),
        pytest.param({"dedupe_mod": "auto"}, 30_000_000, "dedupe_mod", "unknown parameter", id="unknown"),
        pytest.param({"codebook_size": "2k"}, 30_000_000, "codebook_size", "not an integer: '2k'", id="not-int"),
        pytest.param({"samples_per_frame": "0"}, 30_000_000, "samples_per_frame", "positive integer", id="zero"),
        pytest.param({"max_request_frames": "-1"}, 30_000_000, "max_request_frames", "positive integer",
                     id="negative"),
        pytest.param({"decoder_frames_per_step": "1"}, 30_000_000, "decoder_frames_per_step",
                     "unknown parameter (known: decoder_model_name, num_codebooks", id="removed"),
        pytest.param({"dedupe_mode": "both"}, 30_000_000, "dedupe_mode", "auto, delta, cumulative", id="mode"),
        pytest.param({"decoder_model_name": " "}, 30_000_000, "decoder_model_name", "non-empty", id="name"),
        pytest.param({}, None, model_errors.IDLE_TIMEOUT_FIELD, "missing", id="idle-missing"),
        pytest.param({}, 0, model_errors.IDLE_TIMEOUT_FIELD, "must be positive", id="idle-zero"),
        pytest.param({}, "soon", model_errors.IDLE_TIMEOUT_FIELD, "not an integer", id="idle-not-int"),
    ],
)
def test_bad_parameters_fail_naming_the_parameter(change, idle_us, parameter, message):
    with pytest.raises(model_errors.ConfigError) as info:
        code2wav_settings.settings_from_config(model_config(idle_us, **change))
    assert info.value.parameter == parameter
    assert f"'{parameter}'" in str(info.value)
    assert message in str(info.value)


# --------------------------------------------------------------------------------------------------
# unflatten and validation


def test_unflatten_is_codebook_major():
    frames = 5
    input_ids = np.arange(NUM_CODEBOOKS * frames, dtype=np.int64).reshape(1, -1)
    codes = code2wav_plan.unflatten_codes(input_ids, NUM_CODEBOOKS)
    assert codes.shape == (NUM_CODEBOOKS, frames)
    # All F codes of codebook 0 first, then codebook 1, ...
    assert codes[0].tolist() == [0, 1, 2, 3, 4]
    assert codes[1].tolist() == [5, 6, 7, 8, 9]
    assert codes[:, 2].tolist() == [2 + frames * c for c in range(NUM_CODEBOOKS)]


def test_decoder_receives_each_frame_across_codebooks():
    table, decoder = make_table(), FakeDecoder()
    frames = 3
    send(table, decoder, 1, START, input_ids=np.arange(NUM_CODEBOOKS * frames, dtype=np.int64).reshape(1, -1))
    assert [codes[0, :, 0].tolist() for _, codes, _ in decoder.calls] == [
        [f + frames * c for c in range(NUM_CODEBOOKS)] for f in range(frames)
    ]


@pytest.mark.parametrize(
    "input_ids, kind, fragments",
    [
        pytest.param(np.zeros((1, 16), np.float32), "dtype", ["INT64", "float32"], id="float"),
        pytest.param(np.zeros((1, 16), np.int32), "dtype", ["INT64", "int32"], id="int32"),
        pytest.param(np.zeros((1, 13), np.int64), "length", ["13 codes", "num_codebooks=8"], id="length"),
        pytest.param(np.zeros((2, 8), np.int64), "shape", ["[1, k*F]", "[2, 8]"], id="batch-2"),
    ],
)
def test_malformed_input_ids_are_rejected(input_ids, kind, fragments):
    table, decoder = make_table(), FakeDecoder()
    error = send_error(table, decoder, 1, START, input_ids=input_ids)
    assert error.kind == kind
    for fragment in fragments:
        assert fragment in str(error)
    assert decoder.calls == [] and not is_live(table, 1)


@pytest.mark.parametrize(
    "codebook, frame, value",
    [
        pytest.param(0, 0, -1, id="negative"),
        pytest.param(3, 2, CODEBOOK_SIZE, id="codebook-size"),
        pytest.param(7, 4, 99999, id="large"),
    ],
)
def test_out_of_range_code_is_named_with_its_position(codebook, frame, value):
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(5)
    codes[codebook, frame] = value
    error = send_error(table, decoder, 1, START, codes)
    assert error.kind == "code_range"
    position = codebook * 5 + frame
    assert f"input_ids[{position}] = {value}" in str(error)
    assert f"codebook {codebook}, frame {frame}" in str(error)
    assert "[0, 2048)" in str(error)
    assert decoder.calls == []


def test_frame_offset_dtype_and_shape_are_checked():
    table, decoder = make_table(), FakeDecoder()
    request = StreamRequest(1, START, flat(make_codes(2)), np.array([[0.0]], np.float32))
    with pytest.raises(RequestError, match="frame_offset must be INT64, got float32"):
        asyncio.run(table.process(request, decoder))
    request = StreamRequest(1, START, flat(make_codes(2)), np.array([[0, 1]], np.int64))
    with pytest.raises(RequestError, match=r"one value \(\[1, 1\]\), got shape \[1, 2\]"):
        asyncio.run(table.process(request, decoder))
    assert decoder.calls == [] and not is_live(table, 1)


@pytest.mark.parametrize("correlation_id", [0, -3, "abc"])
def test_requests_need_a_positive_correlation_id(correlation_id):
    table, decoder = make_table(), FakeDecoder()
    error = send_error(table, decoder, correlation_id, START, make_codes(1))
    assert error.kind == "correlation_id"
    assert repr(correlation_id) in str(error)


# --------------------------------------------------------------------------------------------------
# dedupe with frame_offset


def test_identical_retry_decodes_nothing():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(5)
    first = send(table, decoder, 1, START, codes, frame_offset=0)
    np.testing.assert_array_equal(first, expected_pcm(codes))
    calls = len(decoder.calls)
    retry = send(table, decoder, 1, 0, codes, frame_offset=0)
    assert retry.shape == (1, 0) and retry.dtype == np.float32
    assert len(decoder.calls) == calls
    np.testing.assert_array_equal(decoded_of(table, 1), codes)


def test_partial_overlap_decodes_only_the_new_frames():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(9)
    open_stream(table, decoder, 1, codes[:, :5])
    decoder.calls.clear()
    pcm = send(table, decoder, 1, 0, codes[:, 3:], frame_offset=3)
    np.testing.assert_array_equal(pcm, expected_pcm(codes[:, 5:]))
    np.testing.assert_array_equal(decoder.decoded_codes(), codes[:, 5:])
    np.testing.assert_array_equal(decoded_of(table, 1), codes)


def test_identical_consecutive_frames_sent_as_deltas_with_offsets_are_all_decoded():
    table, decoder = make_table(), FakeDecoder()
    silence = np.full((NUM_CODEBOOKS, 3), 11, np.int64)
    send(table, decoder, 1, START, silence, frame_offset=0)
    pcm = send(table, decoder, 1, 0, silence, frame_offset=3)
    assert pcm.shape == (1, 3 * SAMPLES)
    assert len(decoder.calls) == 6
    assert decoded_of(table, 1).shape == (NUM_CODEBOOKS, 6)


def test_offset_past_the_decoded_frames_is_a_gap():
    table, decoder = make_table(), FakeDecoder()
    open_stream(table, decoder, 1, make_codes(5))
    error = send_error(table, decoder, 1, 0, make_codes(2), frame_offset=6)
    assert error.kind == "gap"
    assert "frame_offset 6 leaves a gap" in str(error)
    assert "has decoded 5 frames" in str(error)
    assert "at most 5" in str(error)


def test_a_start_request_must_begin_at_frame_zero():
    table, decoder = make_table(), FakeDecoder()
    error = send_error(table, decoder, 1, START, make_codes(2), frame_offset=1)
    assert error.kind == "gap" and "has decoded 0 frames" in str(error)
    assert not is_live(table, 1)


def test_changed_frame_is_named():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(6)
    open_stream(table, decoder, 1, codes[:, :5])
    resend = codes[:, 2:].copy()
    resend[4, 1] = (resend[4, 1] + 1) % CODEBOOK_SIZE  # frame 3 of the stream
    error = send_error(table, decoder, 1, 0, resend, frame_offset=2)
    assert error.kind == "changed_frame"
    assert "frame 3 differs" in str(error)


def test_negative_offset_is_rejected():
    table, decoder = make_table(), FakeDecoder()
    open_stream(table, decoder, 1, make_codes(2))
    error = send_error(table, decoder, 1, 0, make_codes(2), frame_offset=-1)
    assert error.kind == "negative_offset"
    assert "frame_offset must be >= 0, got -1" in str(error)


def test_offset_overlap_shorter_than_the_decoded_frames_decodes_nothing():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(6)
    open_stream(table, decoder, 1, codes)
    calls = len(decoder.calls)
    pcm = send(table, decoder, 1, 0, codes[:, 1:3], frame_offset=1)
    assert pcm.shape == (1, 0) and len(decoder.calls) == calls


# --------------------------------------------------------------------------------------------------
# dedupe without frame_offset


def test_auto_cumulative_request_decodes_only_its_suffix():
    table, decoder = make_table(dedupe_mode="auto"), FakeDecoder()
    codes = make_codes(7)
    send(table, decoder, 1, START, codes[:, :4])
    pcm = send(table, decoder, 1, 0, codes)
    np.testing.assert_array_equal(pcm, expected_pcm(codes[:, 4:]))
    np.testing.assert_array_equal(decoded_of(table, 1), codes)


def test_auto_delta_request_is_decoded_whole():
    table, decoder = make_table(dedupe_mode="auto"), FakeDecoder()
    codes = make_codes(7)
    send(table, decoder, 1, START, codes[:, :4])
    pcm = send(table, decoder, 1, 0, codes[:, 4:])
    np.testing.assert_array_equal(pcm, expected_pcm(codes[:, 4:]))
    np.testing.assert_array_equal(decoded_of(table, 1), codes)


def test_auto_documented_limit_silence_delta_equal_to_decoded_start_is_taken_as_resend():
    table, decoder = make_table(dedupe_mode="auto"), FakeDecoder()
    silence = np.full((NUM_CODEBOOKS, 2), 5, np.int64)
    send(table, decoder, 1, START, silence)
    # A delta of 3 silence frames starts with every (silent) decoded frame: taken as cumulative, so
    # only its last frame is decoded and 2 frames of audio are lost.
    pcm = send(table, decoder, 1, 0, np.full((NUM_CODEBOOKS, 3), 5, np.int64))
    assert pcm.shape == (1, SAMPLES)
    assert decoded_of(table, 1).shape == (NUM_CODEBOOKS, 3)


def test_auto_documented_limit_short_resend_is_taken_as_delta():
    table, decoder = make_table(dedupe_mode="auto"), FakeDecoder()
    codes = make_codes(4)
    send(table, decoder, 1, START, codes)
    # A resend of the first 2 frames is shorter than the decoded frames: decoded again (duplicated audio).
    pcm = send(table, decoder, 1, 0, codes[:, :2])
    np.testing.assert_array_equal(pcm, expected_pcm(codes[:, :2]))
    assert decoded_of(table, 1).shape == (NUM_CODEBOOKS, 6)


def test_requests_without_offsets_are_deltas_by_default_so_silence_is_never_lost():
    # A pipeline's stage 0 sends 1 frame, then 5-frame deltas, without frame_offset; a listening
    # duplex model emits one silence code at length. Every frame is decoded once.
    table, decoder = make_table(), FakeDecoder()
    assert table.settings.dedupe_mode == "delta"
    silence = np.full((NUM_CODEBOOKS, 19), 5, np.int64)
    sizes = []
    for index, (first, stop) in enumerate([(0, 1), (1, 6), (6, 11), (11, 16), (16, 19)]):
        sizes.append(send(table, decoder, 1, START if index == 0 else 0, silence[:, first:stop]).shape[1] // SAMPLES)
    assert sizes == [1, 5, 5, 5, 3]
    np.testing.assert_array_equal(decoded_of(table, 1), silence)


def test_delta_mode_decodes_a_cumulative_resend_again():
    table, decoder = make_table(dedupe_mode="delta"), FakeDecoder()
    codes = make_codes(5)
    send(table, decoder, 1, START, codes[:, :3])
    pcm = send(table, decoder, 1, 0, codes)
    np.testing.assert_array_equal(pcm, expected_pcm(codes))
    assert decoded_of(table, 1).shape == (NUM_CODEBOOKS, 8)


def test_delta_mode_still_honours_frame_offset():
    table, decoder = make_table(dedupe_mode="delta"), FakeDecoder()
    codes = make_codes(5)
    send(table, decoder, 1, START, codes[:, :3])
    pcm = send(table, decoder, 1, 0, codes, frame_offset=0)
    np.testing.assert_array_equal(pcm, expected_pcm(codes[:, 3:]))


def test_cumulative_mode_decodes_the_suffix_and_rejects_non_prefixes():
    table, decoder = make_table(dedupe_mode="cumulative"), FakeDecoder()
    codes = make_codes(6)
    send(table, decoder, 1, START, codes[:, :3])
    np.testing.assert_array_equal(send(table, decoder, 1, 0, codes[:, :5]), expected_pcm(codes[:, 3:5]))

    error = send_error(table, decoder, 1, 0, codes[:, :4])
    assert error.kind == "not_cumulative"
    assert "holds 4 frames" in str(error) and "has decoded 5" in str(error)

    changed = codes.copy()
    changed[2, 1] = (changed[2, 1] + 1) % CODEBOOK_SIZE
    error = send_error(table, decoder, 1, 0, changed)
    assert error.kind == "changed_frame" and "frame 1 differs" in str(error)
    np.testing.assert_array_equal(decoded_of(table, 1), codes[:, :5])


def test_cumulative_mode_treats_identical_silence_as_already_decoded():
    table, decoder = make_table(dedupe_mode="cumulative"), FakeDecoder()
    silence = np.full((NUM_CODEBOOKS, 2), 5, np.int64)
    send(table, decoder, 1, START, silence)
    assert send(table, decoder, 1, 0, np.full((NUM_CODEBOOKS, 3), 5, np.int64)).shape == (1, SAMPLES)


# --------------------------------------------------------------------------------------------------
# lifecycle


def test_start_creates_the_stream_and_flags_reach_the_decoder():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(6)
    send(table, decoder, 7, START, codes[:, :3])
    assert is_live(table, 7) and table.stats().live_streams == 1
    send(table, decoder, 7, 0, codes[:, 3:5])
    send(table, decoder, 7, END, codes[:, 5:])
    assert decoder.flags() == [START, 0, 0, 0, 0, END]
    assert {cid for cid, _, _ in decoder.calls} == {7}
    np.testing.assert_array_equal(decoder.decoded_codes(), codes)
    assert not is_live(table, 7) and table.stats().live_streams == 0


def test_start_on_a_live_stream_resets_it():
    table, decoder = make_table(), FakeDecoder()
    old, new = make_codes(4, seed=1), make_codes(3, seed=2)
    send(table, decoder, 1, START, old)
    pcm = send(table, decoder, 1, START, new, frame_offset=0)  # barge-in restarts at frame 0
    np.testing.assert_array_equal(pcm, expected_pcm(new))
    np.testing.assert_array_equal(decoded_of(table, 1), new)
    assert decoder.flags() == [START, 0, 0, 0, START, 0, 0]


def test_start_without_frames_on_a_live_stream_restarts_the_decoder_on_the_next_step():
    table, decoder = make_table(), FakeDecoder()
    send(table, decoder, 1, START, make_codes(2, seed=1))
    send(table, decoder, 1, START)
    assert decoded_of(table, 1).shape == (NUM_CODEBOOKS, 0)
    send(table, decoder, 1, 0, make_codes(2, seed=2), frame_offset=0)
    assert decoder.flags() == [START, 0, START, 0]


def test_end_removes_the_stream_and_later_requests_must_start_again():
    table, decoder = make_table(), FakeDecoder()
    send(table, decoder, 1, START, make_codes(2))
    send(table, decoder, 1, END, make_codes(3), frame_offset=0)
    assert not is_live(table, 1)
    error = send_error(table, decoder, 1, 0, make_codes(1))
    assert error.kind == "unknown_stream"
    assert "stream 1 is not open" in str(error) and "START" in str(error)


def test_start_end_in_one_request_decodes_and_closes():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(3)
    pcm = send(table, decoder, 1, START | END, codes)
    np.testing.assert_array_equal(pcm, expected_pcm(codes))
    assert decoder.flags() == [START, 0, END]
    assert not is_live(table, 1)


def test_start_end_single_frame_carries_both_flags_on_one_step():
    table, decoder = make_table(), FakeDecoder()
    send(table, decoder, 1, START | END, make_codes(1))
    assert decoder.flags() == [START | END]


def test_start_end_without_frames_calls_no_decoder():
    # Nothing was started in the decoder, so there is nothing to end there.
    table, decoder = make_table(), FakeDecoder()
    pcm = send(table, decoder, 1, START | END)
    assert pcm.shape == (1, 0)
    assert decoder.calls == [] and not is_live(table, 1)


def test_start_then_end_without_frames_calls_no_decoder():
    table, decoder = make_table(), FakeDecoder()
    send(table, decoder, 1, START)
    assert is_live(table, 1)
    assert send(table, decoder, 1, END).shape == (1, 0)
    assert decoder.calls == [] and not is_live(table, 1)


def test_end_without_new_frames_closes_the_decoder_with_one_discarded_step():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(3)
    send(table, decoder, 1, START, codes)
    pcm = send(table, decoder, 1, END, codes, frame_offset=0)  # a retry carrying END: no new frame
    assert pcm.shape == (1, 0)
    assert decoder.flags() == [START, 0, 0, END]
    _, trailing, _ = decoder.calls[-1]
    assert trailing.shape == (1, NUM_CODEBOOKS, 1) and not trailing.any()
    assert not is_live(table, 1)


def test_end_only_plan_says_it_needs_the_trailing_step():
    table, decoder = make_table(), FakeDecoder()
    send(table, decoder, 1, START, make_codes(1))
    plan = plan_of(table, 1, END, flat(make_codes(1)), offset(0))
    # END with no new frame while the decoder holds the sequence: one step of zero codes carrying END
    # closes it, its PCM discarded.
    assert plan.new_frames == 0
    assert [step.flags for step in plan.steps] == [END] and plan.steps[0].discard_output
    plan = plan_of(table, 1, END, flat(make_codes(2)), offset(0))
    assert plan.new_frames == 1 and not plan.steps[-1].discard_output
    assert is_live(table, 1)  # planning changes nothing


def test_barge_in_start_end_without_frames_closes_the_old_decoder_sequence():
    table, decoder = make_table(), FakeDecoder()
    send(table, decoder, 1, START, make_codes(2))
    send(table, decoder, 1, START | END)
    assert decoder.flags() == [START, 0, END]
    assert not is_live(table, 1)


def test_unknown_stream_without_start_is_rejected():
    table, decoder = make_table(stream_idle_timeout_s=12.5), FakeDecoder()
    error = send_error(table, decoder, 42, 0, make_codes(2))
    assert error.kind == "unknown_stream"
    assert "stream 42 is not open" in str(error)
    assert "with the START flag" in str(error)
    assert "12.5 s idle" in str(error)
    assert decoder.calls == [] and not is_live(table, 42)


def test_decoder_failure_part_way_ends_the_stream():
    table, decoder = make_table(), FakeDecoder(fail_on_call=4)
    codes = make_codes(5)
    send(table, decoder, 1, START, codes[:, :2])
    error = send_error(table, decoder, 1, 0, codes[:, 2:], frame_offset=2, error=DecoderError)
    assert error.kind == "decoder" and error.code == "INTERNAL"
    assert "failed on step 2 of 3 for stream 1" in str(error)
    assert "simulated decoder failure" in str(error)
    assert "START" in str(error)
    assert len(decoder.calls) == 4  # the third step was never sent
    assert not is_live(table, 1)
    stats = table.stats()
    assert stats.errors_by_kind["decoder"] == 1 and stats.frames_decoded == 2
    assert send_error(table, decoder, 1, 0, codes[:, 4:], frame_offset=4).kind == "unknown_stream"
    # START begins again from frame 0 and the decoder gets START.
    send(table, decoder, 1, START, codes, frame_offset=0)
    assert decoder.flags()[-5] == START
    np.testing.assert_array_equal(decoded_of(table, 1), codes)


def test_decoder_output_of_the_wrong_size_ends_the_stream():
    table, decoder = make_table(), FakeDecoder(wrong_size_on_call=2)
    error = send_error(table, decoder, 1, START, make_codes(3), error=DecoderError)
    assert f"returned {SAMPLES - 1} samples for 1 frame(s), expected {SAMPLES}" in str(error)
    assert not is_live(table, 1)


def test_unexpected_exception_in_the_decoder_helper_ends_the_stream():
    table = make_table()

    async def broken(correlation_id, codes, flags):
        raise KeyError("pcm")

    error = send_error(table, broken, 1, START, make_codes(1), error=DecoderError)
    assert "KeyError" not in str(error) and "'pcm'" in str(error)
    assert isinstance(error.__cause__, KeyError)
    assert not is_live(table, 1)


# --------------------------------------------------------------------------------------------------
# rejected requests leave the stream unchanged


REJECTED = [
    pytest.param(dict(input_ids=np.zeros((1, 8), np.float64)), "dtype", id="dtype"),
    pytest.param(dict(input_ids=np.zeros((1, 9), np.int64)), "length", id="length"),
    pytest.param(dict(input_ids=np.full((1, NUM_CODEBOOKS), CODEBOOK_SIZE, np.int64)), "code_range", id="code_range"),
    pytest.param(dict(frame_offset=-2), "negative_offset", id="negative_offset"),
    pytest.param(dict(frame_offset=9), "gap", id="gap"),
    pytest.param(dict(frame_offset=0, changed=True), "changed_frame", id="changed_frame"),
    pytest.param(dict(frames=4), "limit", id="limit-new"),
    pytest.param(dict(frames=11, frame_offset=0), "limit", id="limit-request"),
]


def send_rejected(request_kwargs, kind, flags):
    """A stream with frames 0-2 decoded, then one REJECTED request with `flags`.
    Returns (table, decoder, the stream's 9 frames of codes, decoder calls before it, error, kind)."""
    table, decoder = make_table(max_new_frames_per_request=3, max_request_frames=10), FakeDecoder()
    codes = make_codes(9)
    send(table, decoder, 1, START, codes[:, :3])
    calls = len(decoder.calls)
    kwargs = dict(request_kwargs)
    if kind in ("gap", "changed_frame") and flags & START:
        kwargs = dict(frame_offset=1)  # a START restarts at 0, so offset 1 is a gap there
        kind = "gap"
    frames = kwargs.pop("frames", 2)
    request_codes = make_codes(frames, seed=3)
    if kwargs.pop("changed", False):
        request_codes = codes[:, :2].copy()
        request_codes[0, 1] += 1
    error = send_error(table, decoder, 1, flags, request_codes, **kwargs)
    return table, decoder, codes, calls, error, kind


@pytest.mark.parametrize("flags", [0, START], ids=["plain", "start"])
@pytest.mark.parametrize("request_kwargs, kind", REJECTED)
def test_rejected_request_leaves_the_stream_unchanged(request_kwargs, kind, flags):
    table, decoder, codes, calls, error, kind = send_rejected(request_kwargs, kind, flags)
    assert error.kind == kind and error.code == "INVALID_ARG"
    assert len(decoder.calls) == calls
    assert is_live(table, 1)
    np.testing.assert_array_equal(decoded_of(table, 1), codes[:, :3])
    assert table.stats().errors_by_kind[kind] == 1
    # The stream carries on where it was: no START needed, the next frame is still frame 3.
    pcm = send(table, decoder, 1, 0, codes[:, 3:5], frame_offset=3)
    np.testing.assert_array_equal(pcm, expected_pcm(codes[:, 3:5]))
    assert decoder.flags()[-2:] == [0, 0]


def test_rejected_start_does_not_create_a_stream():
    table, decoder = make_table(), FakeDecoder()
    send_error(table, decoder, 1, START, input_ids=np.zeros((1, 9), np.int64))
    assert not is_live(table, 1) and table.stats().live_streams == 0


# --------------------------------------------------------------------------------------------------
# limits


def test_new_frames_limit_names_the_parameter():
    table, decoder = make_table(max_new_frames_per_request=4), FakeDecoder()
    error = send_error(table, decoder, 1, START, make_codes(5))
    assert error.kind == "limit"
    assert "5 new frames" in str(error) and "max_new_frames_per_request=4" in str(error)
    assert decoder.calls == []


def test_new_frames_limit_counts_only_new_frames():
    table, decoder = make_table(max_new_frames_per_request=4), FakeDecoder()
    codes = make_codes(8)
    send(table, decoder, 1, START, codes[:, :4])
    pcm = send(table, decoder, 1, 0, codes, frame_offset=0)  # 8 frames, 4 of them new
    assert pcm.shape == (1, 4 * SAMPLES)


def test_request_length_limit_names_the_parameter():
    table, decoder = make_table(max_request_frames=6), FakeDecoder()
    codes = make_codes(7)
    send(table, decoder, 1, START, codes[:, :6])
    error = send_error(table, decoder, 1, 0, codes, frame_offset=0)  # 1 new frame, 7 in all
    assert error.kind == "limit"
    assert "holds 7 frames" in str(error) and "max_request_frames=6" in str(error)


# --------------------------------------------------------------------------------------------------
# idle expiry


def test_idle_streams_expire_on_the_next_batch():
    clock = FakeClock()
    table, decoder = make_table(clock=clock, stream_idle_timeout_s=30.0), FakeDecoder()
    send(table, decoder, 1, START, make_codes(1))
    send(table, decoder, 2, START, make_codes(1))
    clock.now += 20.0
    send(table, decoder, 2, 0, make_codes(2), frame_offset=0)
    clock.now += 15.0  # stream 1 idle 35 s, stream 2 idle 15 s

    asyncio.run(process_batch(table, [], decoder))
    assert not is_live(table, 1) and is_live(table, 2)
    assert table.stats().streams_expired == 1 and table.stats().live_streams == 1
    error = send_error(table, decoder, 1, 0, make_codes(2), frame_offset=1)
    assert error.kind == "unknown_stream"


@pytest.mark.parametrize("request_kwargs, kind", REJECTED)
def test_rejected_request_with_end_ends_the_stream(request_kwargs, kind):
    """Triton releases a sequence when it schedules its END request, whatever the model answers:
    a rejected END ends the stream, and its decoder sequence gets a discarded END step."""
    table, decoder, _, calls, error, kind = send_rejected(request_kwargs, kind, END)
    assert error.kind == kind and "the request carried END, so the stream has ended" in str(error)
    assert not is_live(table, 1)
    assert len(decoder.calls) == calls + 1 and decoder.flags()[-1] == END
    assert not decoder.calls[-1][1].any()  # zero codes, output discarded


def test_a_stream_idle_exactly_the_timeout_plus_grace_is_kept():
    clock = FakeClock()
    table, decoder = make_table(clock=clock, stream_idle_timeout_s=30.0), FakeDecoder()
    send(table, decoder, 1, START, make_codes(1))
    clock.now += 30.0 + core.IDLE_GRACE_S
    assert table.expire_idle() == []
    clock.now += 0.001
    assert table.expire_idle() == [1]


def test_a_stream_with_a_request_in_the_batch_is_not_expired():
    # Triton accepted the request as part of a live sequence, so the stream is live.
    clock = FakeClock()
    table, decoder = make_table(clock=clock, stream_idle_timeout_s=30.0), FakeDecoder()
    codes = make_codes(3)
    send(table, decoder, 1, START, codes[:, :1])
    clock.now += 100.0
    results = asyncio.run(
        process_batch(table, [StreamRequest(1, 0, flat(codes), offset(0))], decoder)
    )
    np.testing.assert_array_equal(results[0], expected_pcm(codes[:, 1:]))


def test_requests_that_decode_nothing_do_not_keep_a_stream_alive():
    """Idle time runs from the last decoder step: retries and rejected requests never reach the
    decoder, whose own idle timeout would otherwise drop the state under a live stream."""
    clock = FakeClock()
    table, decoder = make_table(clock=clock, stream_idle_timeout_s=30.0), FakeDecoder()
    codes = make_codes(1)
    send(table, decoder, 1, START, codes)
    clock.now += 20.0
    send_error(table, decoder, 1, 0, make_codes(1), frame_offset=5)
    assert send(table, decoder, 1, 0, codes, frame_offset=0).size == 0  # identical retry
    clock.now += 20.0
    assert table.expire_idle() == [1]


# --------------------------------------------------------------------------------------------------
# steps and output packing


def test_each_new_frame_is_one_decoder_step():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(3)
    pcm = send(table, decoder, 1, START | END, codes)
    assert [codes.shape[2] for _, codes, _ in decoder.calls] == [1, 1, 1]
    assert decoder.flags() == [START, 0, END]
    np.testing.assert_array_equal(pcm, expected_pcm(codes))


def test_output_is_float32_with_samples_per_frame_per_new_frame():
    table, decoder = make_table(samples_per_frame=SAMPLES_PER_FRAME), FakeDecoder(samples_per_frame=SAMPLES_PER_FRAME)
    codes = make_codes(3)
    pcm = send(table, decoder, 1, START, codes)
    assert pcm.dtype == np.float32 and pcm.shape == (1, SAMPLES_PER_FRAME * 3) and pcm.flags.c_contiguous
    np.testing.assert_array_equal(pcm, expected_pcm(codes, SAMPLES_PER_FRAME))


@pytest.mark.parametrize(
    "new_frames, max_frames, request_flags, sizes, step_flags",
    [
        pytest.param(1, 16, START, [1], [START], id="1-frame-request-1-frame-step"),
        pytest.param(16, 16, START | END, [16], [START | END], id="one-call-up-to-max"),
        pytest.param(7, 4, START | END, [4, 3], [START, END], id="full-calls-then-remainder"),
        pytest.param(9, 4, START, [4, 4, 1], [START, 0, 0], id="three-calls"),
    ],
)
def test_new_frames_go_to_the_decoder_in_as_few_calls_as_it_takes(new_frames, max_frames, request_flags, sizes,
                                                                   step_flags):
    table, decoder = make_table(decoder_max_frames_per_step=max_frames), FakeDecoder()
    codes = make_codes(new_frames)
    pcm = send(table, decoder, 1, request_flags, codes)
    assert [c.shape[2] for _, c, _ in decoder.calls] == sizes
    assert decoder.flags() == step_flags
    np.testing.assert_array_equal(pcm, expected_pcm(codes))


def test_a_failure_on_a_later_call_of_a_request_ends_the_stream():
    table, decoder = make_table(decoder_max_frames_per_step=4), FakeDecoder(fail_on_call=2)
    error = send_error(table, decoder, 1, START, make_codes(6), error=DecoderError)
    assert "failed on step 2 of 2" in str(error) and "START" in str(error)
    assert not is_live(table, 1)


def test_plan_steps_are_int32_frames_of_the_new_frames():
    table = make_table()
    codes = make_codes(3)
    plan = plan_of(table, 1, START, flat(codes))
    assert plan.new_codes.dtype == np.int32
    np.testing.assert_array_equal(plan.new_codes, codes)
    assert all(step.codes.shape == (1, NUM_CODEBOOKS, 1) and step.codes.flags.c_contiguous for step in plan.steps)
    np.testing.assert_array_equal(
        np.concatenate([step.codes[0] for step in plan.steps], axis=1), codes
    )
    assert [step.flags for step in plan.steps] == [START, 0, 0]
    assert not is_live(table, 1)


# --------------------------------------------------------------------------------------------------
# batches


def test_batch_overlaps_streams_and_keeps_each_stream_in_order():
    table, decoder = make_table(), FakeDecoder()
    a, b = make_codes(3, seed=1), make_codes(6, seed=2)
    requests = [
        StreamRequest(1, START, flat(a)),
        StreamRequest(2, START, flat(b[:, :3])),
        StreamRequest(2, 0, flat(b[:, 3:])),  # same stream twice in one batch: runs after
    ]
    results = asyncio.run(process_batch(table, requests, decoder))
    np.testing.assert_array_equal(results[0], expected_pcm(a))
    np.testing.assert_array_equal(results[1], expected_pcm(b[:, :3]))
    np.testing.assert_array_equal(results[2], expected_pcm(b[:, 3:]))
    np.testing.assert_array_equal(decoder.decoded_codes(2), b)
    assert [flags for cid, _, flags in decoder.calls if cid == 2] == [START, 0, 0, 0, 0, 0]
    # The two streams' steps were in flight together, one stream's never were.
    assert decoder.max_in_flight == 2
    first_end_of_1 = decoder.events.index(("end", 1))
    assert ("begin", 2) in decoder.events[:first_end_of_1]


def test_one_bad_request_does_not_fail_its_batch_mates():
    table, decoder = make_table(), FakeDecoder(fail_on_call=1)
    good = make_codes(2, seed=5)
    requests = [
        StreamRequest(1, START, flat(make_codes(1))),  # decoder fails on its step
        StreamRequest(2, 0, flat(good)),  # unknown stream
        StreamRequest(3, START, np.zeros((1, 3), np.int64)),  # bad length
        StreamRequest(4, START, flat(good)),
    ]
    results = asyncio.run(process_batch(table, requests, decoder))
    assert isinstance(results[0], DecoderError)
    assert isinstance(results[1], RequestError) and results[1].kind == "unknown_stream"
    assert isinstance(results[2], RequestError) and results[2].kind == "length"
    np.testing.assert_array_equal(results[3], expected_pcm(good))
    assert sorted(cid for cid in (1, 2, 3, 4) if is_live(table, cid)) == [4]


class GatedDecoder(FakeDecoder):
    """A FakeDecoder whose steps of the streams in `gated` wait until `gate` is set: a long request
    (a resume's replay) still decoding while other requests come and go."""

    def __init__(self, gated):
        super().__init__()
        self.gated = set(gated)
        self.gate = asyncio.Event()

    async def __call__(self, correlation_id, codes, flags):
        if correlation_id in self.gated:
            await self.gate.wait()
        return await super().__call__(correlation_id, codes, flags)


def test_a_long_request_holds_up_no_other_stream_across_batches():
    """Stream 1's request is still decoding while stream 2 sends three requests in three later
    batches: each of them finishes (in order, with its finish called) before stream 1's does."""

    async def scenario():
        table, decoder = make_table(), GatedDecoder(gated={1})
        long, live = make_codes(40, seed=1), make_codes(3, seed=2)
        finished = []
        (slow,) = table.submit_batch([StreamRequest(1, START, flat(long))], decoder,
                                     [lambda result: finished.append(1)])
        for frame in range(3):
            flags = START if frame == 0 else 0
            (task,) = table.submit_batch([StreamRequest(2, flags, flat(live[:, frame:frame + 1]), offset(frame))],
                                         decoder, [lambda result, frame=frame: finished.append((2, frame))])
            np.testing.assert_array_equal(await task, expected_pcm(live[:, frame:frame + 1]))
            assert not slow.done() and requests_in_flight(table) == 1
        decoder.gate.set()
        np.testing.assert_array_equal(await slow, expected_pcm(long))
        assert finished == [(2, 0), (2, 1), (2, 2), 1]
        assert requests_in_flight(table) == 0

    asyncio.run(scenario())


def test_live_requests_are_one_step_without_history_and_their_streams_only_request_in_flight():
    """`live` decides which requests execute waits for and answers in its returned list. A request
    past one decoder step, a replay, a stream's second request in the batch, or one queued behind its
    stream's unfinished request goes through its sender instead, so no answer overtakes another."""

    async def scenario():
        table, decoder = make_table(decoder_max_frames_per_step=4), GatedDecoder(gated={9})
        (slow,) = table.submit_batch([StreamRequest(9, START, flat(make_codes(2, seed=9)))], decoder)
        await asyncio.sleep(0)
        batch = [
            StreamRequest(1, START, flat(make_codes(1, seed=1))),  # one frame of an idle stream
            StreamRequest(2, START, flat(make_codes(4, seed=2))),  # one whole decoder step
            StreamRequest(3, START, flat(make_codes(5, seed=3))),  # two decoder steps
            StreamRequest(4, START, flat(make_codes(3, seed=4)), history_frames=np.array([[2]])),  # a replay
            StreamRequest(5, START, flat(make_codes(1, seed=5))),  # stream 5 twice in this batch
            StreamRequest(5, 0, flat(make_codes(1, seed=6)), offset(1)),
            StreamRequest(9, 0, flat(make_codes(1, seed=7)), offset(2)),  # behind stream 9's unfinished request
            StreamRequest(6, START, np.zeros(0, np.int64)),  # no frames
        ]
        assert table.live(batch) == [True, True, False, False, False, False, False, True]
        decoder.gate.set()
        await slow
        assert table.live(batch[6:7]) == [True]  # stream 9's request finished

    asyncio.run(scenario())


def test_a_streams_requests_run_in_order_across_batches_and_finish_before_the_next_starts():
    """The next request of a stream may arrive (in a later batch) while its previous one is still
    decoding: it waits its turn, and the previous request's finish (its response) comes first."""

    async def scenario():
        table, decoder = make_table(), GatedDecoder(gated={1})
        codes = make_codes(20, seed=3)
        order = []

        def finish(name):
            def record(result):
                order.append((name, decoder.gate.is_set(), len(decoder.calls)))
            return record

        first = table.submit(StreamRequest(1, START, flat(codes[:, :16])), decoder, finish("first"))
        second = table.submit(StreamRequest(1, 0, flat(codes[:, 16:]), offset(16)), decoder, finish("second"))
        await asyncio.sleep(0.01)
        assert not first.done() and not second.done() and decoder.calls == []
        decoder.gate.set()
        results = await asyncio.gather(first, second)
        np.testing.assert_array_equal(np.concatenate(results, axis=1), expected_pcm(codes))
        # The first's response went out before the second's step reached the decoder.
        assert order == [("first", True, 16), ("second", True, 20)]  # one step per frame here
        np.testing.assert_array_equal(decoder.decoded_codes(1), codes)

    asyncio.run(scenario())


def test_streams_opening_in_earlier_batches_count_toward_the_cap():
    async def scenario():
        table, decoder = make_table(max_live_streams=2), GatedDecoder(gated={1, 2})
        codes = make_codes(1)
        opening = [table.submit(StreamRequest(cid, START, flat(codes)), decoder) for cid in (1, 2)]
        refused = await table.submit(StreamRequest(3, START, flat(codes)), decoder)
        assert isinstance(refused, StreamCapError) and "already holds 2 live streams" in str(refused)
        decoder.gate.set()
        assert not any(isinstance(result, Exception) for result in await asyncio.gather(*opening))
        assert sorted(cid for cid in (1, 2, 3) if is_live(table, cid)) == [1, 2]

    asyncio.run(scenario())


def test_a_stream_with_a_request_still_decoding_is_not_expired():
    async def scenario():
        clock = FakeClock()
        table, decoder = make_table(clock=clock, stream_idle_timeout_s=30.0), GatedDecoder(gated=set())
        codes = make_codes(2)
        await table.submit(StreamRequest(1, START, flat(codes[:, :1])), decoder)
        decoder.gated.add(1)
        pending = table.submit(StreamRequest(1, 0, flat(codes[:, 1:]), offset(1)), decoder)
        clock.now += 100.0
        assert table.expire_idle() == [] and is_live(table, 1)
        decoder.gate.set()
        np.testing.assert_array_equal(await pending, expected_pcm(codes[:, 1:]))

    asyncio.run(scenario())


# --------------------------------------------------------------------------------------------------
# decoded codes and stats


def test_decoded_codes_grow_geometrically_and_keep_every_frame():
    table, decoder = make_table(), FakeDecoder()
    codes = make_codes(1000, seed=9)
    send(table, decoder, 1, START, codes[:, :1])
    capacities = set()
    position, step = 1, 1
    while position < 1000:
        end = min(1000, position + step)
        send(table, decoder, 1, 0, codes[:, position:end], frame_offset=position)
        capacities.add(table._streams[1].decoded.capacity)
        position, step = end, step % 7 + 1
    decoded = decoded_of(table, 1)
    np.testing.assert_array_equal(decoded, codes)
    assert decoded.dtype == np.int16
    assert not decoded.flags.writeable
    assert len(capacities) <= 6  # 64 -> 128 -> ... -> 1024: a handful of reallocations
    assert 1000 <= max(capacities) <= 2048
    assert table.stats().frames_decoded == 1000


def test_decoded_codes_of_a_large_codebook_are_int32():
    decoded = code2wav_stream.DecodedCodes(NUM_CODEBOOKS, 40000)
    codes = np.full((NUM_CODEBOOKS, 3), 39999, np.int64)
    decoded.append(codes)
    assert decoded.dtype == np.int32
    np.testing.assert_array_equal(decoded.codes(), codes)


def test_decoded_codes_first_mismatch():
    decoded = code2wav_stream.DecodedCodes(2, CODEBOOK_SIZE)
    decoded.append(np.array([[1, 2, 3, 4], [5, 6, 7, 8]]))
    assert decoded.first_mismatch(np.array([[2, 3], [6, 7]]), 1) is None
    assert decoded.first_mismatch(np.array([[2, 3], [6, 0]]), 1) == 1
    assert decoded.first_mismatch(np.array([[9, 3], [6, 7]]), 1) == 0


def test_stats_count_frames_streams_and_errors_by_kind():
    table, decoder = make_table(), FakeDecoder()
    send(table, decoder, 1, START, make_codes(3))
    send(table, decoder, 2, START, make_codes(2))
    send(table, decoder, 2, END, make_codes(4), frame_offset=0)
    send_error(table, decoder, 3, 0, make_codes(1))
    send_error(table, decoder, 1, 0, make_codes(1), frame_offset=7)
    send_error(table, decoder, 1, 0, make_codes(1), frame_offset=8)
    table.count_error("internal")
    stats = table.stats()
    assert stats.live_streams == 1
    assert stats.frames_decoded == 3 + 2 + 2
    assert stats.errors_by_kind["unknown_stream"] == 1
    assert stats.errors_by_kind["gap"] == 2
    assert stats.errors_by_kind["internal"] == 1
    assert set(code2wav_settings.ERROR_KINDS) <= set(stats.errors_by_kind)


# --------------------------------------------------------------------------------------------------
# the stream cap


def test_starts_past_max_live_streams_are_refused_and_touch_nothing():
    table, decoder = make_table(max_live_streams=2), FakeDecoder()
    codes = make_codes(2, seed=7)
    requests = [StreamRequest(cid, START, flat(codes[:, :1])) for cid in (1, 2, 3)]
    requests.append(StreamRequest(3, 0, flat(codes[:, 1:])))  # the refused stream's next request
    results = asyncio.run(process_batch(table, requests, decoder))
    np.testing.assert_array_equal(results[0], expected_pcm(codes[:, :1]))
    refused = results[2]
    assert isinstance(refused, StreamCapError) and (refused.kind, refused.code) == ("stream_cap", "UNAVAILABLE")
    assert str(refused).startswith(
        "resource exhausted: this code2wav instance already holds 2 live streams, its limit (max_live_streams=2); "
        "the new stream was refused and no other stream was affected. Retry later, or END streams that are done")
    assert isinstance(results[3], RequestError) and results[3].kind == "unknown_stream"
    assert sorted(cid for cid, _, _ in decoder.calls) == [1, 2] and not is_live(table, 3)
    assert table.stats().errors_by_kind["stream_cap"] == 1
    # A restart (START on a live stream) and a one-shot START|END take no new room.
    results = asyncio.run(process_batch(table, [StreamRequest(1, START, flat(codes[:, :1])),
                                                StreamRequest(4, START | END, flat(codes[:, :1]))], decoder))
    assert not any(isinstance(result, Exception) for result in results) and table.stats().live_streams == 2
    # After an END there is room again.
    asyncio.run(process_batch(table, [StreamRequest(2, END, flat(codes[:, 1:]))], decoder))
    (result,) = asyncio.run(process_batch(table, [StreamRequest(3, START, flat(codes[:, :1]))], decoder))
    assert not isinstance(result, Exception) and is_live(table, 3)


def test_decoder_refusals_and_shutdown_keep_their_code():
    """A decoder refusing a new stream (its own cap) or a server shutting down reach the client as
    UNAVAILABLE, counted under their own kinds; any other decoder failure stays INTERNAL."""
    class Refusing(FakeDecoder):
        def __init__(self, error):
            super().__init__()
            self.error = error

        async def __call__(self, correlation_id, codes, flags):
            raise self.error

    for error, kind, code in ((DecoderError("no room", "UNAVAILABLE", "stream_cap"), "stream_cap", "UNAVAILABLE"),
                              (DecoderError("shutting down", "UNAVAILABLE", "unavailable"), "unavailable", "UNAVAILABLE"),
                              (DecoderError("boom"), "decoder", "INTERNAL")):
        table = make_table()
        (result,) = asyncio.run(process_batch(table, [StreamRequest(1, START, flat(make_codes(1)))], Refusing(error)))
        assert isinstance(result, DecoderError) and (result.kind, result.code) == (kind, code)
        assert str(error) in str(result) and not is_live(table, 1)
        assert table.stats().errors_by_kind[kind] == 1


# --------------------------------------------------------------------------------------------------
# resume by replay: START with history_frames


def resume(table, decoder, correlation_id, codes, first_frame, history_frames, flags=START):
    """START a resumed stream: `codes` are stream frames [first_frame, first_frame + F), the first
    `history_frames` of them history. Returns the PCM."""
    return send(table, decoder, correlation_id, flags, codes, frame_offset=first_frame, history_frames=history_frames)


@pytest.mark.parametrize("max_frames_per_step", [1, 3, 16])
def test_a_resumed_stream_returns_exactly_the_frames_after_its_history(max_frames_per_step):
    table, decoder = make_table(decoder_max_frames_per_step=max_frames_per_step), FakeDecoder()
    stream = make_codes(20)
    pcm = resume(table, decoder, 1, stream[:, 10:17], first_frame=10, history_frames=4)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 14:17]))
    # Every frame of the request was decoded, history first, the decoder starting afresh on it.
    np.testing.assert_array_equal(decoder.decoded_codes(), stream[:, 10:17])
    assert decoder.flags()[0] == START and not any(flags & START for flags in decoder.flags()[1:])
    sizes = [codes.shape[2] for _, codes, _ in decoder.calls]

    def split(frames):
        return [min(max_frames_per_step, frames - first) for first in range(0, frames, max_frames_per_step)]

    assert sizes == split(4) + split(3)  # the history's replay steps, then the new frames'
    assert base_of(table, 1) == 10
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, 10:17])


def test_history_and_new_frames_never_share_a_decoder_call():
    table, decoder = make_table(decoder_max_frames_per_step=3), FakeDecoder()
    stream = make_codes(12)
    pcm = resume(table, decoder, 1, stream[:, 2:10], first_frame=2, history_frames=4)
    assert [codes.shape[2] for _, codes, _ in decoder.calls] == [3, 1, 3, 1]
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 6:10]))


def test_a_resumed_stream_continues_in_absolute_frame_indices():
    table, decoder = make_table(), FakeDecoder()
    stream = make_codes(24)
    resume(table, decoder, 1, stream[:, 10:16], first_frame=10, history_frames=4)
    decoder.calls.clear()
    pcm = send(table, decoder, 1, 0, stream[:, 16:18], frame_offset=16)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 16:18]))
    assert decoder.flags() == [0, 0]
    # An overlap with the decoded frames (a retry) decodes only what is new.
    pcm = send(table, decoder, 1, 0, stream[:, 12:20], frame_offset=12)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 18:20]))
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, 10:20])
    assert base_of(table, 1) == 10
    error = send_error(table, decoder, 1, 0, stream[:, 21:23], frame_offset=21)
    assert error.kind == "gap"
    assert "frame_offset 21 leaves a gap: stream 1 has decoded 20 frames, so frame_offset must be at most 20" in str(error)
    changed = stream[:, 11:21].copy()
    changed[3, 2] = (changed[3, 2] + 1) % CODEBOOK_SIZE  # stream frame 13
    error = send_error(table, decoder, 1, 0, changed, frame_offset=11)
    assert error.kind == "changed_frame" and "frame 13 differs" in str(error)
    # The history frames count as decoded: the stream's next frame is 20.
    pcm = send(table, decoder, 1, END, stream[:, 20:24], frame_offset=20)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 20:24]))
    assert not is_live(table, 1)


def test_an_offset_before_the_resume_point_is_refused_saying_why():
    table, decoder = make_table(), FakeDecoder()
    stream = make_codes(16)
    resume(table, decoder, 1, stream[:, 10:14], first_frame=10, history_frames=2)
    calls = len(decoder.calls)
    error = send_error(table, decoder, 1, 0, stream[:, 9:16], frame_offset=9)
    assert (error.kind, error.code) == ("before_resume", "INVALID_ARG")
    assert str(error) == (
        "frame_offset 9 is before frame 10, where stream 1 was resumed on this server: frames before 10 are "
        "not held here and cannot be compared; send frames from 10 on"
    )
    assert len(decoder.calls) == calls and base_of(table, 1) == 10
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, 10:14])
    assert table.stats().errors_by_kind["before_resume"] == 1


def test_history_continues_a_stream_in_pieces():
    """A resume sent in pieces: START with the first history frames, then requests whose frames are
    all history, then the rest of the history with the new frames. Each piece is decoded once; only
    the new frames' PCM comes back."""
    table, decoder = make_table(decoder_max_frames_per_step=3), FakeDecoder()
    stream = make_codes(30)
    assert resume(table, decoder, 1, stream[:, 10:15], first_frame=10, history_frames=5).size == 0
    assert send(table, decoder, 1, 0, stream[:, 15:20], frame_offset=15, history_frames=5).size == 0
    pcm = send(table, decoder, 1, 0, stream[:, 20:26], frame_offset=20, history_frames=2)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 22:26]))
    np.testing.assert_array_equal(decoder.decoded_codes(), stream[:, 10:26])
    assert base_of(table, 1) == 10 and table.stats().streams_resumed == 1
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, 10:26])


@pytest.mark.parametrize("flags", [0, END], ids=["plain", "end"])
def test_history_on_a_continuing_stream_must_start_at_its_next_frame(flags):
    table, decoder = make_table(), FakeDecoder()
    stream = make_codes(6)
    open_stream(table, decoder, 1, stream[:, :3])
    calls = len(decoder.calls)
    error = send_error(table, decoder, 1, flags, stream[:, 2:6], frame_offset=2, history_frames=1)
    assert (error.kind, error.code) == ("history", "INVALID_ARG")
    assert str(error).startswith(
        "history_frames=1 on a continuing stream needs frame_offset=3, the stream's next frame (got 2): history "
        "is decoded once, after the frames stream 1 holds")
    if flags & END:  # Triton releases the sequence with a rejected END (design doc §2.2)
        assert not is_live(table, 1) and str(error).endswith("; the request carried END, so the stream has ended")
    else:
        assert len(decoder.calls) == calls
        np.testing.assert_array_equal(decoded_of(table, 1), stream[:, :3])


def test_history_frames_on_an_unknown_stream_without_start_says_to_start():
    table, decoder = make_table(), FakeDecoder()
    error = send_error(table, decoder, 5, 0, make_codes(3), frame_offset=7, history_frames=2)
    assert error.kind == "unknown_stream" and "START" in str(error)


def test_replayed_history_takes_the_replay_lane():
    """Four streams resume at once beside a live stream: a replay step starts while a live step is
    in the decoder only as the one replay step there, and the live stream's steps do not wait for
    the 16 replay steps; on an instance without live traffic, several replay steps run together."""

    class Counting(FakeDecoder):
        def __init__(self):
            super().__init__()
            self.replay_in_flight = self.live_in_flight = self.most_replay_in_flight = 0
            self.replay_starts_beside_live = []  # replay steps in flight when one starts beside a live step

        async def __call__(self, correlation_id, codes, flags):
            replay = correlation_id != 9
            self.replay_in_flight += replay
            self.live_in_flight += not replay
            self.most_replay_in_flight = max(self.most_replay_in_flight, self.replay_in_flight)
            if replay and self.live_in_flight:
                self.replay_starts_beside_live.append(self.replay_in_flight)
            try:
                # Live steps outlast the lane's wait for them (REPLAY_WAIT_FOR_IDLE_S).
                await asyncio.sleep(0.001 if replay else 1.5 * code2wav_replay.REPLAY_WAIT_FOR_IDLE_S)
                return await super().__call__(correlation_id, codes, flags)
            finally:
                self.replay_in_flight -= replay
                self.live_in_flight -= not replay

    async def scenario():
        table, decoder = make_table(decoder_max_frames_per_step=2), Counting()
        stream = make_codes(20)
        await table.submit(StreamRequest(9, START, flat(stream[:, :1]), offset(0)), decoder)
        resumes = [table.submit(StreamRequest(cid, START, flat(stream[:, :8]), offset(0), offset(8)), decoder)
                   for cid in (1, 2, 3, 4)]
        live = [table.submit(StreamRequest(9, 0, flat(stream[:, f:f + 1]), offset(f)), decoder) for f in range(1, 4)]
        await asyncio.gather(*resumes, *live)
        assert decoder.replay_starts_beside_live and all(count == 1 for count in decoder.replay_starts_beside_live), \
            decoder.replay_starts_beside_live
        live_done = max(i for i, (event, cid) in enumerate(decoder.events) if event == "end" and cid == 9)
        last_replay = max(i for i, (event, cid) in enumerate(decoder.events) if event == "end" and cid != 9)
        assert live_done < last_replay

        quiet, decoder = make_table(decoder_max_frames_per_step=2), Counting()
        await asyncio.gather(*(quiet.submit(StreamRequest(cid, START, flat(stream[:, :8]), offset(0), offset(8)),
                                            decoder) for cid in (1, 2, 3, 4)))
        assert decoder.most_replay_in_flight == 4

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "frames, frame_offset, history_frames, fragments",
    [
        pytest.param(3, 5, 4, ["history_frames=4 must lie in [0, 3]: the request holds 3 frames"], id="more-than-F"),
        pytest.param(3, 5, -1, ["history_frames=-1 must lie in [0, 3]"], id="negative"),
        pytest.param(3, None, 2, ["history_frames=2 needs frame_offset, the stream index of the request's first frame"],
                     id="no-offset"),
    ],
)
def test_bad_history_frames_are_refused_naming_the_values(frames, frame_offset, history_frames, fragments):
    table, decoder = make_table(), FakeDecoder()
    error = send_error(table, decoder, 1, START, make_codes(frames), frame_offset=frame_offset,
                       history_frames=history_frames)
    assert (error.kind, error.code) == ("history", "INVALID_ARG")
    for fragment in fragments:
        assert fragment in str(error)
    assert decoder.calls == [] and not is_live(table, 1)


def test_history_frames_dtype_and_shape_are_checked():
    table, decoder = make_table(), FakeDecoder()
    for value, kind, fragment in ((np.array([[2]], np.int32), "dtype", "history_frames must be INT64, got int32"),
                                  (np.array([[1, 2]], np.int64), "shape", "history_frames must hold one value")):
        request = StreamRequest(1, START, flat(make_codes(3)), offset(0), value)
        with pytest.raises(RequestError) as info:
            asyncio.run(table.process(request, decoder))
        assert info.value.kind == kind and fragment in str(info.value)


def test_a_negative_offset_with_history_is_refused():
    table, decoder = make_table(), FakeDecoder()
    error = send_error(table, decoder, 1, START, make_codes(3), frame_offset=-2, history_frames=1)
    assert error.kind == "negative_offset" and "frame_offset must be >= 0, got -2" in str(error)


def test_history_only_resume_returns_no_samples_and_the_next_request_goes_on():
    table, decoder = make_table(), FakeDecoder()
    stream = make_codes(9)
    pcm = resume(table, decoder, 1, stream[:, 3:7], first_frame=3, history_frames=4)
    assert pcm.shape == (1, 0) and pcm.dtype == np.float32
    assert len(decoder.calls) == 4 and decoder.flags()[0] == START
    pcm = send(table, decoder, 1, 0, stream[:, 7:9], frame_offset=7)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 7:9]))


def test_resume_without_history_starts_the_stream_at_its_offset():
    table, decoder = make_table(), FakeDecoder()
    stream = make_codes(9)
    pcm = resume(table, decoder, 1, stream[:, 5:7], first_frame=5, history_frames=0)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 5:7]))
    assert base_of(table, 1) == 5 and decoder.flags() == [START, 0]
    # history_frames=0 without frame_offset is a plain START.
    pcm = resume(table, decoder, 2, stream[:, :2], first_frame=None, history_frames=0)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, :2]))
    assert base_of(table, 2) == 0


def test_barge_in_with_history_restarts_a_live_stream_at_the_resume_point():
    table, decoder = make_table(), FakeDecoder()
    old, stream = make_codes(5, seed=1), make_codes(12, seed=2)
    open_stream(table, decoder, 1, old)
    decoder.calls.clear()
    pcm = resume(table, decoder, 1, stream[:, 6:10], first_frame=6, history_frames=3)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 9:10]))
    assert decoder.flags() == [START, 0, 0, 0]
    assert base_of(table, 1) == 6 and table.stats().live_streams == 1
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, 6:10])
    pcm = send(table, decoder, 1, 0, stream[:, 10:12], frame_offset=10)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 10:12]))


def test_a_plain_start_after_a_resume_starts_over_at_frame_zero():
    table, decoder = make_table(), FakeDecoder()
    stream = make_codes(12)
    resume(table, decoder, 1, stream[:, 6:10], first_frame=6, history_frames=3)
    send(table, decoder, 1, START, stream[:, :2], frame_offset=0)
    assert base_of(table, 1) == 0
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, :2])


def test_a_rejected_resume_leaves_the_live_stream_as_it_was():
    table, decoder = make_table(), FakeDecoder()
    stream = make_codes(8)
    open_stream(table, decoder, 1, stream[:, :3])
    send_error(table, decoder, 1, START, stream[:, 2:5], frame_offset=2, history_frames=4)
    np.testing.assert_array_equal(decoded_of(table, 1), stream[:, :3])
    assert base_of(table, 1) == 0
    pcm = send(table, decoder, 1, 0, stream[:, 3:5], frame_offset=3)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 3:5]))


def test_start_end_with_history_decodes_returns_the_new_frames_and_closes():
    table, decoder = make_table(), FakeDecoder()
    stream = make_codes(6)
    pcm = resume(table, decoder, 1, stream[:, 2:6], first_frame=2, history_frames=2, flags=START | END)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 4:6]))
    assert decoder.flags() == [START, 0, 0, END] and not is_live(table, 1)


def test_history_frames_count_toward_the_decoded_frames_limit():
    table, decoder = make_table(max_new_frames_per_request=4), FakeDecoder()
    stream = make_codes(10)
    error = send_error(table, decoder, 1, START, stream[:, 3:8], frame_offset=3, history_frames=3)
    assert error.kind == "limit"
    assert str(error) == (
        "request decodes 5 frames (3 history_frames + 2 new), more than max_new_frames_per_request=4"
    )
    pcm = resume(table, decoder, 1, stream[:, 3:7], first_frame=3, history_frames=3)
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 6:7]))


@pytest.mark.parametrize("mode", ["delta", "auto"])
def test_requests_without_offsets_after_a_resume_are_deltas_or_count_from_the_base(mode):
    table, decoder = make_table(dedupe_mode=mode), FakeDecoder()
    stream = make_codes(14)
    resume(table, decoder, 1, stream[:, 6:10], first_frame=6, history_frames=2)
    pcm = send(table, decoder, 1, 0, stream[:, 10:12])  # a delta
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 10:12]))
    # A cumulative resend counts from the base: auto decodes only its suffix, delta decodes it all.
    pcm = send(table, decoder, 1, 0, stream[:, 6:14])
    expected = stream[:, 12:14] if mode == "auto" else stream[:, 6:14]
    np.testing.assert_array_equal(pcm, expected_pcm(expected))


def test_cumulative_requests_of_a_resumed_stream_start_at_its_base():
    table, decoder = make_table(dedupe_mode="cumulative"), FakeDecoder()
    stream = make_codes(14)
    resume(table, decoder, 1, stream[:, 6:10], first_frame=6, history_frames=2)
    pcm = send(table, decoder, 1, 0, stream[:, 6:12])
    np.testing.assert_array_equal(pcm, expected_pcm(stream[:, 10:12]))
    error = send_error(table, decoder, 1, 0, stream[:, 8:13])
    assert error.kind == "not_cumulative"
    assert ("the request holds 5 frames but stream 1 has decoded 6 since frame 6, where it was resumed on this "
            "server; a cumulative request starts with all of them") in str(error)
    error = send_error(table, decoder, 1, 0, stream[:, :12])
    assert error.kind == "changed_frame" and "frame 6 differs" in str(error)


def test_stats_count_resumed_streams_and_their_history_frames():
    table, decoder = make_table(), FakeDecoder()
    stream = make_codes(10)
    resume(table, decoder, 1, stream[:, 4:8], first_frame=4, history_frames=3)
    send(table, decoder, 2, START, stream[:, :2])
    stats = table.stats()
    assert stats.streams_resumed == 1
    assert stats.frames_decoded == 4 + 2  # the decoder ran the history frames too
