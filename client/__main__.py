"""Command line of the code2wav client (`code2wav-client`, or `python -m mimi_code2wav.client`).

    code2wav-client decode --url 127.0.0.1:8001 (--codes codes.npy | --random --frames N --seed S)
                           [--out out.wav] [--chunk-frames 4] [--mode delta|cumulative] [--no-offsets]
                           [--streams N] [--paced|--unpaced] [--wav-format float32|int16]

decode streams the codes through a running server, prints a summary table and writes WAV. Argument
parsing and output only: streaming is `client.stream`. Needs numpy and tritonclient, never PyTorch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from .stream import (
    CODEBOOK_SIZE,
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_URL,
    FIRST_CHUNK_FRAMES,
    MODEL_NAME,
    MODES,
    NUM_CODEBOOKS,
    SAMPLE_RATE_HZ,
    ClientError,
    Code2WavStreamer,
    RunReport,
    StreamOptions,
    random_codes,
    validate_codes,
)
from .wav import SAMPLE_FORMATS, write_wav

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
    rows = [
        ("server", f"{url} model '{options.model_name}'"),
        ("streams", f"{stats['streams']} x {stats['frames_per_stream']} frames ({stats['audio_s'] / stats['streams']:.2f} s audio each)"),
        ("requests", f"{stats['requests']}: {options.mode} {offsets}, chunks of {options.first_chunk_frames} then {options.chunk_frames} frames"),
        ("pacing", pacing),
        ("first-chunk latency", f"{stats['first_chunk_latency_ms_mean']:.1f} ms (max over streams {stats['first_chunk_latency_ms_max']:.1f} ms)"),
        ("chunk latency p50", f"{stats['chunk_latency_ms_p50']:.1f} ms"),
        ("chunk latency p90", f"{stats['chunk_latency_ms_p90']:.1f} ms"),
        ("chunk latency p99", f"{stats['chunk_latency_ms_p99']:.1f} ms"),
        ("wall time", f"{stats['wall_s']:.2f} s"),
        ("real-time factor", f"{stats['real_time_factor']:.2f} (audio s / wall s, all streams; slowest stream {stats['real_time_factor_per_stream_min']:.2f})"),
        ("throughput", f"{stats['frames_per_s']:.1f} frames/s"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def output_paths(out: Path, streams: int) -> list[Path]:
    """out.wav for one stream; out_0.wav, out_1.wav, ... for several."""
    if streams == 1:
        return [out]
    return [out.with_name(f"{out.stem}_{i}{out.suffix or '.wav'}") for i in range(streams)]


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


def decode_command(args: argparse.Namespace) -> int:
    codes = load_codes(args)
    if args.out is not None:
        check_writable(output_paths(args.out, args.streams))
    options = StreamOptions(
        chunk_frames=args.chunk_frames,
        mode=args.mode,
        send_frame_offset=not args.no_offsets,
        paced=args.paced,
        model_name=args.model,
        response_timeout_s=args.timeout,
    )
    show_progress = args.progress if args.progress is not None else (sys.stderr.isatty() and codes.shape[1] >= PROGRESS_MIN_FRAMES)
    with Code2WavStreamer(args.url, args.model) as streamer:
        streamer.check_ready()
        report = streamer.run([codes] * args.streams, options, progress=ProgressBar() if show_progress else None)
    print(summary_table(report, args.url))
    if args.out is not None:
        paths = output_paths(args.out, args.streams)
        for path, result in zip(paths, report.results):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_wav(path, result.pcm, SAMPLE_RATE_HZ, args.wav_format)
        where = paths[0] if len(paths) == 1 else f"{paths[0]} ... {paths[-1]}"
        print(f"wrote {where} ({SAMPLE_RATE_HZ} Hz mono {args.wav_format})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="code2wav-client", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    decode = commands.add_parser(
        "decode",
        help="stream codes through code2wav and write a WAV file",
        description="Stream codes [8, F] through a running code2wav server as one Triton sequence per "
        "stream, print latency and real-time-factor statistics, and write 24 kHz mono WAV.",
    )
    decode.add_argument("--url", default=DEFAULT_URL, help="Triton gRPC address host:port (default %(default)s)")
    decode.add_argument("--model", default=MODEL_NAME, help="model name (default %(default)s)")
    source = decode.add_mutually_exclusive_group(required=True)
    source.add_argument("--codes", type=Path, help=f".npy file of integer codes [{NUM_CODEBOOKS}, frames] in [0, {CODEBOOK_SIZE})")
    source.add_argument("--random", action="store_true", help="seeded random codes (the audio is noise)")
    decode.add_argument("--frames", type=int, help="frames of random codes (80 ms each)")
    decode.add_argument("--seed", type=int, default=0, help="seed of the random codes (default %(default)s)")
    decode.add_argument(
        "--out", type=Path,
        help="WAV file to write; with --streams N > 1, OUT_0.wav ... OUT_{N-1}.wav; omit it to only report statistics",
    )
    decode.add_argument(
        "--chunk-frames", type=int, default=DEFAULT_CHUNK_FRAMES,
        help=f"frames per request after the first, which holds {FIRST_CHUNK_FRAMES} (default %(default)s)",
    )
    decode.add_argument(
        "--mode", choices=MODES, default="delta",
        help="delta: each request holds only its new frames; cumulative: the whole stream so far (O(n^2) bytes)",
    )
    decode.add_argument("--no-offsets", action="store_true", help="omit frame_offset (the server then infers resends)")
    decode.add_argument("--streams", type=int, default=1, help="concurrent streams, each its own sequence, all decoding the same codes")
    pacing = decode.add_mutually_exclusive_group()
    pacing.add_argument("--paced", dest="paced", action="store_true", default=False,
                        help="send each chunk when its frames would exist (one frame per 80 ms), as a live "
                        "pipeline does; concurrent streams start spread over one chunk period")
    pacing.add_argument("--unpaced", dest="paced", action="store_false",
                        help="send each stream's next chunk as soon as its previous response arrives (default)")
    decode.add_argument(
        "--wav-format", choices=SAMPLE_FORMATS, default="float32",
        help="float32: IEEE float WAV, samples exactly as decoded (default); int16: 16-bit PCM, samples "
        "clipped to [-1, 1] then scaled by 32767",
    )
    decode.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any one response (default %(default)s)")
    progress = decode.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help=f"always draw a progress bar on stderr (default: on a terminal, for streams of >= {PROGRESS_MIN_FRAMES} frames)")
    progress.add_argument("--no-progress", dest="progress", action="store_false", help="never draw one")
    decode.set_defaults(handler=decode_command)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("streams", "chunk_frames", "frames"):  # usage errors: exit 2, like argparse's own
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    try:
        return args.handler(args)
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
