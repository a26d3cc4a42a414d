"""Through Triton: streams x request sizes, each stream sending its next request when the last returned.

Per point (N streams of requests of 1, then F frames), the asyncio client and perf_analyzer (client/perf.sh):
requests/s, frames/s, latency, the decoder's batch, CPU per request by process; and Triton's overhead
(the 1-stream p50 minus the ONNX step alone). Writes OUT_DIR/bench.md, bench.json and raw/."""

from __future__ import annotations

import argparse
import asyncio
import csv
import itertools
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mimi_code2wav import client as client_package
from mimi_code2wav.client.perf_inputs import describe, input_data
from mimi_code2wav.client.protocol import FRAMES_PER_SECOND, ClientError, StreamOptions, chunk_bounds, random_codes
from mimi_code2wav.client.report import RunReport, StreamResult
from mimi_code2wav.server.processes import log_tail

from .decoder import ort_step_s
from .profile import SERVER_ROLES, PointProfile, add_server_arguments, measured_server, point_profile, server_meta
from .provenance import REPO_ROOT, add_options, log, md_row, parse_counts, write_run

PERF_SH = Path(client_package.__file__).resolve().parent / "perf.sh"


def decode_streams(url: str, codes: list[np.ndarray], chunk_frames: int) -> RunReport:
    """Every stream of `codes` at once through one asyncio client, unpaced: 1 frame, then `chunk_frames` per request."""
    from mimi_code2wav.client.aio import Code2WavClient

    options = StreamOptions(chunk_frames=chunk_frames)

    async def decode(client, codes: np.ndarray) -> StreamResult:
        bounds, pcm, latencies_s = chunk_bounds(codes.shape[1], chunk_frames), [], []
        async with client.stream() as stream:
            started_s = time.perf_counter()
            for first, stop in bounds:
                sent_s = time.perf_counter()
                pcm.append(await stream.decode(codes[:, first:stop], end=stop == codes.shape[1]))
                latencies_s.append(time.perf_counter() - sent_s)
        return StreamResult(stream.sequence_id, codes.shape[1], np.concatenate(pcm), [b - a for a, b in bounds],
                            latencies_s, started_s, time.perf_counter())

    async def main() -> list[StreamResult]:
        async with Code2WavClient(url, options) as client:
            return list(await asyncio.gather(*(decode(client, c) for c in codes)))

    results = asyncio.run(main())
    return RunReport(results, options, max(r.finished_s for r in results) - min(r.started_s for r in results))


def run_until_done(command: list[str], env: dict, timeout_s: float, server_alive, log_path: Path) -> int | str:
    """perf.sh's exit code (output in `log_path`), or why it was killed: at once when `server_alive()` is false,
    as perf_analyzer waits for a dead server until its timeout."""
    started = time.monotonic()
    with log_path.open("w") as output:
        output.write(f"$ {' '.join(command)}\n")
        output.flush()
        with subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=output, stderr=subprocess.STDOUT,
                              start_new_session=True) as process:
            while process.poll() is None:
                if time.monotonic() - started > timeout_s or not server_alive():
                    os.killpg(process.pid, signal.SIGKILL)  # perf.sh execs perf_analyzer in its own group
                    process.wait()
                    return (f"perf_analyzer did not finish in {timeout_s:.0f} s" if server_alive()
                            else "the server exited during the point")
                time.sleep(0.5)
    return process.returncode


