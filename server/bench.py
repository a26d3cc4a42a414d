"""Benchmark code2wav through Triton: unpaced streams x request sizes, and paced live streams.

    code2wav-server bench [--url HOST:PORT] [--decoder python-ort|null] [--streams 1,8,32]
                          [--chunk-frames 1,4,16] [--paced-streams 4,8,12,16,24,32] [--frames 96]
                          [--point-seconds 5] [--out-dir bench_results] [--no-client] [--no-perf]

Without --url (or $URL) it starts a local server first, as `make serve` does but from its own build
folder (build/bench, seeded random weights unless --weights: speed does not depend on the weight
values), with the python-ort decoder or, with `--decoder null`, the null decoder (the decoder's
interface returning silence at once): that run measures the front's own ceiling, what gRPC, code2wav
and the sequence-batcher hop carry, which bounds what any decoder behind it can be given.

- Unpaced, for every request size F (`--chunk-frames`) and number of streams N: the streaming
  client (client.stream; a first request of 1 frame, then F frames, with frame_offset) and
  perf_analyzer (client/perf.sh, `--concurrency-range N`, deltas): requests/s, frames/s, request
  p50/p99, first-chunk latency, the decoder's mean batch.
- Paced live streams (1 frame per request, each request leaving when its frame would exist, 80 ms
  apart) for growing N until one stream falls behind: the most streams that keep real time; then
  the same with catch-up (one request in flight per stream, each with every frame produced since
  the last), what a live client does when the server runs behind.
- Triton overhead per request: the 1-stream request p50 minus the same ONNX step run directly in
  ONNX Runtime (batch 1, F frames, in this process) when the export is at hand.
Results go to OUT_DIR: bench.md (tables), bench.json, bench.png (latency and throughput against
streams) and raw/ (perf_analyzer CSVs and reports). The load generators run on the same CPU cores as
the server, and the tables say so.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from mimi_code2wav import client as client_package
from mimi_code2wav.client.perf_inputs import describe, input_data
from mimi_code2wav.client.stream import (
    FRAME_DURATION_S,
    ClientError,
    Code2WavStreamer,
    StreamOptions,
    random_codes,
)
from mimi_code2wav.export.provenance import REPO_ROOT as ROOT
from mimi_code2wav.export.provenance import git_commit, machine_description, timed
from mimi_code2wav.export.render import DecoderServing

from .processes import group_cpu_seconds
from .triton import fetch_metrics, log_tail, metric_value

PERF_SH = Path(client_package.__file__).resolve().parent / "perf.sh"
FRAMES_PER_S_REAL_TIME = 1 / FRAME_DURATION_S  # 12.5 frames/s per live stream


# ---- perf_analyzer ---------------------------------------------------------------------------------

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


def run_perf_point(args, url: str, streams: int, paced: bool, chunk_frames: int, request_rate_estimate: float | None,
                   raw_dir: Path, server_alive=lambda: True, name_suffix: str = "") -> dict:
    """One perf_analyzer measurement; returns the row (with 'error' when it failed). perf_analyzer
    waits for a dead server until its timeout, so it is stopped as soon as `server_alive()` is false."""
    info = describe(input_data(1, args.frames, chunk_frames, args.seed))
    name = f"perf-{'paced' if paced else 'unpaced'}-{streams}-c{chunk_frames}{name_suffix}"
    csv_path = raw_dir / f"{name}.csv"
    if paced:
        rate = streams * FRAMES_PER_S_REAL_TIME / info["mean_frames_per_step"]
        # perf_analyzer 2.51 requires the request count to be at least the rate.
        count = max(math.ceil(rate * args.point_seconds), math.ceil(rate), 2 * streams)
        load = ["--request-rate-range", f"{rate:.4f}", "--num-of-sequences", str(streams), "--serial-sequences"]
    else:
        rate = None
        if request_rate_estimate is None:
            # No client run before this point (--no-client): a short probe sizes it, so that the
            # point lasts about point_seconds at any rate (a fixed guess made fast servers' points
            # a few hundred ms of sequence starts). N streams in a closed loop make N requests per
            # request latency; the probe's own throughput is not usable (perf_analyzer divides a
            # request count by whole seconds).
            probe = run_perf_point(args, url, streams, False, chunk_frames, 4 * streams / args.point_seconds,
                                   raw_dir, server_alive, name_suffix="-probe")
            if "error" in probe:
                return probe
            request_rate_estimate = streams / (probe["p50_ms"] / 1e3)
        count = max(math.ceil(request_rate_estimate * args.point_seconds), 4 * streams)
        load = ["--concurrency-range", str(streams)]
    env = dict(
        os.environ, URL=url, STREAMS=str(streams), FRAMES=str(args.frames), CHUNK_FRAMES=str(chunk_frames),
        SEED=str(args.seed), CSV=str(csv_path), BUILD_DIR=str(raw_dir / "perf-build"), PYTHON=sys.executable,
    )
    command = [str(PERF_SH), *load, "--request-count", str(count)]
    started = time.monotonic()
    row = {
        "streams": streams, "paced": paced, "chunk_frames": chunk_frames, "request_rate": rate, "request_count": count,
        "command": " ".join(["client/perf.sh", *load, "--request-count", str(count)]),
    }
    timeout_s = max(120.0, 20 * args.point_seconds)
    with subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        output = []
        reader = threading.Thread(target=lambda: output.extend(process.communicate()), daemon=True)
        reader.start()
        while reader.is_alive() and time.monotonic() - started < timeout_s and server_alive():
            reader.join(0.5)
        if reader.is_alive():
            os.killpg(process.pid, signal.SIGKILL)  # perf.sh execs perf_analyzer in its own group
            reader.join()
            row["error"] = (f"perf_analyzer did not finish in {timeout_s:.0f} s" if server_alive()
                            else "the server exited during the point")
            return row
    done = subprocess.CompletedProcess(command, process.returncode, *output)
    (raw_dir / f"{name}.txt").write_text(f"$ {' '.join(command)}\n{done.stdout}\n{done.stderr}")
    row["seconds"] = time.monotonic() - started
    if done.returncode != 0 or not csv_path.exists():
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        error_lines = [line for line in lines if "rror" in line or "ailed" in line]
        row["error"] = f"perf_analyzer exit {done.returncode}: {(error_lines or lines or ['no output'])[0].strip()}"
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
    row.update(parse_perf_report(done.stdout))
    return row


# ---- client ----------------------------------------------------------------------------------------

def run_client_point(url: str, streams: int, paced: bool, chunk_frames: int, args, catch_up: bool = False) -> dict:
    codes = [random_codes(args.frames, args.seed + i) for i in range(streams)]
    options = StreamOptions(chunk_frames=chunk_frames, paced=paced, catch_up=catch_up)
    with Code2WavStreamer(url) as streamer:
        report = streamer.run(codes, options)
    stats = report.summary()
    sizes = [frames for result in report.results for frames in result.chunk_frames]
    return {
        "streams": streams, "paced": paced, "catch_up": catch_up, "chunk_frames": chunk_frames,
        "frames_per_request_mean": float(np.mean(sizes)),
        "first_chunk_ms": stats["first_chunk_latency_ms_mean"],
        "first_chunk_ms_max": stats["first_chunk_latency_ms_max"],
        "p50_ms": stats["chunk_latency_ms_p50"], "p90_ms": stats["chunk_latency_ms_p90"],
        "p99_ms": stats["chunk_latency_ms_p99"],
        "real_time_factor": stats["real_time_factor"],
        "real_time_factor_per_stream_min": stats["real_time_factor_per_stream_min"],
        "frames_per_s": stats["frames_per_s"],
        "requests_per_s": stats["requests"] / stats["wall_s"], "requests": stats["requests"],
    }


# ---- where the time goes --------------------------------------------------------------------------

SERVER_ROLES = ("tritonserver", "stub code2wav", "stub mimi_decoder")
TRITON_TIMES = ("queue", "compute_input", "compute_infer", "compute_output")


class PointProfile:
    """What one benchmark point cost the server, as differences over the point: the CPU time of each
    process of a local server (tritonserver, the code2wav and decoder stubs; from /proc) and of the
    load generator (this process and perf_analyzer), and Triton's per-model statistics (requests,
    executions, queue and compute times; from its metrics). Either source may be absent (a remote
    server): its fields are then missing."""

    MODELS = ("code2wav", "mimi_decoder")

    def __init__(self, pgid: int | None, metrics_url: str | None):
        self._pgid, self._metrics_url = pgid, metrics_url

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
                    for model in self.MODELS
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
            for model in self.MODELS:
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
            requests = int(profile["code2wav"]["requests"]) or requests
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


# ---- report ----------------------------------------------------------------------------------------

def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}"


CRASH_MARK = " (†)"


def streams_cell(row: dict) -> str:
    """A row's stream count, marked when it was measured again after a server crash."""
    return f"{row['streams']}{CRASH_MARK if row.get('after_server_crash') else ''}"
