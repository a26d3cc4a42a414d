"""`python -m benchmarks memory`: the server's memory against live streams, and after they expire.

    python -m benchmarks memory [--streams 16,32,64] [--steps 1,4,4] [--idle-timeout-s 4] [--bursts 1]
                           [--decoder-parameter KEY=VALUE] [--out-dir bench_results] [--build-dir build/memory]

Starts a local server (`--decoder`, python-ort by default; seeded random weights, its own build folder and ports)
whose stream idle timeout is `--idle-timeout-s`, then for each count N in `--streams` opens streams
until N are live (every stream STARTs and takes the steps of `--steps`, all streams of a wave
concurrently so the decoder batches them, and never ENDs), and reads the memory of the server's
whole process group (tritonserver and every Python stub) from /proc: RSS and PSS (shared memory
counted once) per process and in total. Then it waits until both models have expired every stream
and reads it again; then `--bursts` more bursts of the largest N, each read live and expired, show
whether memory is held, leaks or creeps. `--decoder-parameter` sets a parameter of the decoder's
config (e.g. `enable_mem_pattern=1`: ONNX Runtime's memory patterns, which the native config turns
off) to compare against the served config. Prints a table and writes OUT_DIR/memory.json and memory.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import numpy as np

from mimi_code2wav.client.protocol import SAMPLES_PER_FRAME, random_codes
from mimi_code2wav.server.processes import group_pids
from mimi_code2wav.server.serve import LOCAL_TARGETS
from mimi_code2wav.server.triton import fetch_metrics, metric_value

from .profile import process_role
from .provenance import REPO_ROOT, command_line, run_meta, write_run

MIB = 2**20


def _smaps_rollup(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of process `pid` in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[key] = int(parts[0]) * 1024
    return fields.get("Rss", 0), fields.get("Pss", 0)


def snapshot(pgid: int, label: str, live: dict[str, float | None]) -> dict:
    """RSS and PSS (MiB) of the processes of process group `pgid` (a server started by TritonServer leads
    its own group, its Python stubs included) in total, and per role (one process of each role)."""
    found = []
    for pid in group_pids(pgid):
        try:
            found.append((process_role(pid), pid, *_smaps_rollup(pid)))
        except (OSError, ValueError):
            continue  # gone meanwhile
    found.sort()
    return {"label": label, "live_streams": live,
            "rss_mib": sum(rss for _, _, rss, _ in found) / MIB, "pss_mib": sum(pss for *_, pss in found) / MIB,
            "processes": {role: {"pid": pid, "rss_mib": rss / MIB, "pss_mib": pss / MIB} for role, pid, rss, pss in found}}


def live_streams(metrics_url: str) -> dict[str, float | None]:
    samples = fetch_metrics(metrics_url)
    return {
        "code2wav": metric_value(samples, "code2wav_live_streams"),
        "mimi_decoder": metric_value(samples, "mimi_decoder_live_streams"),
    }


def open_streams(url: str, first_id: int, count: int, steps: list[int], seed: int, settle_s: float = 0.3) -> None:
    """START `count` streams (ids first_id ..) and run each through `steps` (frames per request),
    every step of all streams in flight together; the streams are left open. Returns `settle_s`
    after the last answer: a backend frees a run's gathered inputs only after it has answered."""
    import tritonclient.grpc as grpcclient

    frames = sum(steps)
    codes = [random_codes(frames, seed + i) for i in range(count)]
    with grpcclient.InferenceServerClient(url) as client:
        start = 0
        for index, size in enumerate(steps):
            pending = []
            for i in range(count):
                flat = np.ascontiguousarray(codes[i][:, start : start + size]).reshape(1, -1)
                inputs = [grpcclient.InferInput("input_ids", list(flat.shape), "INT64"),
                          grpcclient.InferInput("frame_offset", [1, 1], "INT64")]
                inputs[0].set_data_from_numpy(flat)
                inputs[1].set_data_from_numpy(np.array([[start]], dtype=np.int64))
                done = Future()
                client.async_infer("code2wav", inputs, partial(_settle, done), sequence_id=first_id + i,
                                   sequence_start=index == 0, client_timeout=120)
                pending.append(done)
            for done in pending:
                samples = done.result(timeout=180).as_numpy("model_outputs").size
                if samples != size * SAMPLES_PER_FRAME:
                    raise RuntimeError(f"a step of {size} frames returned {samples} samples")
            start += size
    time.sleep(settle_s)


