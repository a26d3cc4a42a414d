"""`code2wav-client decode`: stream codes through a running server (`sync.run_streams`), print a
summary, write WAV.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from .credentials import credentials_from_args
from .protocol import (
    DEFAULT_RESUME_HISTORY_FRAMES,
    DEFAULT_RESUME_TIMEOUT_S,
    FRAME_DURATION_S,
    NUM_CODEBOOKS,
    SAMPLE_RATE_HZ,
    SAMPLES_PER_FRAME,
    STREAM_KEY_HEADER,
    ClientError,
    StreamOptions,
    random_codes,
    validate_codes,
)
from .report import RunReport
from .sync import Code2WavClient, StreamsFailed, run_streams
from .wav import write_wav

# A progress bar is drawn only on a terminal and only for streams longer than this (20 s of audio).
PROGRESS_MIN_FRAMES = 250


class ProgressBar:
    """One line on stderr, redrawn in place: `[#####.....]  52%  130/250 frames`."""

    def __init__(self, width: int = 30, stream=sys.stderr):
        self.width = width
        self.stream = stream
        self.last_drawn_s = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last_drawn_s < 0.1:
            return
        self.last_drawn_s = now
        filled = int(self.width * done / total)
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {100 * done / total:4.0f}%  {done}/{total} frames")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def summary_table(report: RunReport, url: str) -> str:
    """The run's statistics as an aligned two-column table."""
    stats = report.summary()
    options = report.options
    offsets = "with frame_offset" if options.send_frame_offset else "without frame_offset"
    pacing = "paced at 80 ms/frame" if options.paced else "unpaced (one request in flight per stream)"
    if options.catch_up:
        pacing += ", catching up (one request in flight, every frame produced since the last)"
    rows = [
        ("server", f"{url} model '{options.model_name}'"),
        ("streams", f"{stats['streams']} x {stats['frames_per_stream']} frames ({stats['audio_s'] / stats['streams']:.2f} s audio each)"),
        ("requests", f"{stats['requests']}: {options.mode} {offsets}, chunks of {options.first_chunk_frames} then {options.chunk_frames} frames"),
        ("pacing", pacing),
        ("first-chunk latency", f"{stats['first_chunk_latency_ms_mean']:.1f} ms (max over streams {stats['first_chunk_latency_ms_max']:.1f} ms)"),
        *((f"chunk latency p{point}", f"{stats[f'chunk_latency_ms_p{point}']:.1f} ms") for point in (50, 90, 99)),
        ("wall time", f"{stats['wall_s']:.2f} s"),
        ("real-time factor", f"{stats['real_time_factor']:.2f} (audio s / wall s, all streams; slowest stream {stats['real_time_factor_per_stream_min']:.2f})"),
        ("throughput", f"{stats['frames_per_s']:.1f} frames/s"),
    ]
    if "servers" in report.extra:
        rows.append(("resume", f"{stats['resumes']} resume(s); {options.resume_history_frames} frames of history, "
                               f"header {STREAM_KEY_HEADER}, servers {', '.join(report.extra['servers'])}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def output_paths(out: Path, streams: int) -> list[Path]:
    """out.wav for one stream; out_0.wav, out_1.wav, ... for several."""
    return [out] if streams == 1 else [out.with_name(f"{out.stem}_{i}{out.suffix or '.wav'}") for i in range(streams)]


def load_codes(args: argparse.Namespace) -> np.ndarray:
    if args.codes is not None:
        try:
            codes = np.load(args.codes, allow_pickle=False)
        except ValueError:
            # numpy says "pickled data" for any file that is not .npy / .npz
            raise ClientError(f"cannot read codes from {args.codes}: not a .npy file of integer codes "
                              f"[{NUM_CODEBOOKS}, frames] (np.save writes one)") from None
        except OSError as exc:
            raise ClientError(f"cannot read codes from {args.codes}: {exc}") from None
        return validate_codes(codes)
    if args.frames is None or args.frames < 1:
        raise ClientError("--random needs --frames N (N >= 1)")
    return random_codes(args.frames, args.seed)


def stream_keys(stream_key: str | None, streams: int) -> list[str] | None:
    """KEY for one stream, KEY-0 ... KEY-{N-1} for several; None (the sequence ids) without a KEY."""
    if stream_key is None:
        return None
    return [stream_key] if streams == 1 else [f"{stream_key}-{index}" for index in range(streams)]


def resume_lines(report: RunReport) -> list[str]:
    """One line per resume of any stream, for stderr."""
    return [f"stream {index} (key {result.stream_key}): {resume.describe()}"
            for index, result in enumerate(report.results) for resume in result.resumes]


def wants_resume(args: argparse.Namespace) -> bool:
    """--resume, or any option that only a resumable run has."""
    return bool(args.resume or args.resume_history_frames is not None or args.resume_timeout is not None
                or args.stream_key is not None or args.failover_url)


def check_writable(paths: list[Path]) -> None:
    """Fail before streaming (not after, losing the audio) when an output file cannot be written."""
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            existed = path.exists()
            with open(path, "ab"):
                pass
            if not existed:
                path.unlink()
        except OSError as exc:
            raise ClientError(f"cannot write {path}: {exc.strerror or exc}") from None


def write_received(args: argparse.Namespace, received: list[np.ndarray], frames: int) -> None:
    """After a failed run: each stream's WAV with the audio it received, and where it stopped."""
    for index, (path, pcm) in enumerate(zip(output_paths(args.out, len(received)), received)):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_wav(path, pcm, SAMPLE_RATE_HZ, args.wav_format)
        stopped = pcm.size // SAMPLES_PER_FRAME
        print(f"stream {index} stopped at frame {stopped} of {frames}: wrote the {stopped * FRAME_DURATION_S:.2f} s "
              f"received to {path}", file=sys.stderr)


def decode_command(args: argparse.Namespace) -> int:
    codes = load_codes(args)
    if args.out is not None:
        check_writable(output_paths(args.out, args.streams))
    options = StreamOptions(
        chunk_frames=args.chunk_frames,
        mode=args.mode,
        send_frame_offset=not args.no_offsets,
        paced=args.paced or args.catch_up,
        catch_up=args.catch_up,
        model_name=args.model,
        response_timeout_s=args.timeout,
        resume_history_frames=(DEFAULT_RESUME_HISTORY_FRAMES if args.resume_history_frames is None
                               else args.resume_history_frames),
        resume=wants_resume(args),
        resume_timeout_s=DEFAULT_RESUME_TIMEOUT_S if args.resume_timeout is None else args.resume_timeout,
    )
    show_progress = args.progress if args.progress is not None else (sys.stderr.isatty() and codes.shape[1] >= PROGRESS_MIN_FRAMES)
    progress = ProgressBar() if show_progress else None
    servers = [args.url, *args.failover_url]
    # Failover servers are not checked first: they may be down now and up when needed.
    credentials = credentials_from_args(args)
    Code2WavClient(args.url, options, credentials=credentials).check_ready()
    try:
        report = run_streams(servers, [codes] * args.streams, options, stream_keys=stream_keys(args.stream_key, args.streams),
                             progress=progress, credentials=credentials)
    except StreamsFailed as failure:
        if args.out is not None:
            write_received(args, failure.received, codes.shape[1])
        raise
    if options.resume:
        report.extra["servers"] = servers
        for line in resume_lines(report):
            print(line, file=sys.stderr)
    print(summary_table(report, args.url))
    if args.out is not None:
        paths = output_paths(args.out, args.streams)
        for path, result in zip(paths, report.results):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_wav(path, result.pcm, SAMPLE_RATE_HZ, args.wav_format)
        where = paths[0] if len(paths) == 1 else f"{paths[0]} ... {paths[-1]}"
        print(f"wrote {where} ({SAMPLE_RATE_HZ} Hz mono {args.wav_format})")
    return 0
