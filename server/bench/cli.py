"""Benchmark code2wav through Triton: unpaced streams x request sizes, and paced live streams.

    code2wav-server bench [--url HOST:PORT] [--decoder python-ort|null] [--streams 1,8,32]
                          [--chunk-frames 1,4,16] [--paced-streams 4,8,12,16,24,32] [--frames 96]
                          [--point-seconds 5] [--out-dir bench_results] [--no-client] [--no-perf]
                          [the serving flags of `code2wav-export render`: --front-instances 1 ...]

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
Results go to OUT_DIR: bench.md (tables), bench.json (`code2wav-server record --add` records it),
bench.png (latency and throughput against streams) and raw/ (perf_analyzer CSVs and reports). The
load generators run on the same CPU cores as the server, and the tables say so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from mimi_code2wav.client.stream import ClientError

from .local_server import LocalServer, add_server_arguments, decoder_step_ms, measured_server
from .points import SweepLoad, SweepPoint
from .provenance import REPO_ROOT, command_line, run_meta
from .report import markdown_report, plot, summarize
from .sweep import Sweep


def parse_counts(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("comma-separated integers >= 1")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument("--streams", type=parse_counts, default=[1, 8, 32], help="unpaced sweep (default 1,8,32)")
    parser.add_argument("--chunk-frames", type=parse_counts, default=[1, 4, 16],
                        help="frames per request after the first, swept (default 1,4,16)")
    parser.add_argument("--paced-streams", type=parse_counts, default=[4, 8, 12, 16, 24, 32],
                        help="paced live streams, tried in turn until one falls behind (default 4,8,12,16,24,32)")
    parser.add_argument("--frames", type=int, default=96, help="frames per stream (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the codes; stream i uses seed + i")
    parser.add_argument("--point-seconds", type=float, default=5.0, help="approximate seconds per perf_analyzer point")
    parser.add_argument("--onnx", type=Path, help="the served ONNX step, for the overhead column (a local server's is known)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench_results", help="where results go (default bench_results/)")
    parser.add_argument("--no-client", action="store_true", help="skip the streaming-client runs")
    parser.add_argument("--no-perf", action="store_true", help="skip perf_analyzer")


def _meta(args: argparse.Namespace, server: str, url: str) -> dict:
    local = not args.url
    return {
        **run_meta(f"triton-{args.decoder}" if local else "triton-url", command_line("code2wav-server")),
        "server": server, "url": url, "decoder": args.decoder if local else None,
        "front_instances": args.front_instances if local else None,
        "queue_delay_us": {"code2wav": args.front_queue_delay_us, "mimi_decoder": args.max_queue_delay_us} if local else None,
        "frames": args.frames, "chunk_frames": args.chunk_frames, "streams": args.streams,
        "paced_streams": args.paced_streams,
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
        sweep.unpaced(SweepPoint(streams, chunk), client=not args.no_client, perf=not args.no_perf)
    if not args.no_client:
        for catch_up in (False, True):
            sweep.paced(args.paced_streams, catch_up)
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
