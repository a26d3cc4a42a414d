"""Custom metrics of the Python models: the labels every metric carries (`metric_labels`), values
sent as changes so that instances add up (`DeltaMetric`), and a guard that keeps metrics from ever
failing a request (`GuardedMetrics`).

`export/render.py` copies model_repository/common/ beside each Python model's `model.py`, which imports
these files as siblings. Pure stdlib: unit-tested without a server, and runs on the NGC image's Python 3.10.
"""

from __future__ import annotations

from typing import Any, Callable, Dict


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

    def __init__(self, model_name: str, version: str, create: Callable[[Dict[str, str]], Any],
                 log_warn: Callable[[str], None]):
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
