"""Benchmark code2wav through Triton: streams x request sizes, each stream as fast as it is answered.

    python -m benchmarks sweep [--url HOST:PORT] [--decoder python-ort|null] [--streams 1,8,32]
                          [--chunk-frames 1,4,16] [--frames 96]
                          [--point-seconds 5] [--out-dir bench_results] [--no-client] [--no-perf]
                          [the serving flags of `code2wav-export render`: --front-instances 1 ...]

Without --url (or $URL) it starts a local server first, as `make serve` does but from its own build
folder (build/bench, seeded random weights unless --weights: speed does not depend on the weight
values), with the python-ort decoder or, with `--decoder null`, the null decoder (the decoder's
interface returning silence at once): that run measures the front's own ceiling, what gRPC, code2wav
and the sequence-batcher hop carry, which bounds what any decoder behind it can be given.

- For every request size F (`--chunk-frames`) and number of streams N, unpaced (each stream sends
  its next request when the previous one returned): the asyncio client (`mimi_code2wav.client.aio`,
  one channel, one task per stream; a first request of 1 frame, then F frames, with frame_offset)
  and perf_analyzer (client/perf.sh, `--concurrency-range N`, deltas): requests/s, frames/s, request
  p50/p99, first-chunk latency, the decoder's mean batch.
- Live streams, paced at 80 ms per frame, are `python -m benchmarks duplex`'s: the most conversations
  whose frames meet a playout budget, per request policy.
- Triton overhead per request: the 1-stream request p50 minus the same ONNX step run directly in
  ONNX Runtime (batch 1, F frames, in this process) when the export is at hand.
Results go to OUT_DIR: bench.md (tables), bench.json (`python -m benchmarks record --add` records it),
bench.png (latency and throughput against streams) and raw/ (perf_analyzer CSVs and reports). The
load generators run on the same CPU cores as the server, and the tables say so.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mimi_code2wav.client.protocol import ClientError, StreamOptions, chunk_bounds, random_codes
from mimi_code2wav.client.report import RunReport, StreamResult

from .local_server import LocalServer, add_server_arguments, decoder_step_ms, measured_server
from .perf import run_perf_point
from .profile import PointProfile, settle_gc
from .provenance import REPO_ROOT, command_line, record_json, run_meta
from .report import markdown_report, plot, summarize


@dataclass(frozen=True)
class SweepLoad:
    """What every point of a sweep sends: streams of `frames` frames of random codes (stream i seeded
    `seed + i`), each perf_analyzer point lasting about `point_seconds`."""

    frames: int
    seed: int
    point_seconds: float


@dataclass(frozen=True)
class SweepPoint:
    """`streams` concurrent streams, `chunk_frames` frames per request after the first; each stream
    sends its next request when the last returned."""

    streams: int
    chunk_frames: int

    @property
    def label(self) -> str:
        return f"{self.streams} stream(s), {self.chunk_frames} frame(s) per request"

    def row(self) -> dict:
        """The point's fields as they head its result row."""
        return {"streams": self.streams, "chunk_frames": self.chunk_frames}


