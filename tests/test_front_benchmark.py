"""The front benchmark (`benchmarks/front.py`): py-spy's samples are charged to the part of the stub
that ran them, and a short run on a real server measures code2wav against the minimal front and
splits the front stub's CPU."""

from __future__ import annotations

import argparse
import shutil

import pytest

from benchmarks import front
from benchmarks.local_server import LocalServer

from helpers import MODEL_REPOSITORY

SOURCES = {("model.py", 10): "                sender.send(self._response(result), flags=FINAL)",
           ("model.py", 11): "        self._answers.append((sender, result))",
           ("code2wav_core.py", 5): "        for stream in self._streams:",
           ("code2wav_calls.py", 49): "        while (call := self._calls.get()) is not None:",
           ("code2wav_calls.py", 53): "                result = blocking_call()"}
# In turn: the thread pool running a decoder call (a pb_utils call wherever it came from); a line of the
# front calling into pb_utils, one of its own Python, and its stream table's Python under a stdlib helper
# (the innermost line of its own files counts); numpy, innermost; the event loop, the pool waiting for
# work, nothing of the front's; code2wav's decoder-call threads waiting for their next call (not the
# front's work, not among its busiest lines) and running a decoder call (a pb_utils call).
RAW = """\
_bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:83);run (concurrent/futures/thread.py:58) 7
_run_once (asyncio/base_events.py:1922);_send_answers (/srv/repo/code2wav/1/model.py:10) 4
_run_once (asyncio/base_events.py:1922);_answer (model.py:11) 2
_run (asyncio/events.py:80);process (code2wav_core.py:5);helper (contextlib.py:334) 3
_stream_request (model.py:11);copy (numpy/core/numeric.py:100) 2
run_forever (asyncio/base_events.py:607);_run_once (asyncio/base_events.py:1910) 3
_bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:81) 1
<module> (server.py:1);main (other.py:2) 1
_bootstrap (threading.py:1002);_work (code2wav_calls.py:49) 6
_bootstrap (threading.py:1002);_work (code2wav_calls.py:53) 2
not a sample line"""


def test_samples_are_charged_to_the_part_of_the_stub_that_ran_them():
    stacks = front.parse_raw(RAW)
    assert sum(stacks.values()) == 31
    parts, busiest = front.charge(stacks, SOURCES)
    assert parts == {front.PB_UTILS: 13, "front Python": 5, "numpy": 2, "asyncio and threads": 10, "other": 1}
    assert busiest[0] == ("_send_answers (/srv/repo/code2wav/1/model.py:10)",
                          "sender.send(self._response(result), flags=FINAL)", 4)
    assert not any("_calls.get()" in text for _, text, _ in busiest)
    # The line texts of a served folder, keyed by file name and line number.
    served = front.sources(front.MINIMAL_FRONT.parent)
    assert any("async_exec()" in text for (name, _), text in served.items() if name == "model.py")


def test_code2wav_calls_lines_are_the_ones_the_benchmark_recognises():
    """The benchmark knows code2wav's decoder-call threads by the text of two lines of
    code2wav_calls.py: renaming either would move their samples to "front Python" unnoticed."""
    lines = [text for (name, _), text in front.sources(MODEL_REPOSITORY / "code2wav" / "1").items()
             if name == "code2wav_calls.py"]
    waits = [text for text in lines if front.THREAD_WAIT.search(text)]
    calls = [text for text in lines if "blocking_call()" in text and front.PB_UTILS_CALL.search(text)]
    assert waits == ["        while (call := self._calls.get()) is not None:"], waits
    assert calls == ["                result = blocking_call()"], calls


@pytest.mark.server
def test_a_short_run_compares_the_fronts_and_splits_the_stubs_cpu(repository_for, tmp_path):
    problem = front.py_spy_problem()
    if problem:
        pytest.skip(problem)
    repository = shutil.copytree(repository_for("null"), tmp_path / "model_repository")
    local = LocalServer(repository, tmp_path / "tritonserver.log", "test server")
    # A light live load keeps the stubs mostly idle: sample fast enough that the front's own lines show.
    args = argparse.Namespace(conversations=4, unpaced=4, seconds=1.5, rounds=1, rate=1000, budget_ms=80.0)
    point = front.measure_instances(local, 1, args, None)
    assert local.server is None  # stopped
    assert all(point["rps"][f][0] > 20 for f in front.FRONTS) and point["ratio"] > 0
    for name in front.FRONTS:
        live = point["live"][name]
        assert live["result"]["failed"] is None and live["result"]["misses"] == 0, live["result"]
        assert live["profile"][name]["requests"] == live["result"]["requests"] > 0
        sampled = point["sampled"][name]
        assert sampled["stubs"] == 1 and sampled["result"]["failed"] is None
        assert sampled["samples"][front.PB_UTILS] > 0, sampled
    # Samples in code2wav's own files are found, and charged to its pb_utils calls, its Python or the
    # numpy it calls.
    code2wav = point["sampled"]["code2wav"]
    own = sum(count for _, _, count in code2wav["busiest_lines"])
    assert own > 0 and sum(code2wav["samples"][part] for part in (front.PB_UTILS, "front Python", "numpy")) >= own, code2wav
    rows = dict(front.breakdown(point, "code2wav"))
    split = sum(ms for what, ms in rows.items() if what.startswith("CPU: front stub, "))
    assert split == pytest.approx(rows["CPU: front stub"]) and rows["CPU: front stub"] > 0
    table = front.front_markdown({**vars(args), "meta": {}, "sampling": None, "points": [point]})
    assert f"| CPU: front stub, {front.PB_UTILS} |" in table and "| 1 | code2wav |" in table
