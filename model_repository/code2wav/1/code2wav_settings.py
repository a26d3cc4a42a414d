"""code2wav's settings (each parameter is described in its config.pbtxt), sequence flags and request errors:
what every other core module shares. Pure stdlib."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from model_errors import IDLE_TIMEOUT_FIELD, ConfigError, ModelError, read_parameters

# Same values as pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END (Triton's C API).
FLAG_SEQUENCE_START = 1
FLAG_SEQUENCE_END = 2

DEDUPE_MODES = ("auto", "delta", "cumulative")

# Every kind an error can be counted under (the `kind` label of code2wav_errors_total).
ERROR_KINDS = (
    "dtype", "shape", "length", "code_range", "limit", "negative_offset", "gap", "changed_frame", "not_cumulative",
    "history", "history_offset", "before_resume", "correlation_id", "unknown_stream", "stream_cap", "unavailable", "decoder", "internal",
)

INT32_MAX = 2**31 - 1


class RequestError(ModelError):
    """The request is invalid (the client's fault); nothing was decoded and the stream is unchanged."""

    def __init__(self, kind: str, message: str):
        super().__init__(kind, message, "INVALID_ARG")


class DecoderError(ModelError):
    """A decoder step failed: `decoder` / INTERNAL, or UNAVAILABLE (may retry) as `stream_cap` or `unavailable`."""

    def __init__(self, message: str, code: str = "INTERNAL", kind: str = "decoder"):
        super().__init__(kind, message, code)


@dataclasses.dataclass(frozen=True)
class Code2WavSettings:
    """Everything the core needs from the model config: one field per parameter (same name) and the
    idle timeout. The defaults are those of model_repository/code2wav/config.pbtxt (a test keeps them equal)."""

    decoder_model_name: str = "mimi_decoder"
    num_codebooks: int = 8
    codebook_size: int = 2048
    samples_per_frame: int = 1920
    sample_rate_hz: int = 24000
    decoder_max_frames_per_step: int = 16
    dedupe_mode: str = "delta"
    max_new_frames_per_request: int = 1500
    max_request_frames: int = 45000
    max_live_streams: int = 1024
    replay_steps_in_flight: int = 1
    replay_step_frames: int = 4
    stream_idle_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.decoder_model_name, str) or not self.decoder_model_name.strip():
            raise ConfigError("decoder_model_name", "must be a non-empty model name")
        for name, parse in PARAMETER_TYPES.items():
            value = getattr(self, name)
            if parse is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        # The decoder takes int32 codes.
        if self.codebook_size > INT32_MAX:
            raise ConfigError("codebook_size", f"must be at most {INT32_MAX}, got {self.codebook_size}")
        if self.dedupe_mode not in DEDUPE_MODES:
            raise ConfigError("dedupe_mode", f"must be one of {', '.join(DEDUPE_MODES)}, got {self.dedupe_mode!r}")
        if not self.stream_idle_timeout_s > 0:
            raise ConfigError(IDLE_TIMEOUT_FIELD, f"must be positive, got {self.stream_idle_timeout_s!r}")


# The config's `parameters`, name -> parser: every field but the idle timeout (sequence_batching's).
PARAMETER_TYPES = {
    field.name: {"int": int, "str": str}[field.type]
    for field in dataclasses.fields(Code2WavSettings)
    if field.name != "stream_idle_timeout_s"
}


def settings_from_config(config: Mapping) -> Code2WavSettings:
    """The settings of a model config (Triton's JSON, parsed); raises ConfigError naming the parameter."""
    values, idle_timeout_s = read_parameters(config, PARAMETER_TYPES)
    return Code2WavSettings(stream_idle_timeout_s=idle_timeout_s, **values)
