"""`python -m benchmarks failover`: what live streams feel when a replica dies under them.

N replicas behind nginx (`replicas.ReplicaSet`, free ports, a run folder of their own), S paced
resumable streams (`client.run_streams`: one request in flight per stream, each request C
frames, sent when its last frame exists), and at `--kill-at-s` the replica holding the most streams
gets `--signal` (SIGKILL: a crash; SIGSTOP: a hang, which resumable clients notice by their response
timeout). Reported, as a table and as JSON in `--out-dir`:

- streams that kept their replica: how many resumed anyway (none should: their server never went),
  and their request latency (send -> PCM) in the `--window-s` after the fault and over the run;
- streams that moved: the stall (last answer before the fault -> first answer after the resume).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

from mimi_code2wav.client.protocol import FRAME_DURATION_S, ClientError, StreamOptions, random_codes
from mimi_code2wav.client.report import percentiles
from mimi_code2wav.client.sync import run_streams
from mimi_code2wav.server.nginx import NginxError, replicas_by_stream
from mimi_code2wav.server.processes import ServerError
from mimi_code2wav.server.replicas import ReplicaSet
from mimi_code2wav.server.serve import add_repository_arguments, prepare_repository

from .provenance import command_line, run_meta, write_run

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


def _percentiles_ms(values_s: list[float]) -> dict[str, float | None]:
    return percentiles(np.asarray(values_s) * 1e3)


def measure(args: argparse.Namespace, repository: Path) -> dict:
    frames = int(round(args.seconds / FRAME_DURATION_S))
    codes = [random_codes(frames, seed=args.codes_seed + n) for n in range(args.streams)]
    keys = [f"call-{n}" for n in range(args.streams)]
    options = StreamOptions(chunk_frames=args.chunk_frames, first_chunk_frames=args.chunk_frames, paced=True,
                            resume_history_frames=args.history_frames, resume_timeout_s=60.0,
                            response_timeout_s=args.response_timeout_s)
    run_dir = Path(args.out_dir) / "replicas"
    with ReplicaSet(repository, args.replicas, run_dir=run_dir, grpc_port=0, http_port=0,
                    replica_base_port=None) as replica_set:
        outcome: dict = {}

        def decode_all() -> None:
            try:
                outcome["report"] = run_streams(replica_set.proxy_grpc_url, codes, options,
                                                sequence_ids=[1000 + n for n in range(args.streams)],
                                                stream_keys=keys)
            except BaseException as error:  # reported below
                outcome["error"] = error

        streams = threading.Thread(target=decode_all, name="failover-streams", daemon=True)
        streams.start()
        time.sleep(args.kill_at_s)
        placement = {key: sorted(urls)[0] for key, urls in replicas_by_stream(replica_set.proxy.requests()).items()}
        holders = {url: [key for key in keys if placement.get(key) == url] for url in set(placement.values())}
        victim_url = max(holders, key=lambda url: len(holders[url]))
        victim = next(replica for replica in replica_set.replicas if replica.grpc_url == victim_url)
        fault_s = time.perf_counter()
        print(f"{args.signal} of replica {victim.index} ({victim_url}), holding {len(holders[victim_url])} of "
              f"{args.streams} streams, at {args.kill_at_s:g} s", flush=True)
        victim.server.process.send_signal(SIGNALS[args.signal])
        streams.join(args.seconds + 180)
        if args.signal == "STOP":
            victim.server.process.send_signal(signal.SIGCONT)
        if "error" in outcome:
            raise outcome["error"]
        if streams.is_alive():
            raise ClientError("the streams did not finish within their length plus 180 s")
        report = outcome["report"]

    kept, moved = [], []
    for key, result in zip(keys, report.results):
        (moved if placement.get(key) == victim_url else kept).append((key, result))
    window = [latency for _, result in kept
              for sent, latency in zip(result.chunk_sent_s, result.chunk_latencies_s)
              if fault_s <= sent + latency and sent <= fault_s + args.window_s]
    over_run = [latency for _, result in kept for latency in result.chunk_latencies_s]
    before = [latency for _, result in kept for sent, latency in zip(result.chunk_sent_s, result.chunk_latencies_s)
              if sent + latency < fault_s]
    return {
        "meta": run_meta("failover", command_line()),
        "replicas": args.replicas, "streams": args.streams, "chunk_frames": args.chunk_frames,
        "seconds": args.seconds, "fault": args.signal, "fault_at_s": args.kill_at_s, "window_s": args.window_s,
        "history_frames": args.history_frames,
        "moved_streams": len(moved), "kept_streams": len(kept),
        "kept_streams_resumed": sum(1 for _, result in kept if result.resumes),
        "kept_after_fault": _percentiles_ms(window),
        "kept_before_fault": _percentiles_ms(before),
        "kept_whole_run": _percentiles_ms(over_run),
        "moved_stall": _percentiles_ms([result.resumes[0].stall_s for _, result in moved if result.resumes]),
        "moved_resumes": [len(result.resumes) for _, result in moved],
        "real_time_factor_min": float(min(result.real_time_factor for result in report.results)),
    }


def table(record: dict) -> str:
    """The latency table of a failover run (the caller writes the stamp)."""
    def row(name: str, figures: dict) -> str:
        cells = [f"{figures[k]:.0f}" if figures[k] is not None else "-" for k in ("p50", "p99", "max")]
        return f"| {name} | " + " | ".join(cells) + " |"

    return "\n".join([
        f"{record['fault']} of the busiest of {record['replicas']} replicas at {record['fault_at_s']:g} s: "
        f"{record['streams']} paced streams of {record['chunk_frames']}-frame requests, {record['moved_streams']} "
        f"moved, {record['kept_streams']} kept their replica ({record['kept_streams_resumed']} of them resumed)",
        "",
        "| requests | p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|",
        row(f"kept streams, {record['window_s']:g} s after the fault", record["kept_after_fault"]),
        row("kept streams, before the fault", record["kept_before_fault"]),
        row("kept streams, whole run", record["kept_whole_run"]),
        row("moved streams: stall until resumed", record["moved_stall"]),
    ])


def run(args: argparse.Namespace) -> int:
    try:
        repository = prepare_repository(args)
        record = measure(args, repository)
    except (ServerError, NginxError, ClientError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    write_run(Path(args.out_dir), "failover", record, table(record))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_repository_arguments(parser, "every replica serves")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--streams", type=int, default=12)
    parser.add_argument("--chunk-frames", type=int, default=4, help="frames per request (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=40.0, help="audio per stream (default %(default)s)")
    parser.add_argument("--kill-at-s", type=float, default=22.0, help="when the fault comes (default %(default)s)")
    parser.add_argument("--signal", choices=sorted(SIGNALS), default="KILL")
    parser.add_argument("--window-s", type=float, default=15.0,
                        help="latency window after the fault (default %(default)s)")
    parser.add_argument("--history-frames", type=int, default=250)
    parser.add_argument("--response-timeout-s", type=float, default=5.0,
                        help="a request unanswered this long resumes the stream (default %(default)s)")
    parser.add_argument("--codes-seed", type=int, default=0, help="seed of the streams' random codes")
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("--out-dir", default="bench_results/failover")
