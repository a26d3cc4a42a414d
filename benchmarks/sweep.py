"""Benchmark code2wav through Triton: streams x request sizes, each stream as fast as it is answered.

    python -m benchmarks sweep [--url HOST:PORT] [--decoder python-ort|onnxruntime|null] [--streams 1,8,32]
                          [--chunk-frames 1,4,16] [--frames 96] [--point-seconds 5] [--out-dir bench_results]
                          [--no-client] [--no-perf] [the serving flags of `code2wav-export render`]

Without --url (or $URL) it starts a local server from its own build folder (build/bench, seeded random
weights unless --weights: speed does not depend on the weight values). `--decoder null` (the decoder's
interface returning silence at once) measures the front's own ceiling: what gRPC, code2wav and the
sequence-batcher hop carry.

- For every request size F (`--chunk-frames`) and number of streams N, unpaced (each stream sends
  its next request when the previous one returned): the asyncio client (one channel, one task per
  stream; a first request of 1 frame, then F frames, with frame_offset) and perf_analyzer
  (client/perf.sh, `--concurrency-range N`, deltas): requests/s, frames/s, request p50/p99,
  first-chunk latency, the decoder's mean batch, each point's CPU per request by process.
- Triton overhead per request: the 1-stream request p50 minus the same ONNX step run directly in
  ONNX Runtime (batch 1, F frames, in this process) when the export is at hand.

A local server that exits during a point ends the sweep: the point and the server's log tail are
recorded. Live pacing is `python -m benchmarks duplex`'s. Results go to OUT_DIR: bench.md, bench.json
(`python -m benchmarks record --add` records it), bench.png and raw/ (perf_analyzer's CSVs and reports).
The load generators run on the same CPU cores as the server, and the tables say so.
"""

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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mimi_code2wav import client as client_package
from mimi_code2wav.client.perf_inputs import describe, input_data
from mimi_code2wav.client.protocol import ClientError, StreamOptions, chunk_bounds, random_codes
from mimi_code2wav.client.report import RunReport, StreamResult
from mimi_code2wav.server.processes import ServerError, log_tail

from .local_server import LocalServer, add_server_arguments, measured_server
from .profile import PointProfile, settle_gc
from .provenance import REPO_ROOT, command_line, parse_counts, record_json, run_meta, timed
from .report import markdown_report, plot, summarize

PERF_SH = Path(client_package.__file__).resolve().parent / "perf.sh"


@dataclass(frozen=True)
class SweepLoad:
    """What every point sends: streams of `frames` frames of random codes (stream i seeded `seed + i`),
    each perf_analyzer point lasting about `point_seconds`."""

    frames: int
    seed: int
    point_seconds: float


@dataclass(frozen=True)
class SweepPoint:
    """`streams` concurrent streams, `chunk_frames` frames per request after the first."""

    streams: int
    chunk_frames: int

    @property
    def label(self) -> str:
        return f"{self.streams} stream(s), {self.chunk_frames} frame(s) per request"


# ---- the asyncio client ----------------------------------------------------------------------------

async def _decode_unpaced(client, codes: np.ndarray, chunk_frames: int) -> StreamResult:
    """One stream: a first request of 1 frame, then `chunk_frames` each, the next sent when the last
    returned (the last with END)."""
    bounds = chunk_bounds(codes.shape[1], chunk_frames)
    pcm, latencies_s = [], []
    async with client.stream() as stream:
        started_s = time.perf_counter()
        for first, stop in bounds:
            sent_s = time.perf_counter()
            pcm.append(await stream.decode(codes[:, first:stop], end=stop == codes.shape[1]))
            latencies_s.append(time.perf_counter() - sent_s)
    return StreamResult(stream.sequence_id, codes.shape[1], np.concatenate(pcm), [b - a for a, b in bounds],
                        latencies_s, started_s, time.perf_counter())


def decode_streams(url: str, codes: list[np.ndarray], chunk_frames: int) -> RunReport:
    """Every stream of `codes` at once through one asyncio client (one channel), unpaced."""
    from mimi_code2wav.client.aio import Code2WavClient

    options = StreamOptions(chunk_frames=chunk_frames)

    async def main() -> list[StreamResult]:
        async with Code2WavClient(url, options) as client:
            return list(await asyncio.gather(*(_decode_unpaced(client, c, chunk_frames) for c in codes)))

    results = asyncio.run(main())
    wall_s = max(r.finished_s for r in results) - min(r.started_s for r in results)
    return RunReport(results, options, wall_s)


