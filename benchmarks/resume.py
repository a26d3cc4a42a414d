"""Resume by replay, measured (`resume_snr.measure_resume`): its command line, JSON, table and plot.

  python -m benchmarks resume [--weights SRC | --seed N] [--streams 4] [--resume-frame 600]
      [--history-frames 0 12 25 62 125 250 500] [--codes codes.npy] [--threads N]
      [--out bench_results/resume_snr.json] [--svg bench_results/resume_snr.svg]

For every history length R it reports the SNR of the first 1 s (13 frames) and the first 10 s
(125 frames) after the resume point, resumed vs uninterrupted, per stream, and the same for a
replay of the whole history (which must be exact: the check that the measurement itself is sound),
for both ways of starting the resumed state (`restart`, `continue`; see `resume_snr`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from .provenance import command_line, record_json, run_meta, stamp
from .resume_snr import (
    DEFAULT_HISTORY_FRAMES,
    DEFAULT_WINDOW_FRAMES,
    FULL_HISTORY_MIN_SNR_DB,
    POSITION_MODES,
    ResumeMeasurement,
    measure_resume,
)


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def _summary(per_stream: np.ndarray) -> dict:
    """min / median / per stream of one window's SNRs; null stands for +inf (identical audio)."""
    return {"min_db": _finite_or_none(np.min(per_stream)), "median_db": _finite_or_none(np.median(per_stream)),
            "per_stream_db": [_finite_or_none(v) for v in per_stream]}


def report_dict(result: ResumeMeasurement, frame_rate_hz: float) -> dict:
    """The measurement as JSON-ready data: per R and mode, per window `first_<w>_frames`, the SNRs."""
    windows = [f"first_{w}_frames" for w in result.window_frames]
    rows = []
    for index, history in enumerate(result.history_frames):
        row = {"history_frames": history, "history_s": history / frame_rate_hz}
        for mode, snr in result.snr_db.items():
            row[mode] = {name: _summary(snr[index, w]) for w, name in enumerate(windows)}
        rows.append(row)
    full = {name: _summary(result.full_history_snr_db[w]) for w, name in enumerate(windows)}
    return {"resume_frame": result.resume_frame, "window_frames": list(result.window_frames),
            "window_s": [w / frame_rate_hz for w in result.window_frames], "rows": rows, "full_history": full}


def _fmt(value: float) -> str:
    return "inf" if np.isposinf(value) else f"{value:.1f}"


def _cell(summary: dict) -> str:
    """min / median of one window's SNRs (null: identical audio)."""
    return " / ".join("inf" if summary[key] is None else f"{summary[key]:.1f}" for key in ("min_db", "median_db"))


def report_table(report: dict) -> str:
    """Markdown table of a `report_dict`: R, seconds of history, then min / median SNR over streams
    per window and mode, and the whole history replayed."""
    modes = [key for key in report["rows"][0] if key not in ("history_frames", "history_s")]
    windows = [f"first_{w}_frames" for w in report["window_frames"]]
    header = ["R (frames)", "history (s)"]
    for mode in modes:
        header += [f"{mode}: first {seconds:g} s min / median (dB)" for seconds in report["window_s"]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for row in report["rows"]:
        cells = [str(row["history_frames"]), f"{row['history_s']:g}"]
        cells += [_cell(row[mode][window]) for mode in modes for window in windows]
        lines.append("| " + " | ".join(cells) + " |")
    full = [_cell(report["full_history"][window]) for window in windows]
    frame_rate_hz = report["window_frames"][0] / report["window_s"][0]
    lines.append(f"| {report['resume_frame']} (full) | {report['resume_frame'] / frame_rate_hz:g} | "
                 + " | ".join(full * len(modes)) + " |")
    return "\n".join(lines)


def table(result: ResumeMeasurement, frame_rate_hz: float) -> str:
    """Markdown table of a measurement: see `report_table`."""
    return report_table(report_dict(result, frame_rate_hz))


def resume_markdown(report: dict) -> str:
    """What a run measured and its table (the caller writes the stamp)."""
    return (f"Weights {report['weights']}; {report['streams']} streams of codes {report['codes']}, resumed at frame "
            f"{report['resume_frame']}; {report['frames_per_call']} frames per call; {report['runtime_s']:.0f} s.\n\n"
            + report_table(report))


def svg_plot(result: ResumeMeasurement, frame_rate_hz: float, mode: str = "restart", title: str = "") -> str:
    """A line plot of the median SNR over streams vs R, one line per window; R evenly spaced."""
    width, height, left, right, top, bottom = 640, 400, 60, 20, 40, 60
    plot_w, plot_h = width - left - right, height - top - bottom
    snr = result.snr_db[mode]
    medians = np.median(snr, axis=2)  # [R, windows]
    finite = medians[np.isfinite(medians)]
    ceiling = max(FULL_HISTORY_MIN_SNR_DB if np.isposinf(medians).any() else 0.0, float(finite.max(initial=0.0)))
    y_max = 10.0 * np.ceil(max(ceiling, 10.0) / 10.0)
    y_min = min(0.0, 10.0 * np.floor(float(finite.min(initial=0.0)) / 10.0))
    count = len(result.history_frames)

    def x(index):
        return left + plot_w * (index / max(count - 1, 1))

    def y(value):
        value = min(value, y_max)
        return top + plot_h * (1 - (value - y_min) / (y_max - y_min))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    step_db = 10 if y_max - y_min <= 60 else 20
    for tick in np.arange(y_min, y_max + 1e-9, step_db):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>')
    for index, history in enumerate(result.history_frames):
        parts.append(f'<text x="{x(index):.1f}" y="{top + plot_h + 18}" text-anchor="middle">{history}</text>')
        parts.append(f'<text x="{x(index):.1f}" y="{top + plot_h + 32}" text-anchor="middle" fill="#666">'
                     f'{history / frame_rate_hz:g} s</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">'
                 'history replayed R (frames, seconds)</text>')
    parts.append(f'<text x="14" y="{top + plot_h / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {top + plot_h / 2})">SNR vs uninterrupted, median over streams (dB)</text>')
    parts.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>')
    full = float(np.median(result.full_history_snr_db[0]))
    if np.isfinite(full):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(full):.1f}" y2="{y(full):.1f}" stroke="#888" '
                     'stroke-dasharray="5,4"/>')
        parts.append(f'<text x="{width - right - 4}" y="{y(full) + 14:.1f}" text-anchor="end" fill="#666">'
                     f'whole history replayed: {full:.0f} dB</text>')
    colors = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
    for w, frames in enumerate(result.window_frames):
        color = colors[w % len(colors)]
        points = " ".join(f"{x(i):.1f},{y(medians[i, w]):.1f}" for i in range(count))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts += [f'<circle cx="{x(i):.1f}" cy="{y(medians[i, w]):.1f}" r="3" fill="{color}"/>' for i in range(count)]
        legend_y = top + 16 + 16 * w
        parts.append(f'<line x1="{left + 10}" x2="{left + 30}" y1="{legend_y - 4}" y2="{legend_y - 4}" '
                     f'stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{left + 36}" y="{legend_y}">first {frames / frame_rate_hz:g} s after resuming</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", help="Mimi weights (transformers folder, moshi .safetensors or hub id); "
                        "default: seeded random weights of the real architecture")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--codes", type=Path, help="codes .npy, int [streams, k, T] or [k, T] (default: random)")
    parser.add_argument("--codes-seed", type=int, default=5, help="seed of the random codes")
    parser.add_argument("--streams", type=int, default=4, help="random streams (ignored with --codes)")
    parser.add_argument("--num-codebooks", type=int, default=8)
    parser.add_argument("--resume-frame", type=int, default=600)
    parser.add_argument("--history-frames", type=int, nargs="+", default=list(DEFAULT_HISTORY_FRAMES))
    parser.add_argument("--window-frames", type=int, nargs="+", default=list(DEFAULT_WINDOW_FRAMES))
    parser.add_argument("--modes", nargs="+", choices=POSITION_MODES, default=list(POSITION_MODES))
    parser.add_argument("--frames-per-call", type=int, default=16)
    parser.add_argument("--max-batch-rows", type=int, default=8)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/resume_snr.json"))
    parser.add_argument("--svg", type=Path, default=Path("bench_results/resume_snr.svg"))


