"""Reporting the Triton sweep: its headline numbers, markdown tables and plot. Everything here reads
only the sweep's JSON (`bench.json`), so the record renders it the same way on any machine."""

from __future__ import annotations

from pathlib import Path

from mimi_code2wav.client.protocol import FRAME_DURATION_S, FRAMES_PER_SECOND

from .profile import SERVER_ROLES, PointProfile
from .provenance import stamp


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}"


def summarize(results: dict) -> dict:
    """The headline numbers: 16- vs 1-frame latency, frames/s of 8 streams, Triton's overhead."""
    summary = {}
    solo = {r["chunk_frames"]: r for r in results["client"] if r["streams"] == 1 and "error" not in r}
    if 1 in solo and 16 in solo:
        summary["p50_16_frames_over_1_frame"] = solo[16]["p50_ms"] / solo[1]["p50_ms"]
    for row in results["client"]:
        if row["streams"] == 8 and row["chunk_frames"] == 4 and "error" not in row:
            summary["frames_per_s_8_streams_4_frames"] = row["frames_per_s"]
    step_ms = results.get("decoder_step_ms", {})
    summary["triton_overhead_ms_p50"] = {
        chunk: solo[chunk]["p50_ms"] - step_ms[chunk] for chunk in solo if chunk in step_ms
    }
    return summary


def _summary_lines(results: dict) -> list[str]:
    meta, summary = results["meta"], results["summary"]
    lines = [
        f"- server: {meta['server']}",
        f"- streams of {meta['frames']} frames ({meta['frames'] * FRAME_DURATION_S:.2f} s), each sending its next "
        "request when the last returned: requests of 1 then F frames (the client sends frame_offset, perf_analyzer "
        "deltas); live pacing is the duplex benchmark's",
        f"- **the load generators (this client, perf_analyzer) share the machine's {meta['cpu_cores']} CPU cores with "
        "the server**: numbers are lower bounds for a dedicated server",
    ]
    if "server_exit" in meta:
        lines.append(f"- **the server exited during the run**; the points after it were not measured:\n\n"
                     f"```\n{meta['server_exit']}\n```")
    if "p50_16_frames_over_1_frame" in summary:
        lines.append(f"- one stream, request p50 of 16 frames / of 1 frame: **{summary['p50_16_frames_over_1_frame']:.2f}x**")
    if "frames_per_s_8_streams_4_frames" in summary:
        lines.append(f"- 8 streams, 4-frame requests: **{summary['frames_per_s_8_streams_4_frames']:.1f} frames/s**")
    # JSON keys are strings: the frame counts are read back as numbers to sort them.
    step_ms = {int(chunk): ms for chunk, ms in results.get("decoder_step_ms", {}).items()}
    overheads = {int(chunk): ms for chunk, ms in summary.get("triton_overhead_ms_p50", {}).items()}
    for chunk, overhead in sorted(overheads.items()):
        lines.append(f"- Triton overhead per {chunk}-frame request (1-stream p50 minus the ONNX step alone, "
                     f"{step_ms[chunk]:.1f} ms): {overhead:.1f} ms")
    return lines


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


def _table_start(table: str, heading: str) -> list[str]:
    title, note, header, align = TABLES[table]
    return [f"{heading} {title}", "", note, "", header, align]


def _client_table(rows: list[dict], heading: str) -> list[str]:
    lines = _table_start("client", heading)
    for row in rows:
        head = f"| {row['chunk_frames']} | {row['streams']}"
        if "error" in row:
            lines.append(f"{head} | {row['error']} | | | | |")
            continue
        lines.append(
            f"{head} | {_fmt(row['first_chunk_ms'])} / "
            f"{_fmt(row['first_chunk_ms_max'])} | {_fmt(row['p50_ms'])} / {_fmt(row['p90_ms'])} / {_fmt(row['p99_ms'])} | "
            f"{_fmt(row['real_time_factor'], 2)} | {_fmt(row['real_time_factor_per_stream_min'], 2)} | "
            f"{_fmt(row['frames_per_s'])} |"
        )
    return [*lines, ""]


