"""What a benchmark point cost the server: CPU time per process of its group (from /proc), Triton's
per-model statistics (from its metrics); `process_role` names the processes, for this and `memory`."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

from mimi_code2wav.server.processes import group_pids
from mimi_code2wav.server.triton import fetch_metrics, metric_value

SERVER_ROLES = ("tritonserver", "stub code2wav", "stub mimi_decoder")
TRITON_TIMES = ("queue", "compute_input", "compute_infer", "compute_output")
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_role(pid: int) -> str:
    """'tritonserver', or 'stub <model>' for a Python backend stub; '?' when the process is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    name = Path(argv[0].decode(errors="replace")).name
    if name == "triton_python_backend_stub" and len(argv) > 1:  # argv[1] is .../<model>/<version>/model.py
        return f"stub {Path(argv[1].decode(errors='replace')).parent.parent.name}"
    return name


def group_cpu_seconds(pgid: int) -> dict[str, float]:
    """CPU time (user + system, all threads) so far of each role of process group `pgid`, instances added up."""
    totals: dict[str, float] = {}
    for pid in group_pids(pgid):
        try:
            # After the parenthesised command: state ppid ... (utime and stime are the 12th and 13th).
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            seconds = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S
        except (OSError, ValueError, IndexError):
            continue
        role = process_role(pid)
        totals[role] = totals.get(role, 0.0) + seconds
    return totals


def settle_gc() -> None:
    """Collect, then freeze what survives, so that a point's collections scan only its own objects: a
    full collection of the load generator's torch and export objects stalls every stream at once."""
    gc.collect()
    gc.freeze()


class PointProfile:
    """What one point cost, as differences over it: the CPU time of each process of a local server
    (process group `pgid`) and of the load generator, and Triton's statistics of `models` (the front
    first) from `metrics_url`. Either source may be None (a remote server): its fields are then missing."""

    MODELS = ("code2wav", "mimi_decoder")

    def __init__(self, pgid: int | None, metrics_url: str | None, models: tuple[str, ...] = MODELS):
        self._pgid, self._metrics_url, self.models = pgid, metrics_url, models

    def _read(self) -> dict:
        times = os.times()
        state = {"monotonic": time.monotonic(),
                 "load_cpu_s": times.user + times.system + times.children_user + times.children_system}
        if self._pgid is not None:
            state["cpu_s"] = group_cpu_seconds(self._pgid)
        if self._metrics_url is not None:
            try:
                samples = fetch_metrics(self._metrics_url)
            except OSError:
                return state
            state["triton"] = {
                model: {name: metric_value(samples, f"nv_inference_{name}", model=model) or 0.0
                        for name in ("request_success", "exec_count", *(f"{t}_duration_us" for t in TRITON_TIMES))}
                for model in self.models}
        return state

    def start(self) -> PointProfile:
        settle_gc()
        self._before = self._read()
        return self

    def finish(self, requests: int) -> dict:
        """The point's profile; `requests` is the load generator's count (Triton's, when at hand, wins)."""
        before, after = self._before, self._read()
        wall_s = after["monotonic"] - before["monotonic"]
        profile: dict = {"wall_s": wall_s}
        if "triton" in before and "triton" in after:
            for model in self.models:
                delta = {name: value - before["triton"][model][name] for name, value in after["triton"][model].items()}
                done, executions = delta["request_success"], delta["exec_count"]
                # Triton charges every request of a batch the whole execution's compute time, so the
                # mean over requests is the mean execution's time.
                compute_us = sum(delta[f"compute_{t}_duration_us"] for t in ("input", "infer", "output"))
                profile[model] = {"requests": done, "executions": executions,
                                  "mean_batch": done / executions if executions else None,
                                  "execute_ms": compute_us / done / 1e3 if done else None,
                                  "queue_ms_per_request": delta["queue_duration_us"] / done / 1e3 if done else None}
            requests = int(profile[self.models[0]]["requests"]) or requests
        profile["requests"] = requests
        if requests:
            profile["load_cpu_ms_per_request"] = (after["load_cpu_s"] - before["load_cpu_s"]) / requests * 1e3
            if "cpu_s" in before:
                per_role = {role: (after["cpu_s"].get(role, 0.0) - before["cpu_s"].get(role, 0.0)) / requests * 1e3
                            for role in after["cpu_s"]}
                profile["server_cpu_ms_per_request"] = per_role
                profile["server_cpu_ms_per_request_total"] = sum(per_role.values())
                profile["server_cpu_cores_busy"] = sum(per_role.values()) * requests / 1e3 / wall_s if wall_s else None
        return profile