def run_client_point(url: str, point: SweepPoint, load: SweepLoad) -> dict:
    """The point's streams through the asyncio client: latency, real-time factor, throughput."""
    codes = [random_codes(load.frames, load.seed + i) for i in range(point.streams)]
    stats = decode_streams(url, codes, point.chunk_frames).summary()
    return {
        "first_chunk_ms": stats["first_chunk_latency_ms_mean"], "first_chunk_ms_max": stats["first_chunk_latency_ms_max"],
        "p50_ms": stats["chunk_latency_ms_p50"], "p90_ms": stats["chunk_latency_ms_p90"],
        "p99_ms": stats["chunk_latency_ms_p99"], "real_time_factor": stats["real_time_factor"],
        "real_time_factor_per_stream_min": stats["real_time_factor_per_stream_min"],
        "frames_per_s": stats["frames_per_s"],
        "requests_per_s": stats["requests"] / stats["wall_s"], "requests": stats["requests"],
    }


# ---- perf_analyzer ---------------------------------------------------------------------------------

def parse_perf_report(text: str) -> dict:
    """Server and composing-model counts from perf_analyzer's text report."""
    parsed = {}
    server = re.search(r"Server:\s*\n\s*Inference count: (\d+)\s*\n\s*Execution count: (\d+)", text)
    if server:
        parsed["code2wav_requests"], parsed["code2wav_executions"] = int(server.group(1)), int(server.group(2))
    decoder = re.search(r"mimi_decoder, version: \S*\s*\n\s*Inference count: (\d+)\s*\n\s*Execution count: (\d+).*?"
                        r"queue (\d+) usec \+ compute input (\d+) usec \+ compute infer (\d+) usec", text, re.S)
    if decoder:
        inferences, executions = int(decoder.group(1)), int(decoder.group(2))
        parsed.update(decoder_steps=inferences, decoder_mean_batch=inferences / executions if executions else None,
                      decoder_queue_ms=int(decoder.group(3)) / 1e3, decoder_compute_infer_ms=int(decoder.group(5)) / 1e3)
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
        # No client run sized this point: a short probe does, so that it lasts about point_seconds at
        # any rate. N streams in a closed loop make N requests per request latency.
        probe = run_perf_point(url, point, load, 4 * point.streams / load.point_seconds, raw_dir, server_alive,
                               name_suffix="-probe")
        if "error" in probe:
            return probe
        request_rate_estimate = point.streams / (probe["p50_ms"] / 1e3)
    flags = ["--concurrency-range", str(point.streams)]
    count = max(math.ceil(request_rate_estimate * load.point_seconds), 4 * point.streams)
    name = f"perf-{point.streams}-c{point.chunk_frames}{name_suffix}"
    csv_path = raw_dir / f"{name}.csv"
    env = dict(os.environ, URL=url, STREAMS=str(point.streams), FRAMES=str(load.frames),
               CHUNK_FRAMES=str(point.chunk_frames), SEED=str(load.seed), CSV=str(csv_path),
               BUILD_DIR=str(raw_dir / "perf-build"), PYTHON=sys.executable)
    command = [str(PERF_SH), *flags, "--request-count", str(count)]
    row = {"request_count": count, "command": " ".join(["client/perf.sh", *flags, "--request-count", str(count)])}
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
        return {**row, "error": f"perf_analyzer exit {returncode}: {(error_lines or lines or ['no output'])[0].strip()}"}
    record = next(csv.DictReader(csv_path.open()))
    us = lambda column: float(record[column]) / 1e3  # noqa: E731  (CSV times are microseconds)
    row.update(
        requests_per_s=float(record["Inferences/Second"]),
        frames_per_s=float(record["Inferences/Second"]) * info["mean_frames_per_step"],
        p50_ms=us("p50 latency"), p90_ms=us("p90 latency"), p99_ms=us("p99 latency"),
        server_queue_ms=us("Server Queue"),
        server_compute_ms=us("Server Compute Input") + us("Server Compute Infer") + us("Server Compute Output"),
    )
    return {**row, **parse_perf_report(stdout)}


# ---- the ONNX step alone ---------------------------------------------------------------------------

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


# ---- the sweep -------------------------------------------------------------------------------------

