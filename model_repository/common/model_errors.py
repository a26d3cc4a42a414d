"""How the Python models refuse a request (`ModelError`) or a config (`ConfigError`, from the strict
`read_parameters`). Pure stdlib (Python 3.10), copied beside each Python model's model.py by render."""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, Mapping, Tuple

# The names of pb_utils.TritonError's codes; model.py turns one into the code with getattr.
TRITON_ERROR_CODES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS",
                      "CANCELLED")


class ModelError(Exception):
    """One request failed: `kind` is the label it is counted and tagged under, `code` its TritonError code
    (INVALID_ARG for the client's fault, INTERNAL for the server's)."""

    def __init__(self, kind: str, message: str, code: str = "INVALID_ARG"):
        if code not in TRITON_ERROR_CODES:
            raise ValueError(f"error code {code!r} is not one of {', '.join(TRITON_ERROR_CODES)}")
        super().__init__(message)
        self.kind = kind
        self.code = code


def error_code(exc: BaseException) -> str:
    """A failed request's TritonError code name: a ModelError's own, else INTERNAL (a bug)."""
    return exc.code if isinstance(exc, ModelError) else "INTERNAL"


def error_kind(exc: BaseException) -> str:
    return exc.kind if isinstance(exc, ModelError) else "internal"


def tagged_message(model_name: str, exc: BaseException) -> str:
    """`[MODEL.KIND] text`: the tag is the contract clients act on (docs/design.md §2), the text may change."""
    return f"[{model_name}.{error_kind(exc)}] {exc}"


IDLE_TIMEOUT_FIELD = "sequence_batching.max_sequence_idle_microseconds"

# How a failed parse of the plain types (and "not valid JSON") reads; other parsers' ValueErrors carry their own message.
_PARSE_FAILURES = {int: "not an integer", float: "not a number"}


class ConfigError(ValueError):
    """A missing or invalid model-config value; `parameter` names it (and the message starts with it)."""

    def __init__(self, parameter: str, message: str):
        super().__init__(f"parameter '{parameter}': {message}")
        self.parameter = parameter


def read_parameters(
    config: Mapping[str, Any], schema: Mapping[str, Callable[[str], Any]]
) -> Tuple[Dict[str, Any], float]:
    """(values by name, idle timeout in s) of a model config, each parameter's stripped string parsed by
    `schema[name]`. Strict, so a typo fails the load: all of `schema` required, no other, a positive idle timeout."""
    parameters = config.get("parameters") or {}
    unknown = sorted(set(parameters) - set(schema))
    if unknown:
        raise ConfigError(unknown[0], f"unknown parameter (known: {', '.join(schema)})")
    values = {}
    for name, parse in schema.items():
        if name not in parameters:
            raise ConfigError(name, "missing from the model config's parameters")
        entry = parameters[name]
        text = entry.get("string_value") if isinstance(entry, Mapping) else None
        if not isinstance(text, str):
            raise ConfigError(name, f"expected a string_value, got {entry!r}")
        try:
            values[name] = parse(text.strip())
        except ValueError as exc:
            failure = "not valid JSON" if isinstance(exc, json.JSONDecodeError) else _PARSE_FAILURES.get(parse)
            raise ConfigError(name, f"{failure}: {text!r}" if failure else str(exc)) from None

    idle_us = (config.get("sequence_batching") or {}).get("max_sequence_idle_microseconds")
    if idle_us is None:
        raise ConfigError(IDLE_TIMEOUT_FIELD, "missing: set it explicitly (Triton's default is 1 s)")
    try:
        idle_us = int(idle_us)  # Triton's config JSON carries uint64 fields as strings
    except (TypeError, ValueError):
        raise ConfigError(IDLE_TIMEOUT_FIELD, f"not an integer: {idle_us!r}") from None
    if idle_us <= 0:
        raise ConfigError(IDLE_TIMEOUT_FIELD, f"must be positive, got {idle_us} (0 means Triton's 1 s default)")
    return values, idle_us / 1e6
