"""Driving perf_analyzer (client/perf.sh) for one sweep point, and reading its reports."""

from __future__ import annotations

import csv
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mimi_code2wav import client as client_package
from mimi_code2wav.client.perf_inputs import describe, input_data

from .provenance import REPO_ROOT

if TYPE_CHECKING:
    from .sweep import SweepLoad, SweepPoint

PERF_SH = Path(client_package.__file__).resolve().parent / "perf.sh"


def parse_perf_report(text: str) -> dict:
    """Server and composing-model counts from perf_analyzer's text report."""
    parsed = {}
    server = re.search(r"Server:\s*\n\s*Inference count: (\d+)\s*\n\s*Execution count: (\d+)", text)
    if server:
        parsed["code2wav_requests"], parsed["code2wav_executions"] = int(server.group(1)), int(server.group(2))
    decoder = re.search(
        r"mimi_decoder, version: \S*\s*\n\s*Inference count: (\d+)\s*\n\s*Execution count: (\d+).*?"
        r"queue (\d+) usec \+ compute input (\d+) usec \+ compute infer (\d+) usec",
        text, re.S,
    )
    if decoder:
        inferences, executions = int(decoder.group(1)), int(decoder.group(2))
        parsed.update(
            decoder_steps=inferences,
            decoder_mean_batch=inferences / executions if executions else None,
            decoder_queue_ms=int(decoder.group(3)) / 1e3,
            decoder_compute_infer_ms=int(decoder.group(5)) / 1e3,
        )
    return parsed


def _run_until_done(command: list[str], env: dict, timeout_s: float, server_alive) -> tuple[int, str, str] | str:
    """(exit code, stdout, stderr) of perf.sh, or why it was stopped: perf_analyzer waits for a dead
    server until its timeout, so it is killed as soon as `server_alive()` is false."""
    started = time.monotonic()
    with subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        output = []
        reader = threading.Thread(target=lambda: output.extend(process.communicate()), daemon=True)
        reader.start()
        while reader.is_alive() and time.monotonic() - started < timeout_s and server_alive():
            reader.join(0.5)
        if reader.is_alive():
            os.killpg(process.pid, signal.SIGKILL)  # perf.sh execs perf_analyzer in its own group
            reader.join()
            return (f"perf_analyzer did not finish in {timeout_s:.0f} s" if server_alive()
                    else "the server exited during the point")
    return process.returncode, *output


def run_perf_point(url: str, point: SweepPoint, load: SweepLoad, request_rate_estimate: float | None, raw_dir: Path,
                   server_alive=lambda: True, name_suffix: str = "") -> dict:
    """One perf_analyzer measurement; returns the row (with 'error' when it failed)."""
    info = describe(input_data(1, load.frames, point.chunk_frames, load.seed))
    if request_rate_estimate is None:
        # No client run before this point (--no-client): a short probe sizes it, so that the
        # point lasts about point_seconds at any rate (a fixed guess made fast servers' points
        # a few hundred ms of sequence starts). N streams in a closed loop make N requests per
        # request latency; the probe's own throughput is not usable (perf_analyzer divides a
        # request count by whole seconds).
        probe = run_perf_point(url, point, load, 4 * point.streams / load.point_seconds, raw_dir, server_alive,
                               name_suffix="-probe")
        if "error" in probe:
            return probe
        request_rate_estimate = point.streams / (probe["p50_ms"] / 1e3)
    # N sequences in a closed loop, the count sized so that the point lasts about point_seconds.
    flags = ["--concurrency-range", str(point.streams)]
    count = max(math.ceil(request_rate_estimate * load.point_seconds), 4 * point.streams)
    name = f"perf-{point.streams}-c{point.chunk_frames}{name_suffix}"
    csv_path = raw_dir / f"{name}.csv"
    env = dict(
        os.environ, URL=url, STREAMS=str(point.streams), FRAMES=str(load.frames), CHUNK_FRAMES=str(point.chunk_frames),
        SEED=str(load.seed), CSV=str(csv_path), BUILD_DIR=str(raw_dir / "perf-build"), PYTHON=sys.executable,
    )
    command = [str(PERF_SH), *flags, "--request-count", str(count)]
    row = {
        "streams": point.streams, "chunk_frames": point.chunk_frames, "request_count": count, "command": " ".join(["client/perf.sh", *flags, "--request-count", str(count)]),
    }
    started = time.monotonic()
    done = _run_until_done(command, env, max(120.0, 20 * load.point_seconds), server_alive)
    if isinstance(done, str):
        return {**row, "error": done}
    returncode, stdout, stderr = done
    (raw_dir / f"{name}.txt").write_text(f"$ {' '.join(command)}\n{stdout}\n{stderr}")
    row["seconds"] = time.monotonic() - started
    if returncode != 0 or not csv_path.exists():
        lines = [line for line in (stdout + stderr).splitlines() if line.strip()]
        error_lines = [line for line in lines if "rror" in line or "ailed" in line]
        row["error"] = f"perf_analyzer exit {returncode}: {(error_lines or lines or ['no output'])[0].strip()}"
        return row
    record = next(csv.DictReader(csv_path.open()))
    us = lambda column: float(record[column]) / 1e3  # noqa: E731  (CSV times are microseconds)
    row.update(
        requests_per_s=float(record["Inferences/Second"]),
        frames_per_s=float(record["Inferences/Second"]) * info["mean_frames_per_step"],
        p50_ms=us("p50 latency"), p90_ms=us("p90 latency"), p99_ms=us("p99 latency"),
        server_queue_ms=us("Server Queue"),
        server_compute_ms=us("Server Compute Input") + us("Server Compute Infer") + us("Server Compute Output"),
    )
    row.update(parse_perf_report(stdout))
    return row
