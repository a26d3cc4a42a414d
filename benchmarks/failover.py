"""`python -m benchmarks failover`: what live streams feel when a replica dies under them.

The README's CPU scale-out (the compose `scale` profile with docker-compose.cpu.yml: three replicas behind
nginx) on this host's Docker engine with docker_env's stand-in images, paced resumable streams through the
proxy, and at `--kill-at-s` `--signal` sent from the host, so as root, to the tritonserver of the replica
holding the most streams. Reported: the latency of the streams that kept their replica (none may resume),
the stall of those that moved. Writes OUT_DIR/failover.json and failover.md."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

from mimi_code2wav.client.protocol import FRAME_DURATION_S, ClientError, StreamOptions, random_codes
from mimi_code2wav.client.report import percentiles
from mimi_code2wav.client.sync import run_streams
from mimi_code2wav.server.processes import report

from .docker_env import REPLICAS, Compose, DockerUnavailable, docker_environment
from .provenance import add_options, md_row, run_meta, write_run

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.cpu.yml")


def measure(args: argparse.Namespace, compose: Compose) -> dict:
    percentiles_ms = lambda values_s: percentiles(np.asarray(values_s) * 1e3)  # noqa: E731
    codes = [random_codes(int(round(args.seconds / FRAME_DURATION_S)), seed=args.codes_seed + n) for n in range(args.streams)]
    keys = [f"call-{n}" for n in range(args.streams)]
    options = StreamOptions(chunk_frames=args.chunk_frames, first_chunk_frames=args.chunk_frames, paced=True,
                            resume_history_frames=args.history_frames, resume_timeout_s=60.0,
                            response_timeout_s=args.response_timeout_s)
    outcome: dict = {}

    def decode_all() -> None:
        try:
            outcome["report"] = run_streams(compose.grpc_url, codes, options,
                                            sequence_ids=[1000 + n for n in range(args.streams)], stream_keys=keys)
        except BaseException as error:  # reported below
            outcome["error"] = error

    started = time.time()
    streams = threading.Thread(target=decode_all, name="failover-streams", daemon=True)
    streams.start()
    time.sleep(args.kill_at_s)
    placement = {key: sorted(services)[0] for key, services in compose.placement(started).items()}
    holders = {service: [key for key in keys if placement.get(key) == service] for service in REPLICAS}
    victim = max(REPLICAS, key=lambda service: len(holders[service]))
    if not holders[victim]:
        raise ClientError(f"the proxy's access log placed no stream on any replica by {args.kill_at_s:g} s")
    pid = compose.tritonserver_pid(victim)
    fault_s = time.perf_counter()
    print(f"{args.signal} of {victim}'s tritonserver, holding {len(holders[victim])} of {args.streams} streams, "
          f"at {args.kill_at_s:g} s", flush=True)
    os.kill(pid, SIGNALS[args.signal])
    streams.join(args.seconds + 180)
    if "error" in outcome:
        raise outcome["error"]
    if streams.is_alive():
        raise ClientError("the streams did not finish within their length plus 180 s")
    results = outcome["report"].results
    moved = [result for key, result in zip(keys, results) if placement.get(key) == victim]
    kept = [result for key, result in zip(keys, results) if placement.get(key) != victim]
    requests = [(sent, latency) for result in kept for sent, latency in zip(result.chunk_sent_s, result.chunk_latencies_s)]
    return {
        "meta": run_meta("failover"),
        "replicas": len(REPLICAS), "streams": args.streams, "chunk_frames": args.chunk_frames,
        "seconds": args.seconds, "fault": args.signal, "fault_at_s": args.kill_at_s, "window_s": args.window_s,
        "history_frames": args.history_frames,
        "moved_streams": len(moved), "kept_streams": len(kept),
        "kept_streams_resumed": sum(1 for result in kept if result.resumes),
        "kept_after_fault": percentiles_ms([latency for sent, latency in requests
                                             if fault_s <= sent + latency and sent <= fault_s + args.window_s]),
        "kept_before_fault": percentiles_ms([latency for sent, latency in requests if sent + latency < fault_s]),
        "kept_whole_run": percentiles_ms([latency for result in kept for latency in result.chunk_latencies_s]),
        "moved_stall": percentiles_ms([result.resumes[0].stall_s for result in moved if result.resumes]),
        "moved_resumes": [len(result.resumes) for result in moved],
        "real_time_factor_min": float(min(result.real_time_factor for result in results)),
        # Paced streams take their audio's length; a kept stream the fault slowed takes longer.
        "kept_wall_per_audio_max": float(max(result.wall_s / result.audio_s for result in kept)) if kept else None,
    }


def table(record: dict) -> str:
    """The latency table of a failover run (the caller writes the stamp)."""
    def row(name: str, figures: dict) -> str:
        return md_row(name, *(f"{figures[k]:.0f}" if figures[k] is not None else "-" for k in ("p50", "p99", "max")))

    return "\n".join([
        f"{record['fault']} of the busiest of {record['replicas']} replicas at {record['fault_at_s']:g} s: "
        f"{record['streams']} paced streams of {record['chunk_frames']}-frame requests, {record['moved_streams']} "
        f"moved, {record['kept_streams']} kept their replica ({record['kept_streams_resumed']} of them resumed); "
        f"slowest stream at {record['real_time_factor_min']:.2f}x real time"
        + (f"; the slowest kept stream took {record['kept_wall_per_audio_max']:.2f}x its audio's length"
           if record.get("kept_wall_per_audio_max") is not None else ""),
        "",
        "| requests | p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|",
        row(f"kept streams, {record['window_s']:g} s after the fault", record["kept_after_fault"]),
        row("kept streams, before the fault", record["kept_before_fault"]),
        row("kept streams, whole run", record["kept_whole_run"]),
        row("moved streams: stall until resumed", record["moved_stall"]),
    ])


def run(args: argparse.Namespace) -> int:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = Path(args.weights or "build").resolve()  # --weights: a checkpoint file or a transformers folder
    if args.weights and not path.exists():
        raise ClientError(f"--weights {args.weights}: no such file or folder")
    variables = {"MIMI_WEIGHTS_DIR": str(path.parent), "MIMI_WEIGHTS": path.name} if path.is_file() else {"MIMI_WEIGHTS_DIR": str(path)}
    variables.update({"MIMI_RANDOM_INIT": "1"} if args.weights is None else {})  # None: seeded random weights
    try:
        with docker_environment(args.build_dir) as env:
            compose = Compose(env, args.out_dir, COMPOSE_FILES, **variables)
            try:
                print(f"compose --profile scale up (log: {args.out_dir / compose.project}.log)", flush=True)
                compose.up("scale", "triton-proxy")
                record = measure(args, compose)
            finally:
                compose.down()
    except (DockerUnavailable, AssertionError) as error:
        return report(error)
    except PermissionError as error:
        return report(f"signalling the container's tritonserver from the host needs root: {error}")
    write_run(args.out_dir, "failover", record, table(record))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", help="a moshi-format .safetensors checkpoint or a transformers folder "
                        "(default: seeded random weights)")
    parser.add_argument("--signal", choices=sorted(SIGNALS), default="KILL", help="KILL: a crash; STOP: a hang")
    add_options(parser, ("--build-dir", Path("build/docker"), "the Docker tooling's folder: engine log, Compose, stand-in images"),
                ("--out-dir", Path("bench_results/failover"), "where results go"), ("--streams", 12, "paced streams"),
                ("--chunk-frames", 4, "frames per request"), ("--seconds", 40.0, "audio per stream"),
                ("--kill-at-s", 22.0, "when the fault comes"), ("--window-s", 15.0, "latency window after the fault"),
                ("--history-frames", 250, "frames of history a resume replays"),
                ("--response-timeout-s", 5.0, "a request unanswered this long resumes the stream"),
                ("--codes-seed", 0, "seed of the streams' random codes"))