def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Sweep:
    """The points of one run against one server (`url`, or the `local` server); rows go to `client`
    and `perf`, failed points are counted in `failures`; `server_exit` says how a local server died."""

    def __init__(self, load: SweepLoad, raw_dir: Path, url: str | None = None, local: LocalServer | None = None):
        self.load, self.raw_dir, self.local = load, raw_dir, local
        self.url = url or local.url
        self.client: list[dict] = []
        self.perf: list[dict] = []
        self.failures = 0
        self.server_exit: str | None = None

    def server_alive(self) -> bool:
        return self.local is None or self.local.server.is_alive()

    def warm_up(self, chunk_frames: list[int]) -> None:
        """The first requests of a fresh server pay one-off set-up costs: they are not measured."""
        from mimi_code2wav.client.sync import Code2WavClient

        Code2WavClient(self.url).check_ready()
        for chunk in chunk_frames:
            decode_streams(self.url, [random_codes(2 * chunk + 1, self.load.seed)], chunk)

    def measure(self, point: SweepPoint, run: Callable[[], dict]) -> dict:
        """One point, profiled; a local server that died during it is recorded in `server_exit`."""
        settle_gc()
        profile = self.local.profile() if self.local is not None else PointProfile(None, None)
        profile.start()
        try:
            row = run()
        except Exception as exc:  # a dying server also fails the client's requests
            row = {"error": f"{type(exc).__name__}: {exc}"}
        if not self.server_alive():
            server = self.local.server
            self.server_exit = (f"tritonserver exited during {point.label} (code {server.exit_code()}); the log's "
                                f"tail:\n{log_tail(server.log_path, 8)}")
            row["error"] = "the server exited during the point"
        elif "error" not in row:
            row["profile"] = profile.finish(row.get("requests", 0))
        row = {"streams": point.streams, "chunk_frames": point.chunk_frames, **row}
        self.failures += "error" in row
        return row

    def point(self, point: SweepPoint, client: bool, perf: bool) -> None:
        """The point with the asyncio client, then with perf_analyzer (its length sized by the
        client's request rate when the client ran)."""
        request_rate_estimate = None
        if client:
            _log(f"client        {point.label} ...")
            row = self.measure(point, lambda: run_client_point(self.url, point, self.load))
            request_rate_estimate = row.get("requests_per_s")
            self.client.append(row)
        if perf and self.server_exit is None:
            _log(f"perf_analyzer {point.label} ...")
            self.perf.append(self.measure(point, lambda: run_perf_point(
                self.url, point, self.load, request_rate_estimate, self.raw_dir, self.server_alive)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("--streams", type=parse_counts, default=[1, 8, 32], help="concurrent streams, swept (default 1,8,32)")
    parser.add_argument("--chunk-frames", type=parse_counts, default=[1, 4, 16],
                        help="frames per request after the first, swept (default 1,4,16)")
    parser.add_argument("--frames", type=int, default=96, help="frames per stream (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the codes; stream i uses seed + i")
    parser.add_argument("--point-seconds", type=float, default=5.0, help="approximate seconds per perf_analyzer point")
    parser.add_argument("--onnx", type=Path, help="the served ONNX step, for the overhead column (a local server's is known)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench_results", help="where results go (default bench_results/)")
    parser.add_argument("--no-client", action="store_true", help="skip the asyncio-client runs")
    parser.add_argument("--no-perf", action="store_true", help="skip perf_analyzer")


def _measure(args: argparse.Namespace, raw_dir: Path, local: LocalServer | None) -> tuple[dict, int]:
    """The sweep's results (without the summary) and its failed points."""
    sweep = Sweep(SweepLoad(args.frames, args.seed, args.point_seconds), raw_dir, url=args.url, local=local)
    sweep.warm_up(args.chunk_frames)
    meta = {**run_meta(f"triton-{args.decoder}" if local else "triton-url", command_line()),
            "server": local.description if local else f"running server at {args.url}", "url": sweep.url,
            "decoder": args.decoder if local else None, "front_instances": args.front_instances if local else None,
            "queue_delay_us": {"code2wav": args.front_queue_delay_us, "mimi_decoder": args.max_queue_delay_us} if local else None,
            "frames": args.frames, "chunk_frames": args.chunk_frames, "streams": args.streams}
    results = {"meta": meta, "client": sweep.client, "perf": sweep.perf, "decoder_step_ms": {}}
    onnx_path = args.onnx or (local.onnx_path if local is not None else None)
    if onnx_path is not None:
        _log("the ONNX step alone, batch 1 ...")
        results["decoder_step_ms"] = decoder_step_ms(onnx_path, args.chunk_frames)
    elif local is not None and args.decoder == "null":
        results["decoder_step_ms"] = dict.fromkeys(args.chunk_frames, 0.0)
    for chunk, streams in itertools.product(args.chunk_frames, args.streams):
        sweep.point(SweepPoint(streams, chunk), client=not args.no_client, perf=not args.no_perf)
        if sweep.server_exit is not None:
            _log(sweep.server_exit)
            meta["server_exit"] = sweep.server_exit
            break
    return results, sweep.failures


def run(args: argparse.Namespace) -> int:
    raw_dir = args.out_dir / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    try:
        with measured_server(args) as local:
            results, failures = _measure(args, raw_dir, local)
    except (ClientError, ServerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    results["summary"] = summarize(results)
    (args.out_dir / "bench.json").write_text(record_json(results))
    report = markdown_report(results)
    (args.out_dir / "bench.md").write_text(report + "\n")
    plotted = plot(results, args.out_dir / "bench.png")
    print(report)
    print(f"wrote {args.out_dir}/bench.md, bench.json" + (", bench.png" if plotted else " (no plot: matplotlib is not installed)")
          + " and raw/")
    if failures:
        print(f"{failures} point(s) failed: see the tables and {raw_dir}", file=sys.stderr)
    return 1 if failures or "server_exit" in results["meta"] else 0
