"""The duplex tick benchmark (`benchmarks/duplex.py`): its policies turn produced frames into the
requests a pipeline sends, and a short run against the session's real server with both clients
accounts for every frame."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import duplex
from benchmarks.duplex import CATCH_UP, PER_FRAME, RAMP
from mimi_code2wav.client.protocol import FRAME_DURATION_S as FRAME_S


@pytest.mark.parametrize("policy, produced, sent, expected", [
    pytest.param(PER_FRAME, 0, 0, 0, id="per-frame-nothing-yet"),
    pytest.param(PER_FRAME, 1, 0, 1, id="per-frame-first"),
    pytest.param(PER_FRAME, 5, 2, 1, id="per-frame-behind-sends-one"),
    pytest.param(RAMP, 1, 0, 1, id="ramp-first-alone"),
    pytest.param(RAMP, 5, 1, 0, id="ramp-waits-for-its-chunk"),
    pytest.param(RAMP, 6, 1, 5, id="ramp-chunk-of-five"),
    pytest.param(RAMP, 10, 6, 4, id="ramp-last-chunk-short"),
    pytest.param(CATCH_UP, 7, 2, 5, id="catch-up-everything-produced"),
    pytest.param(CATCH_UP, 2, 2, 0, id="catch-up-nothing-new"),
])
def test_policy_frames_to_send_of_ten(policy, produced, sent, expected):
    assert policy.frames_to_send(produced, sent, 10) == expected


def test_due_time_is_the_tick_of_the_chunks_last_frame():
    start = 100.0
    assert PER_FRAME.due_s(3, 10, start) == pytest.approx(start + 3 * FRAME_S)
    # Ramp 1+5: frame 0 alone, frames 1-5 due at frame 5's tick, 6-9 (the short last chunk) at frame 9's.
    assert [RAMP.due_s(j, 10, start) for j in (0, 1, 5, 6, 9)] == pytest.approx(
        [start, start + 5 * FRAME_S, start + 5 * FRAME_S, start + 9 * FRAME_S, start + 9 * FRAME_S])
    assert CATCH_UP.due_s(4, 10, start) == pytest.approx(start + 4 * FRAME_S)
    assert [p.label for p in (PER_FRAME, RAMP, CATCH_UP)] == ["per-frame", "ramp 1+5", "catch-up"]


def test_summary_counts_late_and_missing_frames_as_misses():
    start, arrival_s = 10.0, np.full((2, 4), np.nan)
    arrival_s[0] = start + np.arange(4) * FRAME_S + 0.01
    arrival_s[1, :3] = start + np.arange(3) * FRAME_S + np.array([0.01, 0.2, 0.01])  # frame 3 never came
    result = duplex.summarize("asyncio", PER_FRAME, arrival_s, start, budget_ms=80, cpu_s=0.07, wall_s=1.0)
    assert result["misses"] == 2 and result["requests"] == 7 and not result["meets_budget"]
    assert result["latency_ms"]["max"] == pytest.approx(200, abs=1e-6)
    assert result["client_cpu_ms_per_request"] == pytest.approx(10)


def _duplex_command(url: str, out, *args: str) -> dict:
    from benchmarks.__main__ import main

    assert main(["duplex", "--url", url, "--conversations", "2,3", *args, "--out-dir", str(out)]) == 0
    return json.loads((out / "duplex.json").read_text())


@pytest.mark.server
def test_the_duplex_command_gets_every_frame_back_on_both_clients_and_writes_its_record(code2wav_server, tmp_path):
    from benchmarks import record

    results = _duplex_command(code2wav_server.grpc_url, tmp_path / "duplex", "--policies", "ramp,catch-up",
                              "--seconds", "0.8", "--budget-ms", "10000", "--compare-at", "2")
    assert results["meta"]["kind"] == "duplex-url" and results["frames"] == 10
    assert "| ramp 1+5 | 3 |" in (tmp_path / "duplex" / "duplex.md").read_text()
    assert [(p["policy"], p["conversations"]) for p in results["points"]] == [
        ("ramp 1+5", 2), ("ramp 1+5", 3), ("catch-up", 2), ("catch-up", 3)]
    assert results["most_conversations"] == {"ramp 1+5": 3, "catch-up": 3}
    # Ramp 1+5 over 10 frames: requests of 1, 5 and 4 frames per conversation, every frame answered.
    assert [p["requests"] for p in results["points"][:2]] == [2 * 3, 3 * 3]
    assert [(p["client"], p["policy"], p["requests"]) for p in results["compared"]] == [
        ("asyncio", "per-frame", 2 * 10), ("threads", "per-frame", 2 * 10)]
    for result in results["points"] + results["compared"]:
        assert result["failed"] is None and result["misses"] == 0 and result["client_cpu_ms_per_request"] > 0
        assert 0 < result["latency_ms"]["p50"] <= result["latency_ms"]["p99"] <= result["latency_ms"]["max"]
    # The record renders it under its own section (as if run from a committed tree, as the record wants).
    results["meta"].update(commit="0000000", command="python -m benchmarks duplex --url HOST:PORT")
    (tmp_path / "run.json").write_text(json.dumps(results))
    record.add_run(tmp_path / "run.json", tmp_path / "records")
    assert "## The duplex tick: a running server" in record.render_record(tmp_path / "records")


@pytest.mark.server
def test_the_sweep_stops_at_the_first_miss_unless_told_to_keep_going(code2wav_server, tmp_path):
    for keep_going, counts in ((False, [2]), (True, [2, 3])):
        results = _duplex_command(code2wav_server.grpc_url, tmp_path / f"keep-going-{keep_going}", "--policies",
                                  "catch-up", "--seconds", "0.4", "--budget-ms", "0", "--compare-at", "0",
                                  *(["--keep-going"] if keep_going else []))
        assert [p["conversations"] for p in results["points"]] == counts
        assert results["most_conversations"] == {"catch-up": 0}  # no frame is 0 ms late
