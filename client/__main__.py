"""The code2wav client's command line: `decode` streams codes through a running server, prints stats, writes WAV."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from . import protocol
from .credentials import add_credentials_arguments, credentials_from_args
from .report import RunReport
from .sync import Code2WavClient, StreamsFailed, run_streams
from .wav import SAMPLE_FORMATS, write_wav

PROGRESS_MIN_FRAMES = 250  # the default progress bar: on a terminal, for streams of 20 s or more


def progress_bar(width: int = 30, stream=sys.stderr):
    """progress(done, total): one line on stderr, redrawn at most every 0.1 s, `[####....]  52%  130/250 frames`."""
    last_drawn_s = 0.0

    def progress(done: int, total: int) -> None:
        nonlocal last_drawn_s
        if done < total and time.monotonic() - last_drawn_s < 0.1:
            return
        last_drawn_s, filled = time.monotonic(), int(width * done / total)
        stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {100 * done / total:4.0f}%  {done}/{total} frames"
                     + ("\n" if done >= total else ""))
        stream.flush()

    return progress


def summary_table(report: RunReport, url: str, servers: list[str] | None) -> str:
    """The run's statistics as an aligned two-column table (`servers`: those of a resumable run)."""
    stats, options = report.summary(), report.options
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
    if servers:
        rows.append(("resume", f"{stats['resumes']} resume(s); {options.resume_history_frames} frames of history, "
                               f"header {protocol.STREAM_KEY_HEADER}, servers {', '.join(servers)}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def output_paths(out: Path, streams: int) -> list[Path]:
    """out.wav, or out_0.wav, out_1.wav ... for several streams; checked writable before streaming, not after."""
    paths = [out] if streams == 1 else [out.with_name(f"{out.stem}_{i}{out.suffix or '.wav'}") for i in range(streams)]
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            existed = path.exists()
            open(path, "ab").close()
            if not existed:
                path.unlink()
        except OSError as exc:
            raise protocol.ClientError(f"cannot write {path}: {exc.strerror or exc}") from None
    return paths


def write_outputs(paths: list[Path], pcms: list[np.ndarray], wav_format: str, frames: int | None = None) -> None:
    """Each stream's WAV; `frames` (a failed run's length) also says where each stream stopped."""
    for index, (path, pcm) in enumerate(zip(paths, pcms)):
        write_wav(path, pcm, protocol.SAMPLE_RATE_HZ, wav_format)
        if frames is not None:
            stopped = pcm.size // protocol.SAMPLES_PER_FRAME
            print(f"stream {index} stopped at frame {stopped} of {frames}: wrote the "
                  f"{stopped * protocol.FRAME_DURATION_S:.2f} s received to {path}", file=sys.stderr)


def decode_command(args: argparse.Namespace) -> int:
    if args.codes is None:
        if args.frames is None:
            raise protocol.ClientError("--random needs --frames N (N >= 1)")
        codes = protocol.random_codes(args.frames, args.seed)
    else:
        try:
            codes = protocol.validate_codes(np.load(args.codes, allow_pickle=False))
        except ValueError:  # numpy says "pickled data" for any file that is not .npy / .npz
            raise protocol.ClientError(f"cannot read codes from {args.codes}: not a .npy file of integer codes "
                                       "[8, frames] (np.save writes one)") from None
        except OSError as exc:
            raise protocol.ClientError(f"cannot read codes from {args.codes}: {exc}") from None
    paths = None if args.out is None else output_paths(args.out, args.streams)
    resume_settings = {name: value for name, value in (("resume_history_frames", args.resume_history_frames),
                                                       ("resume_timeout_s", args.resume_timeout)) if value is not None}
    options = protocol.StreamOptions(
        chunk_frames=args.chunk_frames, mode=args.mode, send_frame_offset=not args.no_offsets,
        paced=args.paced or args.catch_up, catch_up=args.catch_up, model_name=args.model,
        response_timeout_s=args.timeout, **resume_settings,  # any resume option turns resuming on
        resume=bool(args.resume or resume_settings or args.stream_key is not None or args.failover_url))
    show_progress = args.progress if args.progress is not None else (sys.stderr.isatty() and codes.shape[1] >= PROGRESS_MIN_FRAMES)
    servers = [args.url, *args.failover_url]
    keys = None if args.stream_key is None else (
        [args.stream_key] if args.streams == 1 else [f"{args.stream_key}-{index}" for index in range(args.streams)])
    credentials = credentials_from_args(args)
    Code2WavClient(args.url, options, credentials=credentials).check_ready()  # failover servers may be down now
    try:
        report = run_streams(servers, [codes] * args.streams, options, stream_keys=keys,
                             progress=progress_bar() if show_progress else None, credentials=credentials)
    except StreamsFailed as failure:
        if paths is not None:
            write_outputs(paths, failure.received, args.wav_format, codes.shape[1])
        raise
    for index, result in enumerate(report.results):
        for resumed in result.resumes:
            print(f"stream {index} (key {result.stream_key}): {resumed.describe()}", file=sys.stderr)
    print(summary_table(report, args.url, servers if options.resume else None))
    if paths is not None:
        write_outputs(paths, [result.pcm for result in report.results], args.wav_format)
        where = paths[0] if len(paths) == 1 else f"{paths[0]} ... {paths[-1]}"
        print(f"wrote {where} ({protocol.SAMPLE_RATE_HZ} Hz mono {args.wav_format})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="code2wav-client", description=__doc__.splitlines()[0])
    decode = parser.add_subparsers(dest="command", required=True).add_parser(
        "decode", help="stream codes through code2wav and write a WAV file", description="Stream codes [8, F] "
        "through code2wav, one Triton sequence per stream, print latency and real-time-factor statistics, and "
        "write 24 kHz mono WAV.")
    add = decode.add_argument
    add("--url", default=protocol.DEFAULT_URL, help="Triton gRPC address host:port (default %(default)s)")
    add("--model", default=protocol.MODEL_NAME, help="model name (default %(default)s)")
    source = decode.add_mutually_exclusive_group(required=True)
    source.add_argument("--codes", type=Path, help=".npy file of integer codes [8, frames] in [0, 2048)")
    source.add_argument("--random", action="store_true", help="seeded random codes (the audio is noise)")
    add("--frames", type=int, help="frames of random codes (80 ms each)")
    add("--seed", type=int, default=0, help="seed of the random codes (default %(default)s)")
    add("--out", type=Path, help="WAV file to write (--streams N > 1: OUT_0.wav ... OUT_{N-1}.wav)")
    add("--chunk-frames", type=int, default=protocol.DEFAULT_CHUNK_FRAMES,
        help="frames per request after the first, which holds 1 (default %(default)s)")
    add("--mode", choices=protocol.MODES, default="delta",
        help="delta: each request holds its new frames; cumulative: the whole stream so far")
    add("--no-offsets", action="store_true", help="omit frame_offset (the server's dedupe_mode reads each request)")
    add("--streams", type=int, default=1, help="concurrent streams, each its own sequence, all decoding the same codes")
    add("--paced", action="store_true", help="send each chunk once its frames would exist (a frame per 80 ms) and "
        "the previous answer came back (default: once the previous answer came back)")
    add("--unpaced", dest="paced", action="store_false", help="the default: each request once the previous answer is back")
    add("--catch-up", action="store_true", help="paced, each request with every frame produced since the last")
    add("--wav-format", choices=SAMPLE_FORMATS, default="float32",
        help="float32: as decoded (default); int16: clipped to [-1, 1]")
    add("--timeout", type=float, default=60.0, help="seconds to wait for any one response (default %(default)s)")
    add("--progress", action=argparse.BooleanOptionalAction,
        help=f"draw a progress bar on stderr (default: on a terminal, for >= {PROGRESS_MIN_FRAMES} frames)")
    resume = decode.add_argument_group(
        "resume by replay", "A stream whose server is lost goes on in a new sequence (on the next --failover-url, or "
        "where a proxy routes its key) that re-sends its last frames as history; any of these options turns it on.")
    resume.add_argument("--resume", action="store_true", help="resume streams whose server is lost")
    resume.add_argument("--resume-history-frames", type=int, metavar="R",
                        help=f"frames replayed (default {protocol.DEFAULT_RESUME_HISTORY_FRAMES})")
    resume.add_argument("--resume-timeout", type=float, metavar="S",
                        help=f"seconds to keep trying (default {protocol.DEFAULT_RESUME_TIMEOUT_S:g})")
    resume.add_argument("--stream-key", metavar="KEY", help=f"the {protocol.STREAM_KEY_HEADER} header's value "
                        "(default: the sequence id; --streams N: KEY-0 ... KEY-{N-1})")
    resume.add_argument("--failover-url", action="append", default=[], metavar="HOST:PORT",
                        help="another server to resume on (repeatable)")
    add_credentials_arguments(decode)
    decode.set_defaults(handler=decode_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, least in (("streams", 1), ("chunk_frames", 1), ("frames", 1), ("resume_history_frames", 0)):
        value = getattr(args, name)  # usage errors: exit 2, like argparse's own
        if value is not None and value < least:
            parser.error(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    if args.resume_timeout is not None and not args.resume_timeout > 0:
        parser.error(f"--resume-timeout must be > 0 s, got {args.resume_timeout:g}")
    try:
        return args.handler(args)
    except protocol.ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