async def _decode_unpaced(client, codes: np.ndarray, chunk_frames: int) -> StreamResult:
    """One stream through the asyncio client: a first request of 1 frame, then `chunk_frames` each,
    the next sent when the last returned (the last with END)."""
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
        "streams": point.streams, "chunk_frames": point.chunk_frames,
        "first_chunk_ms": stats["first_chunk_latency_ms_mean"],
        "first_chunk_ms_max": stats["first_chunk_latency_ms_max"],
        "p50_ms": stats["chunk_latency_ms_p50"], "p90_ms": stats["chunk_latency_ms_p90"],
        "p99_ms": stats["chunk_latency_ms_p99"],
        "real_time_factor": stats["real_time_factor"],
        "real_time_factor_per_stream_min": stats["real_time_factor_per_stream_min"],
        "frames_per_s": stats["frames_per_s"],
        "requests_per_s": stats["requests"] / stats["wall_s"], "requests": stats["requests"],
    }


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Sweep:
    """The points of one run against one server (`url`, or the `local` server it started); rows go
    to `client` and `perf`, failed points are counted in `failures`."""

    def __init__(self, load: SweepLoad, raw_dir: Path, url: str | None = None, local: LocalServer | None = None):
        self.load, self.raw_dir, self._url, self.local = load, raw_dir, url, local
        self.client: list[dict] = []
        self.perf: list[dict] = []
        self.failures = 0

    @property
    def url(self) -> str:
        return self._url or self.local.url

    def server_alive(self) -> bool:
        return self.local is None or self.local.server.is_alive()

    def warm_up(self, chunk_frames: list[int]) -> None:
        """The first requests of a fresh server pay one-off set-up costs: they are not measured."""
        from mimi_code2wav.client.sync import Code2WavClient

        Code2WavClient(self.url).check_ready()
        for chunk in chunk_frames:
            decode_streams(self.url, [random_codes(2 * chunk + 1, self.load.seed)], chunk)

    def measure(self, point: SweepPoint, run: Callable[[str], dict]) -> dict:
        """One point, profiled. A local server that dies during it is restarted and the point
        measured once more; the row records the crash (a second crash leaves the error)."""
        for attempt in (1, 2):
            settle_gc()
            profile = self.local.profile() if self.local is not None else PointProfile(None, None)
            profile.start()
            try:
                row = run(self.url)
            except Exception as exc:  # a dying server also fails the client's requests
                row = {"error": f"{type(exc).__name__}: {exc}"}
            if not self.server_alive():
                why = self.local.restart()
                _log(f"{point.label}: {why}\nrestarted the server")
                if attempt == 1:
                    continue
                row.setdefault("error", "the server crashed twice")
            if "error" not in row:
                row["profile"] = profile.finish(row.get("requests", 0))
            if attempt == 2:
                row["after_server_crash"] = True
            row = {**point.row(), **row}
            self.failures += "error" in row
            return row

    def point(self, point: SweepPoint, client: bool, perf: bool) -> None:
        """The point with the asyncio client, then with perf_analyzer (its length sized by the
        client's request rate when the client ran)."""
        request_rate_estimate = None
        if client:
            _log(f"client        {point.label} ...")
            row = self.measure(point, lambda url: run_client_point(url, point, self.load))
            request_rate_estimate = row.get("requests_per_s")
            self.client.append(row)
        if perf:
            _log(f"perf_analyzer {point.label} ...")
            self.perf.append(self.measure(point, lambda url: run_perf_point(
                url, point, self.load, request_rate_estimate, self.raw_dir, self.server_alive)))

def parse_counts(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("comma-separated integers >= 1")
    return values


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


def _meta(args: argparse.Namespace, server: str, url: str) -> dict:
    local = not args.url
    return {
        **run_meta(f"triton-{args.decoder}" if local else "triton-url", command_line()),
        "server": server, "url": url, "decoder": args.decoder if local else None,
        "front_instances": args.front_instances if local else None,
        "queue_delay_us": {"code2wav": args.front_queue_delay_us, "mimi_decoder": args.max_queue_delay_us} if local else None,
        "frames": args.frames, "chunk_frames": args.chunk_frames, "streams": args.streams,
    }


def _measure(args: argparse.Namespace, raw_dir: Path, local: LocalServer | None) -> tuple[dict, int]:
    """The sweep's results (without the summary) and its failed points."""
    onnx_path = args.onnx or (local.onnx_path if local is not None else None)
    sweep = Sweep(SweepLoad(args.frames, args.seed, args.point_seconds), raw_dir, url=args.url, local=local)
    sweep.warm_up(args.chunk_frames)
    results = {"meta": _meta(args, local.description if local else f"running server at {args.url}", sweep.url),
               "client": sweep.client, "perf": sweep.perf, "decoder_step_ms": {}}
    if onnx_path is not None:
        print("the ONNX step alone, batch 1 ...", file=sys.stderr, flush=True)
        results["decoder_step_ms"] = decoder_step_ms(onnx_path, args.chunk_frames)
    elif not args.url and args.decoder == "null":
        results["decoder_step_ms"] = dict.fromkeys(args.chunk_frames, 0.0)
    for chunk, streams in itertools.product(args.chunk_frames, args.streams):
        sweep.point(SweepPoint(streams, chunk), client=not args.no_client, perf=not args.no_perf)
    if local is not None and local.crashes:
        results["meta"]["server_crashes"] = local.crashes
    return results, sweep.failures


def run(args: argparse.Namespace) -> int:
    raw_dir = args.out_dir / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    try:
        with measured_server(args) as local:
            results, failures = _measure(args, raw_dir, local)
    except ClientError as exc:
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
    return 1 if failures else 0
