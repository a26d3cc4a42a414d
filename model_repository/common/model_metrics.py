"""Custom metrics of the Python models: each declares its `Family`s and `ModelMetrics` makes and fills
them, never failing a request. Pure stdlib (Python 3.10), copied beside each Python model's model.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


class DeltaMetric:
    """A Triton gauge or counter fed with one instance's absolute value, sent as changes: instances add up."""

    def __init__(self, metric: Any):
        self.metric, self.sent = metric, 0

    def update(self, value: float) -> None:
        if value != self.sent:
            self.metric.increment(value - self.sent)
            self.sent = value


@dataclass(frozen=True)
class Family:
    """`kind`: GAUGE, COUNTER or HISTOGRAM. `field`: the stats attribute that fills it: a number, with `label` a
    mapping label value -> number (`label_values` exist at 0 from the load), a HISTOGRAM's list `report` empties."""

    name: str
    kind: str
    description: str
    field: str
    label: str | None = None
    label_values: Sequence[str] = ()
    buckets: Sequence[float] = ()


class ModelMetrics:
    """A model instance's metrics, made with `metric_family` (pb_utils.MetricFamily), labelled by model and
    version (all instances share one series). A failure to make them (no metrics support) or to report is
    logged once and turns them off. `close()` (finalize) takes the instance's gauges out of their series."""

    def __init__(self, families: Sequence[Family], model_name: str, version: str, metric_family: Any,
                 log_warn: Callable[[str], None]):
        self._model_name, self._log_warn = model_name, log_warn
        self._labels = {"model": model_name, "version": str(version)}
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
                        delta.update(0)
        except Exception as exc:
            self._log_warn(f"model '{self._model_name}': custom metrics not withdrawn ({exc})")
        self._off()

    def _off(self, why: str = "") -> None:
        if why:
            self._log_warn(f"model '{self._model_name}': {why}")
        # Metrics go before their families (python_backend custom-metrics contract).
        self._series, self._families = [], []
