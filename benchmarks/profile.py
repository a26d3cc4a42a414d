"""Where a benchmark point's time goes on the server: CPU time per process from /proc, Triton's per-model
statistics from its metrics. `process_role` names the processes of a server's group (tritonserver and
its Python stubs; `group_pids`, the server package's), for this and the memory benchmark."""

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
    if name == "triton_python_backend_stub" and len(argv) > 1:
        # argv[1] is .../<model>/<version>/model.py
        return f"stub {Path(argv[1].decode(errors='replace')).parent.parent.name}"
    return name


def _stat_fields(pid: int) -> list[str]:
    # The fields after the parenthesised command: state ppid pgrp session tty tpgid flags minflt
    # cminflt majflt cmajflt utime stime ...
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def group_cpu_seconds(pgid: int) -> dict[str, float]:
    """CPU time (user + system, all threads) used so far by each role of process group `pgid`;
    instances of one model add up."""
    totals: dict[str, float] = {}
    for pid in group_pids(pgid):
        try:
            fields = _stat_fields(pid)
            seconds = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S
        except (OSError, ValueError, IndexError):
            continue
        role = process_role(pid)
        totals[role] = totals.get(role, 0.0) + seconds
    return totals


def settle_gc() -> None:
    """Before a point: collect, then freeze what survives (`gc.freeze`), so that the point's own
    collections scan only its own objects. The load generator holds torch and the export (loaded to
    start the local server), whose full collection stops its event loop or threads long enough to
    show as a stall of every stream at once. A pipeline process that loads models and then calls the
    client has the same problem and the same remedy (README)."""
    gc.collect()
    gc.freeze()


class PointProfile:
    """What one benchmark point cost the server, as differences over the point: the CPU time of each
    process of a local server (tritonserver, the code2wav and decoder stubs; from /proc) and of the
    load generator (this process and perf_analyzer), and Triton's per-model statistics (requests,
    executions, queue and compute times; from its metrics) of `models`, the front first. Either
    source may be absent (a remote server): its fields are then missing."""

    MODELS = ("code2wav", "mimi_decoder")

    def __init__(self, pgid: int | None, metrics_url: str | None, models: tuple[str, ...] = MODELS):
        self._pgid, self._metrics_url, self.models = pgid, metrics_url, models  # the front first

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
                samples = None
            if samples is not None:
                state["triton"] = {
                    model: {name: metric_value(samples, f"nv_inference_{name}", model=model) or 0.0
                            for name in ("request_success", "exec_count", *(f"{t}_duration_us" for t in TRITON_TIMES))}
                    for model in self.models
                }
        return state

    def start(self) -> None:
        self._before = self._read()

    def finish(self, requests: int) -> dict:
        """The profile of the point; `requests` is what the load generator counted (Triton's own
        count of code2wav requests is used when the metrics are at hand)."""
        before, after = self._before, self._read()
        wall_s = after["monotonic"] - before["monotonic"]
        profile: dict = {"wall_s": wall_s}
        if "triton" in before and "triton" in after:
            for model in self.models:
                delta = {name: after["triton"][model][name] - before["triton"][model][name]
                         for name in after["triton"][model]}
                executions = delta["exec_count"]
                profile[model] = {
                    "requests": delta["request_success"],
                    "executions": executions,
                    "mean_batch": delta["request_success"] / executions if executions else None,
                    # Triton charges every request of a batch the whole execution's compute time,
                    # so the mean over requests is the mean execution's time.
                    "execute_ms": (sum(delta[f"compute_{t}_duration_us"] for t in ("input", "infer", "output"))
                                   / delta["request_success"] / 1e3 if delta["request_success"] else None),
                    "queue_ms_per_request": (delta["queue_duration_us"] / delta["request_success"] / 1e3
                                             if delta["request_success"] else None),
                }
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

