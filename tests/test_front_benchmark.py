"""The front benchmark (`benchmarks/front.py`): a short run on a real server measures code2wav against
the minimal front and profiles both."""

from __future__ import annotations

import argparse
import shutil

import pytest

from benchmarks import front


@pytest.mark.server
def test_a_short_run_compares_the_fronts_and_profiles_both(repository_for, tmp_path):
    repository = shutil.copytree(repository_for("null"), tmp_path / "model_repository")
    args = argparse.Namespace(conversations=4, unpaced=4, seconds=1.5, rounds=1, budget_ms=80.0)
    point = front.measure_instances(repository, 1, args)
    assert all(point["rps"][f][0] > 20 for f in front.FRONTS) and point["ratio"] > 0
    for name in front.FRONTS:
        live = point["live"][name]
        assert live["result"]["failed"] is None and live["result"]["misses"] == 0, live["result"]
        assert live["profile"][name]["requests"] == live["result"]["requests"] > 0
        assert live["profile"]["server_cpu_ms_per_request"][f"stub {name}"] > 0
    table = front.front_markdown({**vars(args), "meta": {}, "points": [point]})
    assert "| 1 | code2wav |" in table and "| CPU: front stub |" in table
