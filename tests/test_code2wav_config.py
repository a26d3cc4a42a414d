"""code2wav's config: model_repository/code2wav/config.pbtxt, served as it is (the compose services, a
plain copy) and, with the decoder's values set in it, rendered; read by the core as its default settings."""

from __future__ import annotations

import dataclasses

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from mimi_code2wav.export.onnx_export import ExportOptions
from mimi_code2wav.export.pipeline import spec_for_options
from mimi_code2wav.export.render import (
    CHECKED_IN_CODE2WAV_CONFIG,
    CODE2WAV_IDLE_TIMEOUT_US,
    CODE2WAV_SLOTS_PER_STREAM,
    DecoderServing,
    render_code2wav_config,
    set_fields,
)

from helpers import MODEL_REPOSITORY, load_model_module

code2wav_settings = load_model_module(MODEL_REPOSITORY / "code2wav" / "1" / "code2wav_settings.py")


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


@pytest.fixture(scope="module")
def default_spec():
    return spec_for_options(ExportOptions())


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


def test_the_checked_in_config_is_the_default_rendering_and_gives_the_core_its_default_settings(default_spec):
    """What code2wav's initialize reads (the JSON form Triton hands it, uint64 fields as strings) are the
    core's default settings; the idle timeout is the one render reads, below the decoder's; the sequence
    controls and the tensors are those the model reads."""
    assert CHECKED_IN_CODE2WAV_CONFIG.read_text() == render_code2wav_config(default_spec), (
        "model_repository/code2wav/config.pbtxt disagrees with the default export and render options")
    config = parse(CHECKED_IN_CODE2WAV_CONFIG.read_text())
    assert set(config.parameters) == set(code2wav_settings.PARAMETER_TYPES)
    settings = code2wav_settings.settings_from_config(json_format.MessageToDict(config, preserving_proto_field_name=True))
    assert settings == code2wav_settings.Code2WavSettings()
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
