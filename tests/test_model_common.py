"""Unit tests of model_repository/common/, the files the Python models share (no server)."""

import faulthandler
import gc
import json
import threading
import time
import weakref
from types import SimpleNamespace as Stats

import pytest

from helpers import MODEL_REPOSITORY, load_model_module, triton_model_config

# Imported by name, as the models import it where render places it beside them.
idle_sweeper = load_model_module(MODEL_REPOSITORY / "common" / "idle_sweeper.py")
model_errors = load_model_module(MODEL_REPOSITORY / "common" / "model_errors.py")
model_metrics = load_model_module(MODEL_REPOSITORY / "common" / "model_metrics.py")
model_lifecycle = load_model_module(MODEL_REPOSITORY / "common" / "model_lifecycle.py")

# ---- idle sweeper --------------------------------------------------------------------------------

def test_sweep_interval_is_a_quarter_of_the_timeout_within_bounds():
    sweepers = [idle_sweeper.IdleSweeper("idle", timeout_s, lambda: None, pytest.fail) for timeout_s in (2.0, 0.1, 30.0)]
    assert [sweeper.interval_s for sweeper in sweepers] == [0.5, 0.05, 1.0]
    assert all(sweeper.close(pytest.fail) for sweeper in sweepers)


def test_sweeper_expires_on_its_own_under_the_lock_survives_a_failing_expiry_and_stops_promptly():
    calls, held, logged, swept = [], [], [], threading.Event()

    def expire():
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("boom")  # logged; the next sweeps go on
        held.append(sweeper.lock.locked())
        if len(calls) >= 3:
            swept.set()

    sweeper = idle_sweeper.IdleSweeper("test", 0.2, expire, logged.append)  # every 50 ms, at once
    try:
        assert swept.wait(5), "the sweeper never called expire() again"
        with sweeper.lock:  # as execute holds it: no sweep runs
            count = len(calls)
            time.sleep(0.2)
            assert len(calls) == count
    finally:
        started = time.monotonic()
        sweeper.close(log_warn=pytest.fail, timeout_s=60.0)  # returns when the thread has stopped, not after the timeout
        assert time.monotonic() - started < 30 and not sweeper._thread.is_alive()
    assert all(held)
    assert len(logged) == 1 and "test-idle-expiry: idle expiry failed" in logged[0] and "RuntimeError: boom" in logged[0]
    count = len(calls)
    time.sleep(0.15)
    assert len(calls) == count


def test_a_started_sweeper_is_named_after_its_model_and_warns_when_stuck_at_close():
    release, entered, warnings = threading.Event(), threading.Event(), []

    def stuck():
        entered.set()
        release.wait(5)

    sweeper = idle_sweeper.IdleSweeper("mimi_decoder", 0.2, stuck, pytest.fail)
    assert entered.wait(5)
    assert not sweeper.close(warnings.append, timeout_s=0.1)
    release.set()
    assert warnings == ["mimi_decoder-idle-expiry: the idle sweeper did not stop in 0.1 s"]
    assert sweeper.close(pytest.fail, timeout_s=5)


# ---- parameter policy ----------------------------------------------------------------------------

def positive(text):  # a parser of its own, which words its error
    if int(text) <= 0:
        raise ValueError(f"must be positive, got {text}")
    return int(text)


SCHEMA = {"name": str, "count": int, "ratio": float, "table": json.loads, "size": positive}


def model_config(idle_us="30000000", **parameters):
    values = {"name": " decoder ", "count": "3", "ratio": "0.5", "table": '{"a": [0, 2]}', "size": "2"}
    return triton_model_config({**values, **parameters}, idle_us)


def test_parameters_are_parsed_by_type():
    values, idle_timeout_s = model_errors.read_parameters(model_config(), SCHEMA)
    assert values == {"name": "decoder", "count": 3, "ratio": 0.5, "table": {"a": [0, 2]}, "size": 2}
    assert idle_timeout_s == 30.0
    # Triton's JSON gives uint64 fields as strings; an int works as well.
    assert model_errors.read_parameters(model_config(idle_us=2_000_000), SCHEMA)[1] == 2.0


@pytest.mark.parametrize("config, parameter, message", [
    pytest.param(model_config(count=None), "count", "missing from the model config's parameters", id="missing"),
    pytest.param(model_config(cuont="3"), "cuont", "unknown parameter (known: name, count, ratio, table, size)", id="unknown"),
    pytest.param(model_config(count="3x"), "count", "not an integer: '3x'", id="not-int"),
    pytest.param(model_config(ratio="half"), "ratio", "not a number: 'half'", id="not-float"),
    pytest.param(model_config(table="{a"), "table", "not valid JSON: '{a'", id="not-json"),
    pytest.param({**model_config(), "parameters": {**model_config()["parameters"], "count": {"int_value": 3}}}, "count", "expected a string_value, got {'int_value': 3}", id="not-string"),
    pytest.param(model_config(idle_us=None), model_errors.IDLE_TIMEOUT_FIELD, "missing: set it explicitly (Triton's default is 1 s)", id="idle-missing"),
    pytest.param(model_config(idle_us="0"), model_errors.IDLE_TIMEOUT_FIELD, "must be positive, got 0 (0 means Triton's 1 s default)", id="idle-zero"),
    pytest.param(model_config(idle_us="soon"), model_errors.IDLE_TIMEOUT_FIELD, "not an integer: 'soon'", id="idle-not-int"),
    pytest.param(model_config(size="-1"), "size", "must be positive, got -1", id="own-parser"),
])
def test_bad_parameters_fail_naming_the_parameter(config, parameter, message):
    with pytest.raises(model_errors.ConfigError) as info:
        model_errors.read_parameters(config, SCHEMA)
    assert info.value.parameter == parameter and str(info.value) == f"parameter '{parameter}': {message}"