PACED_KEEPS_REAL_TIME = 0.99  # slowest stream's RTF: paced streams cannot exceed 1, jitter costs ~1%


def summarize(results: dict) -> dict:
    """The headline numbers: most paced streams in real time, 16- vs 1-frame latency, overhead."""
    summary = {}
    for catch_up, key in ((False, "paced_streams_in_real_time"), (True, "paced_streams_in_real_time_catch_up")):
        paced = [r for r in results["client"] if r["paced"] and r.get("catch_up", False) == catch_up and "error" not in r]
        kept = [r["streams"] for r in paced if r["real_time_factor_per_stream_min"] >= PACED_KEEPS_REAL_TIME]
        summary[key] = max(kept, default=0)
    solo = {r["chunk_frames"]: r for r in results["client"] if not r["paced"] and r["streams"] == 1 and "error" not in r}
    if 1 in solo and 16 in solo:
        summary["p50_16_frames_over_1_frame"] = solo[16]["p50_ms"] / solo[1]["p50_ms"]
    for row in results["client"]:
        if not row["paced"] and row["streams"] == 8 and row["chunk_frames"] == 4 and "error" not in row:
            summary["frames_per_s_8_streams_4_frames"] = row["frames_per_s"]
    step_ms = results.get("decoder_step_ms", {})
    summary["triton_overhead_ms_p50"] = {
        chunk: solo[chunk]["p50_ms"] - step_ms[chunk] for chunk in solo if chunk in step_ms
    }
    return summary


