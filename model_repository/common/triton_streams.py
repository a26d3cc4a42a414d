"""What the two Python-backend models share: idle expiry, request errors, the config-parameter policy
and metrics (labels, changes, a guard that keeps them from failing a request).

Not a model: Triton never loads this folder. `export/render.py` copies this file beside each Python
model's `model.py` in a rendered repository (`code2wav/1/` and the python-ort `mimi_decoder/1/`),
and the models import it as a sibling (`import triton_streams`). It is tracked once, here.

Pure stdlib, no `triton_python_backend_utils` or numpy: unit-tested without a server, and runs on the
NGC image's Python 3.10.
"""

from __future__ import annotations

import json
import threading
import traceback
from typing import Any, Callable, Dict, Mapping, Tuple

# --------------------------------------------------------------------------------------------------
# Request errors

# The names of pb_utils.TritonError's codes; model.py turns one into the code with getattr.
TRITON_ERROR_CODES = (
    "UNKNOWN",
    "INTERNAL",
    "NOT_FOUND",
    "INVALID_ARG",
    "UNAVAILABLE",
    "UNSUPPORTED",
    "ALREADY_EXISTS",
    "CANCELLED",
)


class ModelError(Exception):
    """One request failed. `kind` is the short label it is counted and logged under; `code` names the
    pb_utils.TritonError code its response carries: INVALID_ARG for the client's fault, INTERNAL for
    the server's."""

    def __init__(self, kind: str, message: str, code: str = "INVALID_ARG"):
        if code not in TRITON_ERROR_CODES:
            raise ValueError(f"error code {code!r} is not one of {', '.join(TRITON_ERROR_CODES)}")
        super().__init__(message)
        self.kind = kind
        self.code = code


def error_code(exc: BaseException) -> str:
    """The TritonError code name of a failed request: a ModelError's own, else INTERNAL (a bug)."""
    return exc.code if isinstance(exc, ModelError) else "INTERNAL"


# --------------------------------------------------------------------------------------------------
# Config parameters

IDLE_TIMEOUT_FIELD = "sequence_batching.max_sequence_idle_microseconds"

# How a failed parse of the plain types reads; other parsers raise ValueError with their own message.
_PARSE_FAILURES = {int: "not an integer", float: "not a number", json.loads: "not valid JSON"}


class ConfigError(ValueError):
    """A missing or invalid model-config value; `parameter` names it (and the message starts with it)."""

    def __init__(self, parameter: str, message: str):
        super().__init__(f"parameter '{parameter}': {message}")
        self.parameter = parameter


def read_parameters(
    config: Mapping[str, Any], schema: Mapping[str, Callable[[str], Any]]
) -> Tuple[Dict[str, Any], float]:
    """Read a model config (the JSON Triton hands to `initialize`, parsed) against `schema`
    (parameter name -> parser of its stripped string value: str, int, float, json.loads, or any
    callable raising ValueError). Returns (values by name, idle timeout in seconds).

    Every parameter of the schema is required and no other is accepted, so a typo fails the load
    instead of running on a default; so is a positive `max_sequence_idle_microseconds`, since Triton
    would silently take 1 s. Raises ConfigError naming the parameter.
    """
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
            failure = _PARSE_FAILURES.get(parse)
            raise ConfigError(name, f"{failure}: {text!r}" if failure else str(exc)) from None

    idle_us = (config.get("sequence_batching") or {}).get("max_sequence_idle_microseconds")
    if idle_us is None:
        raise ConfigError(IDLE_TIMEOUT_FIELD, "missing: set it explicitly (Triton's default is 1 s)")
    try:
        # Triton's config JSON carries uint64 fields as strings.
        idle_us = int(idle_us)
    except (TypeError, ValueError):
        raise ConfigError(IDLE_TIMEOUT_FIELD, f"not an integer: {idle_us!r}") from None
    if idle_us <= 0:
        raise ConfigError(IDLE_TIMEOUT_FIELD, f"must be positive, got {idle_us} (0 means Triton's 1 s default)")
    return values, idle_us / 1e6