class Sweep:
    """A run's points against `url` or a local `server`: rows in `client` and `perf`, failed ones counted in
    `failures`, how the server died in `server_exit`; stream i decodes `frames` random frames of seed `seed + i`."""

    def __init__(self, raw_dir: Path, frames: int, seed: int, point_seconds: float, url: str | None = None, server=None):
        self.raw_dir, self.frames, self.seed, self.point_seconds, self.server = raw_dir, frames, seed, point_seconds, server
        self.url = url or server.grpc_url
        self.client, self.perf, self.failures, self.server_exit = [], [], 0, None

    def server_alive(self) -> bool:
        return self.server is None or self.server.is_alive()

    def measure(self, rows: list[dict], streams: int, chunk_frames: int, run) -> dict:
        """One point, profiled, appended to `rows`; a local server that died during it is recorded in `server_exit`."""
        label = f"{streams} stream(s), {chunk_frames} frame(s) per request"
        log(f"{'client' if rows is self.client else 'perf_analyzer':13s} {label} ...")
        profile = point_profile(self.server).start()
        try:
            row = run(streams, chunk_frames)
        except Exception as exc:  # a dying server also fails the client's requests
            row = {"error": f"{type(exc).__name__}: {exc}"}
        if not self.server_alive():
            self.server_exit = (f"tritonserver exited during {label} (code {self.server.exit_code()}); the log's tail:\n"
                                f"{log_tail(self.server.log_path, 8)}")
            row["error"] = "the server exited during the point"
        elif "error" not in row:
            row["profile"] = profile.finish(row.get("requests", 0))
        rows.append({"streams": streams, "chunk_frames": chunk_frames, **row})
        self.failures += "error" in row
        return rows[-1]

    def client_point(self, streams: int, chunk_frames: int) -> dict:
        """The point's streams through the asyncio client: latency, real-time factor, throughput."""
        codes = [random_codes(self.frames, self.seed + i) for i in range(streams)]
        stats = decode_streams(self.url, codes, chunk_frames).summary()
        return {"first_chunk_ms": stats["first_chunk_latency_ms_mean"], "first_chunk_ms_max": stats["first_chunk_latency_ms_max"],
                **{f"p{p}_ms": stats[f"chunk_latency_ms_p{p}"] for p in (50, 90, 99)},
                **{key: stats[key] for key in ("real_time_factor", "real_time_factor_per_stream_min", "frames_per_s")},
                "requests_per_s": stats["requests"] / stats["wall_s"], "requests": stats["requests"]}

    def perf_point(self, streams: int, chunk_frames: int, requests_per_s: float) -> dict:
        """One perf_analyzer measurement of about `point_seconds` at the client's request rate."""
        count = max(math.ceil(requests_per_s * self.point_seconds), 4 * streams)
        flags = ["--concurrency-range", str(streams), "--request-count", str(count)]
        name = self.raw_dir / f"perf-{streams}-c{chunk_frames}"
        csv_path, log_path = name.with_suffix(".csv"), name.with_suffix(".txt")
        env = dict(os.environ, URL=self.url, STREAMS=str(streams), FRAMES=str(self.frames), CHUNK_FRAMES=str(chunk_frames),
                   SEED=str(self.seed), CSV=str(csv_path), BUILD_DIR=str(self.raw_dir / "perf-build"), PYTHON=sys.executable)
        row = {"request_count": count, "command": " ".join(["client/perf.sh", *flags])}
        started = time.monotonic()
        done = run_until_done([str(PERF_SH), *flags], env, max(120.0, 20 * self.point_seconds), self.server_alive, log_path)
        if isinstance(done, str):
            return {**row, "error": done}
        row["seconds"] = time.monotonic() - started
        output = log_path.read_text()
        if done != 0 or not csv_path.exists():
            lines = [line for line in output.splitlines()[1:] if line.strip()]
            errors = [line for line in lines if "rror" in line or "ailed" in line]
            return {**row, "error": f"perf_analyzer exit {done}: {(errors or lines or ['no output'])[0].strip()}"}
        record = next(csv.DictReader(csv_path.open()))
        us = lambda column: float(record[column]) / 1e3  # noqa: E731  (CSV times are microseconds)
        frames_per_step = describe(input_data(1, self.frames, chunk_frames, self.seed))["mean_frames_per_step"]
        row.update(
            requests_per_s=float(record["Inferences/Second"]), frames_per_s=float(record["Inferences/Second"]) * frames_per_step,
            p50_ms=us("p50 latency"), p90_ms=us("p90 latency"), p99_ms=us("p99 latency"), server_queue_ms=us("Server Queue"),
            server_compute_ms=us("Server Compute Input") + us("Server Compute Infer") + us("Server Compute Output"))
        # Server and composing-model counts from perf_analyzer's text report.
        server = re.search(r"Server:\s*\n\s*Inference count: (\d+)\s*\n\s*Execution count: (\d+)", output)
        if server:
            row.update(code2wav_requests=int(server.group(1)), code2wav_executions=int(server.group(2)))
        decoder = re.search(r"mimi_decoder, version: \S*\s*\n\s*Inference count: (\d+)\s*\n\s*Execution count: (\d+).*?"
                            r"queue (\d+) usec \+ compute input (\d+) usec \+ compute infer (\d+) usec", output, re.S)
        if decoder:
            inferences, executions = int(decoder.group(1)), int(decoder.group(2))
            row.update(decoder_steps=inferences, decoder_mean_batch=inferences / executions if executions else None,
                       decoder_queue_ms=int(decoder.group(3)) / 1e3, decoder_compute_infer_ms=int(decoder.group(5)) / 1e3)
        return row

    def point(self, streams: int, chunk_frames: int) -> None:
        """The point with the asyncio client, then with perf_analyzer sized by the client's request rate."""
        row = self.measure(self.client, streams, chunk_frames, self.client_point)
        if self.server_exit is None and "requests_per_s" in row:
            self.measure(self.perf, streams, chunk_frames, lambda *point: self.perf_point(*point, row["requests_per_s"]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    add_options(parser, ("--streams", "1,8,32", "concurrent streams, swept", parse_counts),
                ("--chunk-frames", "1,4,16", "frames per request after the first, swept", parse_counts),
                ("--frames", 96, "frames per stream"), ("--seed", 0, "seed of the codes; stream i uses seed + i"),
                ("--point-seconds", 5.0, "approximate seconds per perf_analyzer point"))
    parser.add_argument("--onnx", type=Path, help="the served ONNX step, for the overhead column (a local server's is known)")


def run(args: argparse.Namespace) -> int:
    if args.onnx is not None and not args.onnx.is_file():
        raise ClientError(f"--onnx {args.onnx}: no such file")
    (args.out_dir / "raw").mkdir(parents=True, exist_ok=True)
    with measured_server(args) as (local, url):
        sweep = Sweep(args.out_dir / "raw", args.frames, args.seed, args.point_seconds, url=url, server=local)
        for chunk in args.chunk_frames:  # a fresh server's first requests pay one-off set-up costs: not measured
            decode_streams(sweep.url, [random_codes(2 * chunk + 1, args.seed)], chunk)
        meta = server_meta("triton", args, local, url=sweep.url, front_instances=args.front_instances if local else None,
                           queue_delay_us={"code2wav": args.front_queue_delay_us, "mimi_decoder": args.max_queue_delay_us}
                           if local else None, frames=args.frames, chunk_frames=args.chunk_frames, streams=args.streams)
        results = {"meta": meta, "client": sweep.client, "perf": sweep.perf, "decoder_step_ms": {}}
        onnx_path = args.onnx or (local.model_repository / "mimi_decoder" / "1" / "model.onnx" if local else None)
        if onnx_path is not None and onnx_path.is_file():  # the null decoder serves no ONNX step
            import onnxruntime as ort

            log("the ONNX step alone, batch 1 ...")
            session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
            results["decoder_step_ms"] = {frames: ort_step_s(session, 1, frames, 1.0, np.random.default_rng(0)) * 1000
                                          for frames in args.chunk_frames}
        elif local is not None and args.decoder == "null":
            results["decoder_step_ms"] = dict.fromkeys(args.chunk_frames, 0.0)
        for chunk, streams in itertools.product(args.chunk_frames, args.streams):
            sweep.point(streams, chunk)
            if sweep.server_exit is not None:
                log(sweep.server_exit)
                meta["server_exit"] = sweep.server_exit
                break
    results["summary"] = summarize(results)
    write_run(args.out_dir, "bench", results, sweep_markdown(results), title="# code2wav benchmark\n\n")
    if sweep.failures:
        log(f"{sweep.failures} point(s) failed: see the tables and {args.out_dir / 'raw'}")
    return 1 if sweep.failures or "server_exit" in meta else 0


# ---- the report: reads only the sweep's JSON, so that the record renders it the same on any machine ----

def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summarize(results: dict) -> dict:
    """The headline numbers: 16- vs 1-frame latency, frames/s of 8 streams, Triton's overhead."""
    solo = {r["chunk_frames"]: r for r in results["client"] if r["streams"] == 1 and "error" not in r}
    step_ms, summary = results.get("decoder_step_ms", {}), {}
    if 1 in solo and 16 in solo:
        summary["p50_16_frames_over_1_frame"] = solo[16]["p50_ms"] / solo[1]["p50_ms"]
    for row in results["client"]:
        if row["streams"] == 8 and row["chunk_frames"] == 4 and "error" not in row:
            summary["frames_per_s_8_streams_4_frames"] = row["frames_per_s"]
    return {**summary, "triton_overhead_ms_p50": {c: solo[c]["p50_ms"] - step_ms[c] for c in solo if c in step_ms}}


# Each table of the sweep: title, what it shows, header row, alignment row.
TABLES = {
    "client": (
        "The asyncio client (mimi_code2wav.client.aio)",
        "One channel, one task per stream; each stream sends its next request when the previous one "
        "returned. RTF = audio seconds of all streams / wall seconds.",
        "| frames / request | streams | first chunk ms (mean / max) | request p50 / p90 / p99 ms | RTF total "
        "| RTF slowest stream | frames/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ),
    "perf": (
        "perf_analyzer 2.51 (gRPC streaming, sequences)",
        "`--concurrency-range N`: N sequences, each sending its next step when the last returned. "
        "frames/s = requests/s x mean frames per request of the input data. Latency is perf_analyzer's "
        "client-side request latency; queue and compute are code2wav's server-side averages; the decoder "
        "columns are `mimi_decoder` (composing model): mean batch size and compute per batched step.",
        "| frames / request | streams | requests/s | frames/s | real time needs frames/s | p50 / p90 / p99 ms "
        "| code2wav queue ms | code2wav compute ms | decoder batch | decoder compute ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ),
    "profile": (
        "Where the time goes (server side)",
        "Per point, as differences over it: CPU time per request of each server process (from "
        "/proc: tritonserver, the code2wav stub(s), the decoder stub(s)) and of the load generator; server "
        "cores busy = the server's CPU time / wall time; and Triton's own statistics per model: mean batch "
        "and time per execution (one execution is one batch; a code2wav execution includes waiting for its "
        "decoder calls).",
        "| load generator | frames / request | streams | requests/s | server CPU ms / request: tritonserver / "
        "code2wav / decoder = total | load generator CPU ms / request | server cores busy | code2wav batch / "
        "execution ms | decoder batch / execution ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ),
}


def _latencies(row: dict) -> str:
    return f"{_fmt(row['p50_ms'])} / {_fmt(row['p90_ms'])} / {_fmt(row['p99_ms'])}"


def _client_row(row: dict) -> str:
    if "error" in row:
        return md_row(row["chunk_frames"], row["streams"], row["error"]) + " | | | |"
    return md_row(row["chunk_frames"], row["streams"], f"{_fmt(row['first_chunk_ms'])} / {_fmt(row['first_chunk_ms_max'])}",
                  _latencies(row), _fmt(row["real_time_factor"], 2), _fmt(row["real_time_factor_per_stream_min"], 2),
                  _fmt(row["frames_per_s"]))


def _perf_row(row: dict) -> str:
    needed = _fmt(row["streams"] * FRAMES_PER_SECOND)
    if "error" in row:
        return md_row(row["chunk_frames"], row["streams"], row["error"]) + f" | {needed} | | | | | |"
    return md_row(row["chunk_frames"], row["streams"], _fmt(row["requests_per_s"], 2), _fmt(row["frames_per_s"]), needed,
                  _latencies(row), _fmt(row["server_queue_ms"]), _fmt(row["server_compute_ms"]),
                  _fmt(row.get("decoder_mean_batch"), 2), _fmt(row.get("decoder_compute_infer_ms")))


def _profile_row(tool: str, row: dict) -> str:
    profile = row["profile"]
    cpu = profile.get("server_cpu_ms_per_request", {})
    cpu_cell = (" / ".join(_fmt(cpu.get(role), 3) for role in SERVER_ROLES)
                + f" = {_fmt(profile.get('server_cpu_ms_per_request_total'), 3)}") if cpu else "-"
    models = [profile.get(model, {}) for model in PointProfile.MODELS]
    return md_row(tool, row["chunk_frames"], row["streams"], _fmt(row.get("requests_per_s")), cpu_cell,
                  _fmt(profile.get("load_cpu_ms_per_request"), 3), _fmt(profile.get("server_cpu_cores_busy"), 2),
                  *(f"{_fmt(m.get('mean_batch'), 2)} / {_fmt(m.get('execute_ms'), 2)}" for m in models))


def sweep_markdown(results: dict, heading: str = "##") -> str:
    """The sweep's summary and tables, its tables under `heading` (the caller writes the stamp)."""
    profiled = [(tool, row) for tool, rows in (("client", results["client"]), ("perf_analyzer", results["perf"]))
                for row in rows if "profile" in row]
    tables = {"client": [_client_row(row) for row in results["client"]],
              "perf": [_perf_row(row) for row in results["perf"]],
              "profile": [_profile_row(tool, row) for tool, row in profiled]}
    meta, summary = results["meta"], results["summary"]
    step_ms = {int(chunk): ms for chunk, ms in results.get("decoder_step_ms", {}).items()}  # JSON keys are strings
    lines = [
        f"- server: {meta['server']}",
        f"- streams of {meta['frames']} frames ({meta['frames'] / FRAMES_PER_SECOND:.2f} s), each sending its next "
        "request when the last returned: requests of 1 then F frames (the client sends frame_offset, perf_analyzer "
        "deltas); live pacing is the duplex benchmark's",
        f"- **the load generators (this client, perf_analyzer) share the machine's {meta['cpu_cores']} CPU cores with "
        "the server**: numbers are lower bounds for a dedicated server",
        *([f"- **the server exited during the run**; the points after it were not measured:\n\n"
           f"```\n{meta['server_exit']}\n```"] if "server_exit" in meta else []),
        *([f"- one stream, request p50 of 16 frames / of 1 frame: **{summary['p50_16_frames_over_1_frame']:.2f}x**"]
          if "p50_16_frames_over_1_frame" in summary else []),
        *([f"- 8 streams, 4-frame requests: **{summary['frames_per_s_8_streams_4_frames']:.1f} frames/s**"]
          if "frames_per_s_8_streams_4_frames" in summary else []),
        *(f"- Triton overhead per {chunk}-frame request (1-stream p50 minus the ONNX step alone, {step_ms[chunk]:.1f} "
          f"ms): {overhead:.1f} ms"
          for chunk, overhead in sorted((int(c), ms) for c, ms in summary.get("triton_overhead_ms_p50", {}).items())),
        "",
    ]
    for name, rows in tables.items():
        if rows:
            title, note, header, align = TABLES[name]
            lines += [f"{heading} {title}", "", note, "", header, align, *rows, ""]
    return "\n".join(lines).rstrip("\n")