def _settle(done: Future, result, error) -> None:
    if error is not None:
        done.set_exception(RuntimeError(f"request failed: {error}"))
    else:
        done.set_result(result)


def wait_expired(metrics_url: str, timeout_s: float, decoder_margin_s: float = 0.0) -> float:
    """Seconds until the models report no live stream (raises after timeout_s). A native decoder
    reports none: its sequences idle out `decoder_margin_s` after code2wav's streams (its idle timeout
    is code2wav's plus that margin), so that much more is waited once code2wav reports none."""
    began = time.monotonic()
    while True:
        live = live_streams(metrics_url)
        if all(value == 0 for value in live.values() if value is not None):
            if live.get("mimi_decoder") is None:
                time.sleep(decoder_margin_s)
            return time.monotonic() - began
        if time.monotonic() - began > timeout_s:
            raise RuntimeError(f"streams still live after {timeout_s:.0f} s: {live}")
        time.sleep(0.25)


def set_parameters(config_path: Path, parameters: dict[str, str]) -> None:
    """Set string `parameters` in a model's config.pbtxt (the rendered copy a benchmark serves)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    config_path.write_text(text_format.MessageToString(config))


def memory_markdown(results: dict) -> str:
    """The memory table and its summary (the caller writes the stamp)."""
    meta = results["meta"]
    roles = sorted({role for row in results["rows"] for role in row["processes"]})
    lines = [
        f"The {meta.get('decoder', 'python-ort')} decoder, state {meta['state_mib_per_stream']:.2f} MiB per stream; PSS "
        "counts shared memory once; live streams as the decoder counts them, else as code2wav does.",
        "",
        "| point | live streams | total PSS MiB | total RSS MiB | " + " | ".join(f"{r} RSS" for r in roles)
        + " | PSS per stream over idle MiB |",
        "|---|---|---|---|" + "---|" * len(roles) + "---|",
    ]
    base = results["rows"][0]["pss_mib"]
    for row in results["rows"]:
        live = row["live_streams"].get("mimi_decoder")
        if live is None:  # the native decoder reports no live streams
            live = row["live_streams"].get("code2wav")
        per_stream = (row["pss_mib"] - base) / live if live else None
        lines.append(
            f"| {row['label']} | {'' if live is None else int(live)} | {row['pss_mib']:.0f} | {row['rss_mib']:.0f} | "
            + " | ".join(f"{row['processes'][r]['rss_mib']:.0f}" if r in row["processes"] else "" for r in roles)
            + f" | {'' if per_stream is None else f'{per_stream:.1f}'} |"
        )
    summary = results["summary"]
    lines += [
        "",
        f"Per live stream at {summary['streams']} streams: {summary['per_stream_mib']:.1f} MiB "
        f"({summary['per_stream_over_state']:.2f}x the state). After expiry: "
        f"{summary['after_expiry_over_idle']:.3f}x the idle PSS (second burst: {summary['after_second_expiry_over_idle']:.3f}x).",
    ]
    if meta.get("decoder_parameters"):
        lines.append("Decoder config parameters set: " + ", ".join(f"`{k}: {v}`" for k, v in meta["decoder_parameters"].items()) + ".")
    count = summary["streams"]
    later = [row for row in results["rows"] if row["label"] == f"{count} live again" or row["label"].startswith(f"{count} live, burst")]
    if len(later) > 1:
        lines.append(f"Live PSS over {len(later)} more bursts of {count}: " + ", ".join(f"{row['pss_mib']:.0f}" for row in later) + " MiB.")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", default="16,32,64",
                        help="live-stream counts to measure at, ascending (default %(default)s)")
    parser.add_argument("--steps", default="1,4,4", help="frames per request of every stream (default %(default)s)")
    parser.add_argument("--idle-timeout-s", type=float, default=4.0,
                        help="the served stream idle timeout, so that expiry comes quickly (default %(default)s)")
    parser.add_argument("--decoder", choices=LOCAL_TARGETS, default="python-ort",
                        help="the decoder target (onnxruntime: Triton's native backend) (default %(default)s)")
    parser.add_argument("--bursts", type=int, default=1,
                        help="bursts of the largest count after the first expiry, each expired (default %(default)s)")
    parser.add_argument("--decoder-parameter", action="append", default=[], metavar="KEY=VALUE",
                        help="a parameter to set in the decoder's config.pbtxt (repeatable)")
    parser.add_argument("--build-dir", type=Path, default=REPO_ROOT / "build" / "memory", help="the local server's build folder")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench_results", help="where results go")


def run(args: argparse.Namespace) -> int:
    from mimi_code2wav.export.onnx_export import read_manifest
    from mimi_code2wav.export.pipeline import prepare_local_repository
    from mimi_code2wav.export.render import DECODER_IDLE_MARGIN_US, set_idle_timeout
    from mimi_code2wav.export.spec import DecoderSpec
    from mimi_code2wav.server.supervise import running_server

    if args.bursts < 1 or any("=" not in item for item in args.decoder_parameter):
        raise SystemExit("error: --bursts takes 1 or more; --decoder-parameter takes KEY=VALUE")
    counts = sorted({int(v) for v in args.streams.split(",") if v.strip()})
    steps = [int(v) for v in args.steps.split(",") if v.strip()]
    repository = prepare_local_repository(None, True, 0, args.build_dir, target=args.decoder)
    set_idle_timeout(repository, args.idle_timeout_s)
    parameters = dict(item.split("=", 1) for item in args.decoder_parameter)
    if parameters:
        set_parameters(repository / "mimi_decoder" / "config.pbtxt", parameters)
    decoder_margin_s = DECODER_IDLE_MARGIN_US / 1e6 + 0.5  # and Triton's reaper's moment
    spec = DecoderSpec.from_dict(read_manifest(next((args.build_dir / "export").iterdir()))["spec"])
    state_mib = spec.state_bytes_per_stream() / MIB
    rows = []
    with running_server(repository, log_path=args.build_dir / "tritonserver.log", ready_timeout_s=120.0) as server:
        pgid = server.pid

        def take(label: str) -> None:
            row = snapshot(pgid, label, live_streams(server.metrics_url))
            rows.append(row)
            print(f"{label:28s} PSS {row['pss_mib']:7.0f} MiB  RSS {row['rss_mib']:7.0f} MiB  live {row['live_streams']}",
                  file=sys.stderr, flush=True)

        def expire() -> float:
            """Seconds until every stream expired; then the batches' shared arrays go with their last stream."""
            waited = wait_expired(server.metrics_url, 10 * args.idle_timeout_s + 30, decoder_margin_s)
            time.sleep(2 * args.idle_timeout_s)
            return waited

        # One stream through once, left open to expire: loads ONNX Runtime's kernels, as any first request does.
        open_streams(server.grpc_url, 1, 1, steps, 0)
        wait_expired(server.metrics_url, 10 * args.idle_timeout_s + 30, decoder_margin_s)
        take("idle (warmed up)")
        opened, next_id = 0, 1000
        for count in counts:
            open_streams(server.grpc_url, next_id, count - opened, steps, next_id)
            next_id, opened = next_id + count - opened, count
            take(f"{count} live")
        take(f"expired ({expire():.0f} s)")
        for burst in range(args.bursts):
            open_streams(server.grpc_url, next_id, counts[-1], steps, next_id)
            next_id += counts[-1]
            take(f"{counts[-1]} live again" if burst == 0 else f"{counts[-1]} live, burst {burst + 2}")
            expire()
            take("expired again" if burst == 0 else f"expired, burst {burst + 2}")

    idle, peak = rows[0], rows[len(counts)]
    per_stream = (peak["pss_mib"] - idle["pss_mib"]) / counts[-1]
    results = {
        "meta": {
            **run_meta("memory" if args.decoder == "python-ort" else f"memory-{args.decoder}",
                       command_line()),
            "decoder": args.decoder,
            "state_mib_per_stream": state_mib, "steps": steps, "idle_timeout_s": args.idle_timeout_s,
            "decoder_parameters": parameters,
        },
        "rows": rows,
        "summary": {
            "streams": counts[-1],
            "per_stream_mib": per_stream,
            "per_stream_over_state": per_stream / state_mib,
            "after_expiry_over_idle": rows[len(counts) + 1]["pss_mib"] / idle["pss_mib"],
            "after_second_expiry_over_idle": rows[len(counts) + 3]["pss_mib"] / idle["pss_mib"],
        },
    }
    write_run(args.out_dir, "memory", results, "Server memory against live streams.\n\n" + memory_markdown(results))
    return 0

