"""`python -m benchmarks memory`: the server's memory against live streams, and after they expire.

A local server (stream idle timeout 4 s) takes streams that never END until N of `--streams` are live,
each through steps of 1, 4 and 4 frames together, then lets them expire, then takes `--bursts` more bursts
of the largest N: the RSS and PSS of its whole process group at each point say what a stream costs and
whether memory is given back or creeps. Writes OUT_DIR/memory.json and memory.md."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from mimi_code2wav.client.protocol import SAMPLES_PER_FRAME, contract_arrays, infer_inputs, random_codes
from mimi_code2wav.export.render import DECODER_IDLE_MARGIN_US, positive_int, set_idle_timeout
from mimi_code2wav.server.processes import group_pids
from mimi_code2wav.server.triton import fetch_metrics, metric_value

from .profile import add_server_arguments, local_server, prepare_server, process_role
from .provenance import add_options, log, md_row, parse_counts, run_meta, write_run

MIB = 2**20
STEPS, IDLE_TIMEOUT_S = [1, 4, 4], 4.0  # frames per request of every stream; the served idle timeout


def snapshot(pgid: int, label: str, live: dict[str, float | None]) -> dict:
    """RSS and PSS (MiB) of process group `pgid` (a server and its stubs), in total and per role."""
    found = []
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError, AttributeError):  # gone meanwhile
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
            rss, pss = (int(re.search(rf"^{key}:\s+(\d+) kB", rollup, re.M).group(1)) * 1024 for key in ("Rss", "Pss"))
            found.append((process_role(pid), pid, rss, pss))
    found.sort()
    return {"label": label, "live_streams": live,
            "rss_mib": sum(rss for _, _, rss, _ in found) / MIB, "pss_mib": sum(pss for *_, pss in found) / MIB,
            "processes": {role: {"pid": pid, "rss_mib": rss / MIB, "pss_mib": pss / MIB} for role, pid, rss, pss in found}}


def live_streams(metrics_url: str) -> dict[str, float | None]:
    samples = fetch_metrics(metrics_url)
    return {model: metric_value(samples, f"{model}_live_streams") for model in ("code2wav", "mimi_decoder")}


def open_streams(url: str, first_id: int, count: int, steps: list[int], seed: int, settle_s: float = 0.3) -> None:
    """START `count` streams (ids from first_id), each step of all sent at once (batched), left open; returns
    `settle_s` after the last answer, as a backend frees a run's gathered inputs only after answering."""
    import tritonclient.grpc as grpcclient

    codes = [random_codes(sum(steps), seed + i) for i in range(count)]
    with grpcclient.InferenceServerClient(url) as client:
        for index, (start, stop) in enumerate(itertools.pairwise(np.cumsum([0, *steps]))):
            pending = []
            for i in range(count):
                arrays = contract_arrays(codes[i][:, start:stop], int(start))
                pending.append(Future())
                client.async_infer("code2wav", infer_inputs(grpcclient, arrays),
                                   lambda result, error, done=pending[-1]: done.set_result((result, error)),
                                   sequence_id=first_id + i, sequence_start=index == 0, client_timeout=120)
            for done in pending:
                result, error = done.result(timeout=180)
                if error is not None:
                    raise RuntimeError(f"request failed: {error}")
                samples = result.as_numpy("model_outputs").size
                if samples != (stop - start) * SAMPLES_PER_FRAME:
                    raise RuntimeError(f"a step of {stop - start} frames returned {samples} samples")
    time.sleep(settle_s)


def wait_expired(metrics_url: str, timeout_s: float, decoder_margin_s: float = 0.0) -> float:
    """Seconds until the models report no live stream (raises after timeout_s). A native decoder
    reports none: its sequences idle out `decoder_margin_s` after code2wav's, so that much more is waited."""
    began = time.monotonic()
    while True:
        live = live_streams(metrics_url)
        if all(value == 0 for value in live.values() if value is not None):
            time.sleep(decoder_margin_s if live.get("mimi_decoder") is None else 0)
            return time.monotonic() - began
        if time.monotonic() - began > timeout_s:
            raise RuntimeError(f"streams still live after {timeout_s:.0f} s: {live}")
        time.sleep(0.25)