# ---- errors, metrics and lifecycle hooks ----------------------------------------------------------

def test_model_errors_carry_a_kind_and_a_triton_error_code_name():
    client = model_errors.ModelError("shape", "input 'codes' has shape [2]")
    assert client.kind == "shape" and client.code == "INVALID_ARG" and str(client) == "input 'codes' has shape [2]"
    server = model_errors.ModelError("decoder", "step failed", "INTERNAL")
    codes = [model_errors.error_code(error) for error in (client, server, KeyError("bug"))]
    assert codes == ["INVALID_ARG", "INTERNAL", "INTERNAL"]
    with pytest.raises(ValueError, match="error code 'BAD_REQUEST' is not one of UNKNOWN, INTERNAL"):
        model_errors.ModelError("shape", "message", "BAD_REQUEST")


class FakeMetric:  # a series of pb_utils' metrics
    def __init__(self, labels=None, buckets=None):
        self.labels, self.buckets, self.observations, self.value = labels, buckets, [], 0

    def increment(self, delta):
        self.value += delta

    def observe(self, value):
        self.observations.append(value)


def test_delta_metrics_of_two_instances_add_up_and_withdraw():
    shared = FakeMetric()  # one series: same name and labels
    first, second = model_metrics.DeltaMetric(shared), model_metrics.DeltaMetric(shared)
    first.update(3)
    second.update(2)
    first.update(1)
    assert shared.value == 3
    first.update(0)  # withdrawn
    assert shared.value == 2 and first.sent == 0


def fake_metric_family(made):
    """A stand-in for pb_utils.MetricFamily that records every family it makes in `made` (name -> family)."""

    class FakeMetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            self.description, self.kind, self.series = description, kind, []
            made[name] = self

        def Metric(self, labels, buckets=None):  # pb_utils' name
            self.series.append(FakeMetric(labels, buckets))
            return self.series[-1]

    return FakeMetricFamily


FAMILIES = (
    model_metrics.Family("live", "GAUGE", "Live streams", "live"),
    model_metrics.Family("done_total", "COUNTER", "Frames", "done"),
    model_metrics.Family("errors_total", "COUNTER", "Errors by kind", "errors", label="kind", label_values=("a", "b")),
    model_metrics.Family("sizes", "HISTOGRAM", "Batch sizes", "sizes", buckets=(1, 2, 4)),
)


def test_model_metrics_fill_their_families_from_the_stats_and_withdraw_gauges():
    made, warnings = {}, []
    metrics = model_metrics.ModelMetrics(FAMILIES, "decoder", 1, fake_metric_family(made), warnings.append)
    labels = {"model": "decoder", "version": "1"}  # every instance's series
    assert {name: (family.kind, family.description) for name, family in made.items()} == {
        "live": ("gauge", "Live streams"), "done_total": ("counter", "Frames"),
        "errors_total": ("counter", "Errors by kind"), "sizes": ("histogram", "Batch sizes")}
    # The labelled family's declared series exist from the load, at 0.
    assert [series.labels for series in made["errors_total"].series] == [{**labels, "kind": "a"}, {**labels, "kind": "b"}]
    assert made["sizes"].series[0].buckets == [1, 2, 4] and made["live"].series[0].labels == labels
    sizes = [1, 4]
    metrics.report(Stats(live=3, done=10, errors={"b": 2, "c": 1}, sizes=sizes))
    metrics.report(Stats(live=2, done=12, errors={"b": 2, "c": 1}, sizes=sizes))
    assert (made["live"].series[0].value, made["done_total"].series[0].value) == (2, 12)
    assert {series.labels["kind"]: series.value for series in made["errors_total"].series} == {"a": 0, "b": 2, "c": 1}
    assert made["sizes"].series[0].observations == [1, 4] and sizes == []  # observed once, emptied
    metrics.close()  # this instance's gauges leave their series; counters stay
    assert (made["live"].series[0].value, made["done_total"].series[0].value) == (0, 12)
    assert not metrics._series and warnings == []


def test_model_metrics_turn_off_at_the_first_failure_and_never_fail_a_request():
    made, warnings = {}, []
    metrics = model_metrics.ModelMetrics(FAMILIES, "decoder", "1", fake_metric_family(made), warnings.append)
    metrics.report(object())  # stats without the fields
    metrics.report(Stats(live=3, done=10, errors={}, sizes=[]))
    assert not metrics._series and made["live"].series[0].value == 0
    assert warnings == ["model 'decoder': custom metrics failed, now off ('object' object has no attribute 'live')"]
    metrics.close()

    class Unsupported(fake_metric_family({})):  # a server without metrics support
        def __init__(self, **kwargs):
            raise RuntimeError("metrics disabled")

    warnings.clear()
    metrics = model_metrics.ModelMetrics(FAMILIES, "code2wav", "1", Unsupported, warnings.append)
    metrics.report(Stats(live=3, done=10, errors={}, sizes=[]))
    metrics.close()
    assert not metrics._series and warnings == ["model 'code2wav': custom metrics unavailable (metrics disabled)"]


def test_initialize_turns_on_the_fault_handler_and_finalize_frees_a_reference_cycle_at_once():
    """The cycle is what a failed request's traceback makes of its request: the reference counts never free it."""
    was = faulthandler.is_enabled()
    faulthandler.disable()
    gc.disable()  # no automatic collection may free it first
    try:
        model_lifecycle.on_initialize()
        assert faulthandler.is_enabled()
        held = FakeMetric()
        held.self = held
        freed = weakref.ref(held)
        del held
        assert freed() is not None
        assert model_lifecycle.on_finalize() >= 1 and freed() is None
    finally:
        gc.enable()
        if not was:
            faulthandler.disable()