# --------------------------------------------------------------------------------------------------
# Idle expiry


def sweep_interval_s(idle_timeout_s: float) -> float:
    """How often to look for idle streams: a quarter of the timeout, within [50 ms, 1 s]."""
    return min(max(idle_timeout_s / 4, 0.05), 1.0)


class IdleSweeper:
    """Calls `expire()` every `sweep_interval_s(idle_timeout_s)` on a background thread, under `lock`.

    Triton drops an idle sequence without telling the model, so a model expires its own streams; this
    thread does it when no request comes, so their memory (and the live-streams gauge) does not wait
    for traffic. The model's execute holds `lock` while it touches its stream table: the sweeper is
    the only other user (an instance runs one execute at a time).
    """

    def __init__(
        self,
        idle_timeout_s: float,
        expire: Callable[[], object],
        name: str,
        log_error: Callable[[str], None] = lambda message: None,
    ):
        self.lock = threading.Lock()
        self.interval_s = sweep_interval_s(idle_timeout_s)
        self._expire = expire
        self._log_error = log_error
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @classmethod
    def started(
        cls,
        model_name: str,
        idle_timeout_s: float,
        expire: Callable[[], object],
        log_error: Callable[[str], None],
    ) -> IdleSweeper:
        """A model instance's sweeper, already running on a thread named `<model_name>-idle-expiry`."""
        sweeper = cls(idle_timeout_s, expire, name=f"{model_name}-idle-expiry", log_error=log_error)
        sweeper.start()
        return sweeper

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread and wait for it at most `timeout_s`; returns whether it has ended."""
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def close(self, log_warn: Callable[[str], None], timeout_s: float = 5.0) -> None:
        """Stop the thread (a model's finalize); a thread still running after `timeout_s` is logged."""
        if not self.stop(timeout_s):
            log_warn(f"{self._thread.name}: the idle sweeper did not stop in {timeout_s:g} s")

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            with self.lock:
                try:
                    self._expire()
                except Exception:  # the thread must outlive one failed sweep
                    self._log_error(f"{self._thread.name}: idle expiry failed:\n{traceback.format_exc()}")


# --------------------------------------------------------------------------------------------------
# Metrics


def metric_labels(model_name: str, version: str) -> Dict[str, str]:
    """The labels of every custom metric of a model: all its instances share one series."""
    return {"model": model_name, "version": str(version)}


class DeltaMetric:
    """A Triton gauge or counter (anything with `increment`) fed with one instance's absolute value
    and sent as changes, so that the instances of a model add up in their shared series."""

    __slots__ = ("metric", "sent")

    def __init__(self, metric: Any):
        self.metric = metric
        self.sent = 0

    def update(self, value: float) -> None:
        if value != self.sent:
            self.metric.increment(value - self.sent)
            self.sent = value

    def withdraw(self) -> None:
        """Take this instance's contribution out of a gauge (on finalize)."""
        self.update(0)


class GuardedMetrics:
    """A model instance's custom metrics, which never fail a request: `create(labels)` makes them with
    the model's `metric_labels` (a server without metrics support raises there: the model then runs
    without them), `report(update)` calls `update(metrics)`, and the first failure of either is
    logged through `log_warn` and turns them off. `close()` calls the metrics' own `close()`."""

    def __init__(
        self, model_name: str, version: str, create: Callable[[Dict[str, str]], Any], log_warn: Callable[[str], None]
    ):
        self._model_name = model_name
        self._log_warn = log_warn
        self.metrics = None
        try:
            self.metrics = create(metric_labels(model_name, version))
        except Exception as exc:
            log_warn(f"model '{model_name}': custom metrics unavailable ({exc})")

    def report(self, update: Callable[[Any], object]) -> None:
        if self.metrics is None:
            return
        try:
            update(self.metrics)
        except Exception as exc:
            self._log_warn(f"model '{self._model_name}': custom metrics failed, now off ({exc})")
            self.metrics = None

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
