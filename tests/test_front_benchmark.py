"""The front benchmark (`benchmarks/front.py`): a short run on a real server measures code2wav against
the minimal front, profiles both, and its table splits a recorded run's front stub CPU by its samples."""

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
    assert "| 1 | code2wav |" in table and "| CPU: front stub |" in table and "py-spy" not in table
    # A recorded run's samples split the front stub's CPU by their shares.
    point["sampled"] = {"code2wav": {"samples": {"pb_utils calls": 3, "front Python": 1}, "busiest_lines": []}}
    rows = dict(front.breakdown(point, "code2wav"))
    assert rows["CPU: front stub, pb_utils calls"] == pytest.approx(0.75 * rows["CPU: front stub"])
    assert "py-spy at 200 Hz" in front.front_markdown({**vars(args), "rate": 200, "meta": {}, "points": [point]})