def memory_markdown(results: dict) -> str:
    """The memory table and its summary (the caller writes the stamp)."""
    meta, summary = results["meta"], results["summary"]
    roles = sorted({role for row in results["rows"] for role in row["processes"]})
    lines = [
        f"The {meta.get('decoder', 'python-ort')} decoder, state {meta['state_mib_per_stream']:.2f} MiB per stream; PSS "
        "counts shared memory once; live streams as the decoder counts them, else as code2wav does.",
        "",
        md_row("point", "live streams", "total PSS MiB", "total RSS MiB", *(f"{r} RSS" for r in roles),
               "PSS per stream over idle MiB"),
        "|---|---|---|---|" + "---|" * len(roles) + "---|",
    ]
    base = results["rows"][0]["pss_mib"]
    for row in results["rows"]:
        live = row["live_streams"].get("mimi_decoder")  # None: a native decoder, which reports none
        live = row["live_streams"].get("code2wav") if live is None else live
        per_stream = (row["pss_mib"] - base) / live if live else None
        lines.append(md_row(row["label"], "" if live is None else int(live), f"{row['pss_mib']:.0f}", f"{row['rss_mib']:.0f}",
                            *(f"{row['processes'][r]['rss_mib']:.0f}" if r in row["processes"] else "" for r in roles),
                            "" if per_stream is None else f"{per_stream:.1f}"))
    lines += [
        "",
        f"Per live stream at {summary['streams']} streams: {summary['per_stream_mib']:.1f} MiB "
        f"({summary['per_stream_over_state']:.2f}x the state). After expiry: "
        f"{summary['after_expiry_over_idle']:.3f}x the idle PSS (second burst: {summary['after_second_expiry_over_idle']:.3f}x).",
    ]
    count = summary["streams"]
    later = [row for row in results["rows"] if row["label"] == f"{count} live again" or row["label"].startswith(f"{count} live, burst")]
    if len(later) > 1:
        lines.append(f"Live PSS over {len(later)} more bursts of {count}: " + ", ".join(f"{row['pss_mib']:.0f}" for row in later) + " MiB.")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, url=False, build_dir="memory")
    add_options(parser, ("--streams", "16,32,64", "live-stream counts to measure at", parse_counts),
                ("--bursts", 1, "bursts of the largest count after the first expiry, each expired", positive_int))


def run(args: argparse.Namespace) -> int:
    from mimi_code2wav.export.onnx_export import read_manifest
    from mimi_code2wav.export.spec import DecoderSpec

    counts, rows, opened = sorted(set(args.streams)), [], 0
    repository = prepare_server(args)
    set_idle_timeout(repository, IDLE_TIMEOUT_S)
    manifest = read_manifest(next((args.build_dir / "export").iterdir()))
    state_mib = DecoderSpec.from_dict(manifest["spec"]).state_bytes_per_stream() / MIB
    with local_server(repository) as server:

        def take(label: str) -> None:
            rows.append(snapshot(server.pid, label, live_streams(server.metrics_url)))
            log(f"{label:28s} PSS {rows[-1]['pss_mib']:7.0f} MiB  RSS {rows[-1]['rss_mib']:7.0f} MiB  "
                f"live {rows[-1]['live_streams']}")

        def expire(settle: bool = True) -> float:
            """Seconds until every stream expired; with `settle`, then the batches' shared arrays go with their last stream."""
            waited = wait_expired(server.metrics_url, 10 * IDLE_TIMEOUT_S + 30, DECODER_IDLE_MARGIN_US / 1e6 + 0.5)
            time.sleep(2 * IDLE_TIMEOUT_S if settle else 0)
            return waited

        def burst(count: int, label: str) -> None:
            nonlocal opened
            open_streams(server.grpc_url, 1000 + opened, count, STEPS, 1000 + opened)
            opened += count
            take(label)

        # One stream through once, left open to expire: loads ONNX Runtime's kernels, as any first request does.
        open_streams(server.grpc_url, 1, 1, STEPS, 0)
        expire(settle=False)
        take("idle (warmed up)")
        for count in counts:
            burst(count - opened, f"{count} live")
        take(f"expired ({expire():.0f} s)")
        for burst_index in range(args.bursts):
            burst(counts[-1], f"{counts[-1]} live again" if burst_index == 0 else f"{counts[-1]} live, burst {burst_index + 2}")
            expire()
            take("expired again" if burst_index == 0 else f"expired, burst {burst_index + 2}")

    idle, peak = rows[0], rows[len(counts)]
    per_stream = (peak["pss_mib"] - idle["pss_mib"]) / counts[-1]
    meta = run_meta("memory" if args.decoder == "python-ort" else f"memory-{args.decoder}", decoder=args.decoder,
                    state_mib_per_stream=state_mib, steps=STEPS, idle_timeout_s=IDLE_TIMEOUT_S)
    results = {"meta": meta, "rows": rows, "summary": {
        "streams": counts[-1], "per_stream_mib": per_stream, "per_stream_over_state": per_stream / state_mib,
        "after_expiry_over_idle": rows[len(counts) + 1]["pss_mib"] / idle["pss_mib"],
        "after_second_expiry_over_idle": rows[len(counts) + 3]["pss_mib"] / idle["pss_mib"]}}
    write_run(args.out_dir, "memory", results, "Server memory against live streams.\n\n" + memory_markdown(results))
    return 0