def markdown_report(results: dict) -> str:
    meta = results["meta"]
    summary = results["summary"]
    lines = [
        "# code2wav benchmark",
        "",
        f"- machine: {meta['machine']}",
        f"- commit: {meta['commit']}, {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- server: {meta['server']}",
        f"- streams of {meta['frames']} frames ({meta['frames'] * FRAME_DURATION_S:.2f} s); unpaced requests of 1 then "
        "F frames (the client sends frame_offset, perf_analyzer deltas); paced live streams send 1 frame per request",
        f"- **the load generators (this client, perf_analyzer) share the machine's {os.cpu_count()} CPU cores with "
        "the server**: numbers are lower bounds for a dedicated server",
        f"- paced live streams that keep real time (slowest stream RTF >= {PACED_KEEPS_REAL_TIME}): "
        f"**{summary.get('paced_streams_in_real_time', '-')}**; catching up (one request in flight per stream, "
        f"each with every frame produced since the last): **{summary.get('paced_streams_in_real_time_catch_up', '-')}**",
    ]
    for crash in meta.get("server_crashes", []):
        lines.append(f"- **the server crashed during the run** and was restarted; the point it crashed in was "
                     f"measured again (marked in the tables):\n\n```\n{crash}\n```")
    if "p50_16_frames_over_1_frame" in summary:
        lines.append(f"- one stream, request p50 of 16 frames / of 1 frame: **{summary['p50_16_frames_over_1_frame']:.2f}x**")
    if "frames_per_s_8_streams_4_frames" in summary:
        lines.append(f"- 8 unpaced streams, 4-frame requests: **{summary['frames_per_s_8_streams_4_frames']:.1f} frames/s**")
    for chunk, overhead in sorted(summary.get("triton_overhead_ms_p50", {}).items()):
        lines.append(f"- Triton overhead per {chunk}-frame request (1-stream p50 minus the ONNX step alone, "
                     f"{results['decoder_step_ms'][chunk]:.1f} ms): {overhead:.1f} ms")
    lines.append("")
    if results["client"]:
        lines += [
            "## Streaming client (client.stream)",
            "",
            "Unpaced: each stream sends its next request when the previous one returned. Paced: each request "
            "leaves when its frame would exist (80 ms per frame). Paced, catch-up: one request in flight per "
            "stream, each carrying every frame produced since the last (frames / request is then the mean). "
            "RTF = audio seconds of all streams / wall seconds (paced: at most about the number of streams).",
            "",
            "| frames / request | streams | pacing | first chunk ms (mean / max) | request p50 / p90 / p99 ms | RTF total | RTF slowest stream | frames/s |",
            "|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        for row in results["client"]:
            pacing = ("paced, catch-up" if row.get("catch_up") else "paced") if row["paced"] else "unpaced"
            frames = _fmt(row["frames_per_request_mean"], 2) if row.get("catch_up") and "error" not in row else row["chunk_frames"]
            head = f"| {frames} | {streams_cell(row)} | {pacing}"
            if "error" in row:
                lines.append(f"{head} | {row['error']} | | | | |")
                continue
            lines.append(
                f"{head} | {_fmt(row['first_chunk_ms'])} / "
                f"{_fmt(row['first_chunk_ms_max'])} | {_fmt(row['p50_ms'])} / {_fmt(row['p90_ms'])} / {_fmt(row['p99_ms'])} | "
                f"{_fmt(row['real_time_factor'], 2)} | {_fmt(row['real_time_factor_per_stream_min'], 2)} | "
                f"{_fmt(row['frames_per_s'])} |"
            )
        lines.append("")
    if results["perf"]:
        lines += [
            "## perf_analyzer 2.51 (gRPC streaming, sequences)",
            "",
            "`--concurrency-range N`: N sequences, each sending its next step when the last returned. "
            "frames/s = requests/s x mean frames per request of the input data. Latency is perf_analyzer's "
            "client-side request latency; queue and compute are code2wav's server-side averages; the decoder "
            "columns are `mimi_decoder` (composing model): mean batch size and compute per batched step.",
            "",
            "| frames / request | streams | requests/s | frames/s | real time needs frames/s | p50 / p90 / p99 ms | code2wav queue ms | code2wav compute ms | decoder batch | decoder compute ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in results["perf"]:
            head = f"| {row['chunk_frames']} | {streams_cell(row)}"
            needed = _fmt(row["streams"] * FRAMES_PER_S_REAL_TIME)
            if "error" in row:
                lines.append(f"{head} | {row['error']} | | {needed} | | | | | |")
                continue
            lines.append(
                f"{head} | {_fmt(row['requests_per_s'], 2)} | {_fmt(row['frames_per_s'])} | {needed} | "
                f"{_fmt(row['p50_ms'])} / {_fmt(row['p90_ms'])} / {_fmt(row['p99_ms'])} | {_fmt(row['server_queue_ms'])} | "
                f"{_fmt(row['server_compute_ms'])} | {_fmt(row.get('decoder_mean_batch'), 2)} | "
                f"{_fmt(row.get('decoder_compute_infer_ms'))} |"
            )
        lines.append("")
    profiled = [(tool, row) for tool, rows in (("client", results["client"]), ("perf_analyzer", results["perf"]))
                for row in rows if "profile" in row and not row["paced"]]
    if profiled:
        lines += [
            "## Where the time goes (server side)",
            "",
            "Per unpaced point, as differences over it: CPU time per request of each server process (from "
            "/proc: tritonserver, the code2wav stub(s), the decoder stub(s)) and of the load generator; server "
            "cores busy = the server's CPU time / wall time; and Triton's own statistics per model: mean batch "
            "and time per execution (one execution is one batch; a code2wav execution includes waiting for its "
            "decoder calls).",
            "",
            "| load generator | frames / request | streams | requests/s | server CPU ms / request: tritonserver / "
            "code2wav / decoder = total | load generator CPU ms / request | server cores busy | code2wav batch / "
            "execution ms | decoder batch / execution ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for tool, row in profiled:
            profile = row["profile"]
            cpu = profile.get("server_cpu_ms_per_request", {})
            cpu_cell = (" / ".join(_fmt(cpu.get(role), 3) for role in SERVER_ROLES)
                        + f" = {_fmt(profile.get('server_cpu_ms_per_request_total'), 3)}") if cpu else "-"
            models = [profile.get(model, {}) for model in PointProfile.MODELS]
            model_cells = " | ".join(f"{_fmt(m.get('mean_batch'), 2)} / {_fmt(m.get('execute_ms'), 2)}" for m in models)
            lines.append(
                f"| {tool} | {row['chunk_frames']} | {streams_cell(row)} "
                f"| {_fmt(row.get('requests_per_s'))} | {cpu_cell} | {_fmt(profile.get('load_cpu_ms_per_request'), 3)} "
                f"| {_fmt(profile.get('server_cpu_cores_busy'), 2)} | {model_cells} |"
            )
        lines.append("")
    if any(row.get("after_server_crash") for row in results["client"] + results["perf"]):
        lines += [f"{CRASH_MARK} measured again on a restarted server after the server crashed in this point.", ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """Latency and throughput against streams; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (latency_axes, throughput_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups = {}
    for source, rows, marker in (("client", results["client"], "o"), ("perf_analyzer", results["perf"], "s")):
        for row in rows:
            if "error" not in row:
                groups.setdefault((source, row["paced"], row["chunk_frames"], marker), []).append(row)
    for index, ((source, paced, chunk, marker), points) in enumerate(groups.items()):
        color, style = f"C{index % 10}", "--" if paced else "-"
        streams = [r["streams"] for r in points]
        label = f"{source} {'paced' if paced else 'unpaced'} {chunk} fr/req"
        latency_axes.plot(streams, [r["p50_ms"] for r in points], style, marker=marker, color=color, label=f"{label} p50")
        throughput_axes.plot(streams, [r["frames_per_s"] for r in points], style, marker=marker, color=color, label=label)
    all_streams = sorted({r["streams"] for r in results["client"] + results["perf"]})
    if all_streams:
        throughput_axes.plot(all_streams, [s * FRAMES_PER_S_REAL_TIME for s in all_streams], ":", color="gray",
                             label="real time (12.5 frames/s per stream)")
    latency_axes.set(xlabel="concurrent streams", ylabel="request latency (ms, log scale)", title="Latency per request",
                     yscale="log")
    throughput_axes.set(xlabel="concurrent streams", ylabel="decoded frames / s", title="Throughput")
    for axes in (latency_axes, throughput_axes):
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
        if all_streams:
            axes.set_xticks(all_streams)
    figure.suptitle(f"code2wav on {results['meta']['machine']} (load generator on the same cores)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


# ---- main ------------------------------------------------------------------------------------------

class LocalServer:
    """The bench's own server: a repository exported into args.build_dir, served on loopback ports.
    After a crash (tritonserver 2.51 can crash under load, docs/design.md §7) `restart()` brings up
    a fresh server on the same ports, so the sweep goes on and the report records the crash."""

    def __init__(self, repository: Path, log_path: Path, description: str):
        self.repository, self.log_path, self.description = repository, log_path, description
        onnx_path = repository / "mimi_decoder" / "1" / "model.onnx"
        self.onnx_path = onnx_path if onnx_path.is_file() else None
        self.server = None
        self.crashes: list[str] = []

    @classmethod
    def prepare(cls, args) -> LocalServer:
        """Export (when stale) and render the repository `args` ask for; the server is not started."""
        try:
            from mimi_code2wav.export.pipeline import prepare_local_repository
        except ImportError as exc:
            raise ClientError(f"starting a local server needs the serve and export extras ({exc}); or pass --url") from None
        build_dir = Path(args.build_dir)
        serving = DecoderServing(instance_kind="KIND_CPU", front_instances=args.front_instances,
                                 max_queue_delay_us=args.max_queue_delay_us, front_queue_delay_us=args.front_queue_delay_us)
        repository = prepare_local_repository(args.weights, args.weights is None, 0, build_dir, target=args.decoder,
                                              serving=serving)
        log_path = build_dir / "tritonserver.log"
        return cls(repository, log_path, f"local tritonserver 2.51 (pytriton wheel), {args.decoder} decoder, "
                   f"{args.front_instances} code2wav instance(s), batcher waits {args.front_queue_delay_us} us "
                   f"(code2wav) / {args.max_queue_delay_us} us (decoder), log {log_path}")

    def start(self, ports: dict | None = None) -> None:
        from .triton import running_server

        self._context = running_server(self.repository, log_path=self.log_path, ready_timeout_s=120.0, **(ports or {}))
        self.server = self._context.__enter__()

    def stop(self) -> None:
        if self.server is not None:
            self._context.__exit__(None, None, None)
            self.server = None

    def restart(self) -> str:
        """Record why the server died, keep its log, start a new one on the same ports."""
        server = self.server
        code = server.process.poll()
        tail = log_tail(self.log_path, 40).splitlines()
        # From the signal line on, if any, keeping the stack frames that name a function (the others
        # are bare addresses in the stripped libtritonserver).
        signal_lines = [i for i, line in enumerate(tail) if "Signal (" in line]
        if signal_lines:
            tail = [line for line in tail[signal_lines[-1]:] if not re.search(r"#\s+0x[0-9A-Fa-f]+ in ", line)]
        tail = tail[-8:]
        crashed_log = self.log_path.with_name(f"{self.log_path.stem}.crash{len(self.crashes) + 1}.log")
        why = (f"tritonserver exited during the run (code {code}{': SIGSEGV' if code == -11 else ''}); log "
               f"kept as {crashed_log}:\n" + "\n".join(tail))
        self.crashes.append(why)
        self.stop()
        if self.log_path.exists():
            self.log_path.replace(crashed_log)
        self.start(dict(http_port=server.http_port, grpc_port=server.grpc_port, metrics_port=server.metrics_port))
        return why

    @property
    def url(self) -> str:
        return self.server.grpc_url

    def profile(self) -> PointProfile:
        return PointProfile(self.server.pid, self.server.metrics_url)


ORT_DTYPES = {"tensor(int32)": np.int32, "tensor(float16)": np.float16, "tensor(float)": np.float32}


def decoder_step_ms(onnx_path: Path, frame_counts: list[int], seconds: float = 1.0) -> dict[int, float]:
    """Milliseconds per call of the ONNX step alone in ONNX Runtime, batch 1, for each frame count."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    rng = np.random.default_rng(0)
    result = {}
    for frames in frame_counts:
        feeds = {arg.name: np.zeros([1, *arg.shape[1:]], ORT_DTYPES[arg.type]) for arg in inputs[1:]}
        feeds[inputs[0].name] = rng.integers(0, 2048, (1, 8, frames)).astype(np.int32)
        result[frames] = timed(lambda: session.run(None, feeds), seconds) * 1000  # noqa: B023 (timed here)
    return result


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"an integer >= 1, got {text!r}")
    return int(text)


def non_negative_int(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"an integer >= 0, got {text!r}")
    return int(text)


def parse_counts(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("comma-separated integers >= 1")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("URL") or None,
                        help="Triton gRPC address of a running server (default: $URL, as perf.sh reads it, "
                        "else start a local one; `make bench URL=host:port`)")
    parser.add_argument("--decoder", choices=("python-ort", "null"), default="python-ort",
                        help="the local server's decoder; null measures the front's own ceiling (default %(default)s)")
    parser.add_argument("--front-instances", type=positive_int, default=DecoderServing.front_instances,
                        help="code2wav instances of the local server (`code2wav-export render --front-instances`; "
                        "default %(default)s)")
    parser.add_argument("--front-queue-delay-us", type=non_negative_int, default=DecoderServing.front_queue_delay_us,
                        help="code2wav's batcher wait in the local server (default %(default)s)")
    parser.add_argument("--max-queue-delay-us", type=non_negative_int, default=DecoderServing.max_queue_delay_us,
                        help="the decoder's batcher wait in the local server (default %(default)s)")
    parser.add_argument("--weights", help="weights for the local server (default: seeded random weights)")
    parser.add_argument("--build-dir", default=str(ROOT / "build" / "bench"), help="export folder of the local server")
    parser.add_argument("--streams", type=parse_counts, default=[1, 8, 32], help="unpaced sweep (default 1,8,32)")
    parser.add_argument("--chunk-frames", type=parse_counts, default=[1, 4, 16],
                        help="frames per request after the first, swept (default 1,4,16)")
    parser.add_argument("--paced-streams", type=parse_counts, default=[4, 8, 12, 16, 24, 32],
                        help="paced live streams, tried in turn until one falls behind (default 4,8,12,16,24,32)")
    parser.add_argument("--frames", type=int, default=96, help="frames per stream (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the codes; stream i uses seed + i")
    parser.add_argument("--point-seconds", type=float, default=5.0, help="approximate seconds per perf_analyzer point")
    parser.add_argument("--onnx", type=Path, help="the served ONNX step, for the overhead column (a local server's is known)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench_results", help="where results go (default bench_results/)")
    parser.add_argument("--no-client", action="store_true", help="skip the streaming-client runs")
    parser.add_argument("--no-perf", action="store_true", help="skip perf_analyzer")


def run(args: argparse.Namespace) -> int:
    raw_dir = args.out_dir / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    results = {"meta": {}, "client": [], "perf": [], "decoder_step_ms": {}}
    failures = 0
    local = None
    try:
        onnx_path = args.onnx
        if args.url:
            server = f"running server at {args.url}"
        else:
            print("starting a local server ...", file=sys.stderr, flush=True)
            local = LocalServer.prepare(args)
            local.start()
            server, onnx_path = local.description, onnx_path or local.onnx_path
        url = (lambda: args.url) if args.url else (lambda: local.url)

        def server_alive() -> bool:
            return local is None or local.server.is_alive()

        def measure(name: str, point) -> dict:
            """One point, profiled. A local server that dies during it is restarted and the point
            measured once more; the row records the crash (a second crash leaves the error)."""
            for attempt in (1, 2):
                profile = local.profile() if local is not None else PointProfile(None, None)
                profile.start()
                try:
                    row = point(url())
                except Exception as exc:  # a dying server also fails the client's gRPC stream itself
                    row = {"error": f"{type(exc).__name__}: {exc}"}
                if not server_alive():
                    why = local.restart()
                    print(f"{name}: {why}\nrestarted the server", file=sys.stderr, flush=True)
                    if attempt == 1:
                        continue
                    row.setdefault("error", "the server crashed twice")
                if "error" not in row:
                    row["profile"] = profile.finish(row.get("requests", 0))
                if attempt == 2:
                    row["after_server_crash"] = True
                return row

        with Code2WavStreamer(url()) as streamer:
            streamer.check_ready()
            # Warm-up: the first requests of a fresh server pay one-off set-up costs.
            for chunk in args.chunk_frames:
                streamer.run([random_codes(2 * chunk + 1, args.seed)], StreamOptions(chunk_frames=chunk))
        results["meta"] = {
            "machine": machine_description(), "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "code2wav-server bench " + " ".join(sys.argv[2:]),
            "server": server, "url": url(), "decoder": args.decoder if not args.url else None,
            "front_instances": args.front_instances if not args.url else None,
            "queue_delay_us": None if args.url else {"code2wav": args.front_queue_delay_us,
                                                     "mimi_decoder": args.max_queue_delay_us},
            "frames": args.frames, "chunk_frames": args.chunk_frames, "streams": args.streams,
            "paced_streams": args.paced_streams,
        }
        if onnx_path is not None:
            print("the ONNX step alone, batch 1 ...", file=sys.stderr, flush=True)
            results["decoder_step_ms"] = decoder_step_ms(onnx_path, args.chunk_frames)
        elif not args.url and args.decoder == "null":
            results["decoder_step_ms"] = dict.fromkeys(args.chunk_frames, 0.0)
        for chunk, streams in itertools.product(args.chunk_frames, args.streams):
            label = f"{streams} stream(s) unpaced, {chunk} frame(s) per request"
            request_rate_estimate = None
            point = {"streams": streams, "paced": False, "chunk_frames": chunk}
            if not args.no_client:
                print(f"client        {label} ...", file=sys.stderr, flush=True)
                row = {**point, **measure(label, lambda url, s=streams, c=chunk: run_client_point(url, s, False, c, args))}
                failures += "error" in row
                request_rate_estimate = row.get("requests_per_s")
                results["client"].append(row)
            if not args.no_perf:
                print(f"perf_analyzer {label} ...", file=sys.stderr, flush=True)
                row = {**point, **measure(label, lambda url, s=streams, c=chunk, r=request_rate_estimate:
                                          run_perf_point(args, url, s, False, c, r, raw_dir, server_alive))}
                failures += "error" in row
                results["perf"].append(row)
        if not args.no_client:
            for catch_up in (False, True):
                for streams in args.paced_streams:
                    label = f"{streams} paced live stream(s)" + (", catching up" if catch_up else "")
                    print(f"client        {label} ...", file=sys.stderr, flush=True)
                    row = {"streams": streams, "paced": True, "catch_up": catch_up, "chunk_frames": 1,
                           **measure(label, lambda url, s=streams, c=catch_up: run_client_point(url, s, True, 1, args, c))}
                    failures += "error" in row
                    results["client"].append(row)
                    if "error" in row or row["real_time_factor_per_stream_min"] < PACED_KEEPS_REAL_TIME:
                        break  # more streams fall further behind
        if local is not None and local.crashes:
            results["meta"]["server_crashes"] = local.crashes
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if local is not None:
            local.stop()
    results["summary"] = summarize(results)
    (args.out_dir / "bench.json").write_text(json.dumps(results, indent=2))
    report = markdown_report(results)
    (args.out_dir / "bench.md").write_text(report + "\n")
    plotted = plot(results, args.out_dir / "bench.png")
    print(report)
    print(f"wrote {args.out_dir}/bench.md, bench.json" + (", bench.png" if plotted else " (no plot: matplotlib is not installed)")
          + " and raw/")
    if failures:
        print(f"{failures} point(s) failed: see the tables and {raw_dir}", file=sys.stderr)
    return 1 if failures else 0