def _perf_table(rows: list[dict], heading: str) -> list[str]:
    lines = _table_start("perf", heading)
    for row in rows:
        head = f"| {row['chunk_frames']} | {row['streams']}"
        needed = _fmt(row["streams"] * FRAMES_PER_SECOND)
        if "error" in row:
            lines.append(f"{head} | {row['error']} | | {needed} | | | | | |")
            continue
        lines.append(
            f"{head} | {_fmt(row['requests_per_s'], 2)} | {_fmt(row['frames_per_s'])} | {needed} | "
            f"{_fmt(row['p50_ms'])} / {_fmt(row['p90_ms'])} / {_fmt(row['p99_ms'])} | {_fmt(row['server_queue_ms'])} | "
            f"{_fmt(row['server_compute_ms'])} | {_fmt(row.get('decoder_mean_batch'), 2)} | "
            f"{_fmt(row.get('decoder_compute_infer_ms'))} |"
        )
    return [*lines, ""]


def _profile_table(profiled: list[tuple[str, dict]], heading: str) -> list[str]:
    lines = _table_start("profile", heading)
    for tool, row in profiled:
        profile = row["profile"]
        cpu = profile.get("server_cpu_ms_per_request", {})
        cpu_cell = (" / ".join(_fmt(cpu.get(role), 3) for role in SERVER_ROLES)
                    + f" = {_fmt(profile.get('server_cpu_ms_per_request_total'), 3)}") if cpu else "-"
        models = [profile.get(model, {}) for model in PointProfile.MODELS]
        model_cells = " | ".join(f"{_fmt(m.get('mean_batch'), 2)} / {_fmt(m.get('execute_ms'), 2)}" for m in models)
        lines.append(
            f"| {tool} | {row['chunk_frames']} | {row['streams']} "
            f"| {_fmt(row.get('requests_per_s'))} | {cpu_cell} | {_fmt(profile.get('load_cpu_ms_per_request'), 3)} "
            f"| {_fmt(profile.get('server_cpu_cores_busy'), 2)} | {model_cells} |"
        )
    return [*lines, ""]


def sweep_markdown(results: dict, heading: str = "##") -> str:
    """The sweep's summary and tables, its tables under `heading` (the caller writes the stamp)."""
    lines = [*_summary_lines(results), ""]
    if results["client"]:
        lines += _client_table(results["client"], heading)
    if results["perf"]:
        lines += _perf_table(results["perf"], heading)
    profiled = [(tool, row) for tool, rows in (("client", results["client"]), ("perf_analyzer", results["perf"]))
                for row in rows if "profile" in row]
    if profiled:
        lines += _profile_table(profiled, heading)
    return "\n".join(lines).rstrip("\n")


def markdown_report(results: dict) -> str:
    """bench.md: a title, the run's stamp, the sweep's tables."""
    return f"# code2wav benchmark\n\n{stamp(results['meta'])}\n\n{sweep_markdown(results)}"


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
                groups.setdefault((source, row["chunk_frames"], marker), []).append(row)
    for index, ((source, chunk, marker), points) in enumerate(groups.items()):
        color, style = f"C{index % 10}", "-"
        streams = [r["streams"] for r in points]
        label = f"{source} {chunk} fr/req"
        latency_axes.plot(streams, [r["p50_ms"] for r in points], style, marker=marker, color=color, label=f"{label} p50")
        throughput_axes.plot(streams, [r["frames_per_s"] for r in points], style, marker=marker, color=color, label=label)
    all_streams = sorted({r["streams"] for r in results["client"] + results["perf"]})
    if all_streams:
        throughput_axes.plot(all_streams, [s * FRAMES_PER_SECOND for s in all_streams], ":", color="gray",
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

