"""Resume by replay: how well a stream's decoder state is rebuilt from the last R frames of codes.

A stream's decoder state lives on one replica. When that replica is lost, the client starts a new
sequence on another one, sends the last R frames it decoded as history (decoded to rebuild the
state, audio discarded), then goes on with new frames. Streaming decoding only forgets gradually
(a 250-step attention window per layer over 8 layers, plus conv contexts), so the resumed audio
differs from the uninterrupted decode; this module measures by how much.

  python -m mimi_code2wav.export.resume [--weights SRC | --seed N] [--streams 4] [--resume-frame 600]
      [--history-frames 0 12 25 62 125 250 500] [--codes codes.npy] [--threads N]
      [--out bench_results/resume_snr.json] [--svg bench_results/resume_snr.svg]

For every history length R it reports the SNR of the first 1 s (13 frames) and the first 10 s
(125 frames) after the resume point, resumed vs uninterrupted, per stream, and the same for a
replay of the whole history (which must be exact: the check that the measurement itself is sound).

Two ways of starting the resumed state are measured:
  restart   the new sequence's state starts at position 0 (a fresh stream): what the serving
            contract gives a new sequence. RoPE is relative, so the position offset does not matter.
  continue  position starts at 2 * (t - R), the stream's own position, with an all-zero KV cache.
            The step's mask counts KV slots as filled once slot + position >= 0, so the zero slots
            are attended as if they were real steps until the replay has pushed them out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .reference import snr_db

DEFAULT_HISTORY_FRAMES = (0, 12, 25, 62, 125, 250, 500)
# 1 s and 10 s of audio at 12.5 frames/s (the first second rounded up to whole frames).
DEFAULT_WINDOW_FRAMES = (13, 125)
POSITION_MODES = ("restart", "continue")
FULL_HISTORY_MIN_SNR_DB = 100.0


@dataclass
class ResumeMeasurement:
    """SNR (dB) of resumed vs uninterrupted audio; +inf where the two are identical.

    snr_db[mode] is [len(history_frames), len(window_frames), streams]: history R, window w, stream s
    = SNR over frames [t, t + window_frames[w]) of stream s resumed at frame t after replaying frames
    [t - R, t). full_history_snr_db is [len(window_frames), streams]: replay of frames [0, t).
    """

    resume_frame: int
    history_frames: tuple[int, ...]
    window_frames: tuple[int, ...]
    snr_db: dict[str, np.ndarray]
    full_history_snr_db: np.ndarray


@dataclass
class _Row:
    stream: int
    start_frame: int  # the row's fresh state decodes frames [start_frame, end) of its stream
    start_position: int


def _decode_rows(step, codes, rows: Sequence[_Row], keep_from: int, end_frame: int,
                 frames_per_call: int, max_batch_rows: int) -> np.ndarray:
    """Decode every row from its start frame to end_frame in one shared timeline; a row joins the
    batch at its start frame with a fresh state. Returns PCM [rows, (end_frame - keep_from) * spf]
    of frames [keep_from, end_frame); earlier audio is discarded."""
    import torch

    spf = step.samples_per_frame
    kv, conv, position = step.zero_state(len(rows))
    position[:, 0] = torch.tensor([row.start_position for row in rows], dtype=torch.int32)
    state = [kv, conv, position]
    starts = np.array([row.start_frame for row in rows])
    streams = torch.tensor([row.stream for row in rows])
    pcm_out = np.zeros((len(rows), (end_frame - keep_from) * spf), dtype=np.float32)
    # Calls never cross a row's start (it joins between calls) nor keep_from (a call's audio is
    # either all discarded or all kept).
    boundaries = sorted({*starts.tolist(), keep_from, end_frame})
    cursor = int(starts.min())
    with torch.no_grad():
        while cursor < end_frame:
            limit = next(b for b in boundaries if b > cursor)
            frames = min(frames_per_call, limit - cursor)
            active = np.flatnonzero(starts <= cursor)
            for first in range(0, len(active), max_batch_rows):
                chunk = torch.from_numpy(active[first : first + max_batch_rows])
                pcm, *new_state = step(codes[streams[chunk], :, cursor : cursor + frames],
                                       *[tensor[chunk] for tensor in state])
                for tensor, new in zip(state, new_state):
                    tensor[chunk] = new
                if cursor >= keep_from:
                    offset = (cursor - keep_from) * spf
                    pcm_out[chunk.numpy(), offset : offset + frames * spf] = pcm.numpy()
            cursor += frames
    return pcm_out


def measure_resume(step, codes: np.ndarray, resume_frame: int,
                   history_frames: Sequence[int] = DEFAULT_HISTORY_FRAMES,
                   window_frames: Sequence[int] = DEFAULT_WINDOW_FRAMES,
                   modes: Sequence[str] = ("restart",), frames_per_call: int | None = None,
                   max_batch_rows: int = 8) -> ResumeMeasurement:
    """SNR of resumed vs uninterrupted decoding for each history length and position mode.

    step: a `MimiDecoderStep`. codes: int [streams, k, T] with T >= resume_frame + max(window_frames).
    resume_frame t >= max(history_frames). frames_per_call defaults to the step's maximum. The
    uninterrupted decode runs each stream from frame 0; every resumed variant, the full-history
    replay included, runs in one batched timeline whose call boundaries differ from it, so the
    full-history figure also checks that call sizes and batch-mates do not change the audio.
    """
    import torch

    history_frames, window_frames = tuple(history_frames), tuple(window_frames)
    frames_per_call = frames_per_call or step.max_frames_per_step
    streams, _, total_frames = codes.shape
    end_frame = resume_frame + max(window_frames)
    if min(history_frames) < 0 or max(history_frames) > resume_frame:
        raise ValueError(f"history frames must be in [0, resume_frame={resume_frame}], got {history_frames}")
    if total_frames < end_frame:
        raise ValueError(f"codes hold {total_frames} frames; resuming at {resume_frame} with a "
                         f"{max(window_frames)}-frame window needs {end_frame}")
    unknown = set(modes) - set(POSITION_MODES)
    if unknown:
        raise ValueError(f"position modes must be among {POSITION_MODES}, got {sorted(unknown)}")
    tensor = torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int32))

    reference = _decode_rows(step, tensor, [_Row(s, 0, 0) for s in range(streams)], resume_frame, end_frame,
                             frames_per_call, max_batch_rows)
    # Variant order: (mode, R) for every mode and R, then the full-history replay; each for every stream.
    variants = [(mode, history) for mode in modes for history in history_frames] + [("restart", resume_frame)]
    rows = []
    for mode, history in variants:
        start = resume_frame - history
        position = step.steps_per_frame * start if mode == "continue" else 0
        rows += [_Row(s, start, position) for s in range(streams)]
    resumed = _decode_rows(step, tensor, rows, resume_frame, end_frame, frames_per_call, max_batch_rows)
    resumed = resumed.reshape(len(variants), streams, -1)

    spf = step.samples_per_frame
    snr = np.array([[[snr_db(resumed[v, s, : w * spf], reference[s, : w * spf]) for s in range(streams)]
                     for w in window_frames] for v in range(len(variants))])
    per_mode = {mode: snr[i * len(history_frames) : (i + 1) * len(history_frames)] for i, mode in enumerate(modes)}
    return ResumeMeasurement(resume_frame, history_frames, window_frames, per_mode, snr[-1])


# ---- report ---------------------------------------------------------------------------------------

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


def table(result: ResumeMeasurement, frame_rate_hz: float) -> str:
    """Markdown table: R, seconds of history, then min / median SNR over streams per window and mode."""
    header = ["R (frames)", "history (s)"]
    for mode in result.snr_db:
        header += [f"{mode}: first {w / frame_rate_hz:g} s min / median (dB)" for w in result.window_frames]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]

    def cells(snr):  # snr [windows, streams]
        return [f"{_fmt(np.min(s))} / {_fmt(np.median(s))}" for s in snr]

    for index, history in enumerate(result.history_frames):
        row = [str(history), f"{history / frame_rate_hz:g}"]
        for snr in result.snr_db.values():
            row += cells(snr[index])
        lines.append("| " + " | ".join(row) + " |")
    full = cells(result.full_history_snr_db)
    lines.append(f"| {result.resume_frame} (full) | {result.resume_frame / frame_rate_hz:g} | "
                 + " | ".join(full * len(result.snr_db)) + " |")
    return "\n".join(lines)


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


# ---- command line ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mimi_code2wav.export.resume", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    args = parser.parse_args(argv)

    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from .provenance import git_commit, machine_description
    from .step import MimiDecoderStep
    from .weights import load_weights

    if args.threads:
        torch.set_num_threads(args.threads)
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
    commit, machine = git_commit(), machine_description()
    command = "python -m mimi_code2wav.export.resume " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(result, frame_rate_hz)
    full_min = float(np.min(result.full_history_snr_db))
    print(f"Weights {loaded.source}; {codes.shape[0]} streams, resume at frame {args.resume_frame}; "
          f"machine {machine}; commit {commit}; {runtime_s:.0f} s.\n")
    print(text)
    print(f"\nfull-history replay: min SNR {_fmt(full_min)} dB (must be >= {FULL_HISTORY_MIN_SNR_DB:g})")

    report = {"command": command, "machine": machine, "commit": commit, "weights": loaded.source,
              "weights_sha256": loaded.sha256, "streams": int(codes.shape[0]),
              "codes": str(args.codes) if args.codes else f"random, seed {args.codes_seed}",
              "frames_per_call": args.frames_per_call, "frame_rate_hz": frame_rate_hz, "runtime_s": runtime_s,
              "snr_null_means": "+inf (identical audio)", **report_dict(result, frame_rate_hz)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.svg:
        args.svg.parent.mkdir(parents=True, exist_ok=True)
        title = f"Resume by replay ({loaded.source}, {codes.shape[0]} streams, position restarted)"
        args.svg.write_text(svg_plot(result, frame_rate_hz, "restart", title))
    print(f"wrote {args.out}" + (f" and {args.svg}" if args.svg else ""), file=sys.stderr)
    return 0 if full_min >= FULL_HISTORY_MIN_SNR_DB else 1


if __name__ == "__main__":
    sys.exit(main())