def run(args: argparse.Namespace) -> int:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from mimi_code2wav.export.step import MimiDecoderStep
    from mimi_code2wav.export.weights import load_weights

    if args.threads:
        torch.set_num_threads(args.threads)
    meta = run_meta("resume", command_line())
    started = time.perf_counter()
    loaded = load_weights(args.weights) if args.weights else load_weights(None, seed=args.seed)
    step = MimiDecoderStep(loaded.model, num_codebooks=args.num_codebooks,
                           max_frames_per_step=args.frames_per_call, window="moshi").eval()
    end_frame = args.resume_frame + max(args.window_frames)
    if args.codes:
        codes = np.load(args.codes)
        codes = codes[None] if codes.ndim == 2 else codes
        if codes.shape[1] < args.num_codebooks:
            raise SystemExit(f"{args.codes}: {codes.shape[1]} codebooks, --num-codebooks is {args.num_codebooks}")
        codes = codes[:, : args.num_codebooks, :end_frame]
    else:
        rng = np.random.default_rng(args.codes_seed)
        codes = rng.integers(0, step.codebook_size, (args.streams, args.num_codebooks, end_frame))
    result = measure_resume(step, codes, args.resume_frame, args.history_frames, args.window_frames, args.modes,
                            args.frames_per_call, args.max_batch_rows)
    runtime_s = time.perf_counter() - started

    frame_rate_hz = step.sample_rate_hz / step.samples_per_frame
    full_min = float(np.min(result.full_history_snr_db))
    report = {"meta": meta, "weights": loaded.source,
              "weights_sha256": loaded.sha256, "streams": int(codes.shape[0]),
              "codes": str(args.codes) if args.codes else f"random, seed {args.codes_seed}",
              "frames_per_call": args.frames_per_call, "frame_rate_hz": frame_rate_hz, "runtime_s": runtime_s,
              "snr_null_means": "+inf (identical audio)", **report_dict(result, frame_rate_hz)}
    print(f"{stamp(meta)}\n\n{resume_markdown(report)}")
    print(f"\nfull-history replay: min SNR {_fmt(full_min)} dB (must be >= {FULL_HISTORY_MIN_SNR_DB:g})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(record_json(report))
    if args.svg:
        args.svg.parent.mkdir(parents=True, exist_ok=True)
        title = f"Resume by replay ({loaded.source}, {codes.shape[0]} streams, position restarted)"
        args.svg.write_text(svg_plot(result, frame_rate_hz, "restart", title))
    print(f"wrote {args.out}" + (f" and {args.svg}" if args.svg else ""), file=sys.stderr)
    return 0 if full_min >= FULL_HISTORY_MIN_SNR_DB else 1

