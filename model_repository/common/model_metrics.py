"""Custom metrics of the Python models: a model declares its metric families (`Family`: name, kind,
help, the stats field that fills it) and `ModelMetrics` makes and fills them, labelled with
`metric_labels`, gauges and counters sent as changes so that instances add up (`DeltaMetric`), and
never failing a request.

`export/render.py` copies model_repository/common/ beside each Python model's `model.py`, which imports
these files as siblings. Pure stdlib: unit-tested without a server, and runs on the NGC image's Python 3.10.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Sequence


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


@dataclass(frozen=True)
class Family:
    """One metric family of a model. `kind` is GAUGE, COUNTER or HISTOGRAM; `field` names the attribute
    of the stats object given to `ModelMetrics.report` that fills it: a number, or with `label` a
    mapping label value -> number (one series each; those of `label_values` exist from the load, at 0),
    or for a HISTOGRAM a list of new observations, which `report` empties."""

    name: str
    kind: str
    description: str
    field: str
    label: str | None = None
    label_values: Sequence[str] = ()
    buckets: Sequence[float] = ()


class ModelMetrics:
    """A model instance's custom metrics, made from `families` with `metric_family` (pb_utils.MetricFamily).
    They never fail a request: a failure to make them (a server without metrics support) or to report is
    logged once through `log_warn` and turns them off. `close()` (finalize) takes the instance's gauges
    out of their shared series."""

    def __init__(self, families: Sequence[Family], model_name: str, version: str, metric_family: Any,
                 log_warn: Callable[[str], None]):
        self._model_name, self._log_warn = model_name, log_warn
        self._labels = metric_labels(model_name, version)
        # The families must outlive their metrics: a metric of a collected family stops working.
        self._families: list = []
        self._series: list = []  # (Family, its family object, DeltaMetric | {label value: DeltaMetric} | histogram)
        try:
            for family in families:
                made = metric_family(name=family.name, description=family.description,
                                     kind=getattr(metric_family, family.kind))
                self._families.append(made)
                if family.kind == "HISTOGRAM":
                    series = made.Metric(labels=self._labels, buckets=list(family.buckets))
                elif family.label:
                    series = {value: self._labelled(made, family, value) for value in family.label_values}
                else:
                    series = DeltaMetric(made.Metric(labels=self._labels))
                self._series.append((family, made, series))
        except Exception as exc:
            self._off(f"custom metrics unavailable ({exc})")

    @property
    def on(self) -> bool:
        return bool(self._series)

    def _labelled(self, made: Any, family: Family, value: str) -> DeltaMetric:
        return DeltaMetric(made.Metric(labels={**self._labels, family.label: value}))

    def report(self, stats: Any) -> None:
        """Fill every family from `stats` (see `Family.field`)."""
        try:
            for family, made, series in self._series:
                value = getattr(stats, family.field)
                if family.kind == "HISTOGRAM":
                    for observation in value:
                        series.observe(observation)
                    value.clear()
                elif family.label:
                    for label_value, number in value.items():
                        if label_value not in series:
                            series[label_value] = self._labelled(made, family, label_value)
                        series[label_value].update(number)
                else:
                    series.update(value)
        except Exception as exc:
            self._off(f"custom metrics failed, now off ({exc})")

    def close(self) -> None:
        try:
            for family, _, series in self._series:
                if family.kind == "GAUGE":
                    for delta in series.values() if family.label else (series,):
                        delta.withdraw()
        except Exception as exc:
            self._log_warn(f"model '{self._model_name}': custom metrics not withdrawn ({exc})")
        self._off()

    def _off(self, why: str = "") -> None:
        if why:
            self._log_warn(f"model '{self._model_name}': {why}")
        # Metrics go before their families (python_backend custom-metrics contract).
        self._series = []
        self._families = []
