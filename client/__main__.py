"""Command line of the code2wav client (`code2wav-client`, or `python -m mimi_code2wav.client`).

Argument parsing only (`code2wav-client decode --help`); the command is `client.decode`. Never PyTorch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .credentials import add_credentials_arguments
from .decode import PROGRESS_MIN_FRAMES, decode_command
from .protocol import (
    CODEBOOK_SIZE,
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_RESUME_HISTORY_FRAMES,
    DEFAULT_RESUME_TIMEOUT_S,
    DEFAULT_URL,
    FIRST_CHUNK_FRAMES,
    MODEL_NAME,
    MODES,
    NUM_CODEBOOKS,
    STREAM_KEY_HEADER,
    ClientError,
)
from .wav import SAMPLE_FORMATS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="code2wav-client", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    decode = commands.add_parser(
        "decode", help="stream codes through code2wav and write a WAV file",
        description="Stream codes [8, F] through a running code2wav server as one Triton sequence per "
        "stream, print latency and real-time-factor statistics, and write 24 kHz mono WAV.")
    decode.add_argument("--url", default=DEFAULT_URL, help="Triton gRPC address host:port (default %(default)s)")
    decode.add_argument("--model", default=MODEL_NAME, help="model name (default %(default)s)")
    source = decode.add_mutually_exclusive_group(required=True)
    source.add_argument("--codes", type=Path, help=f".npy file of integer codes [{NUM_CODEBOOKS}, frames] in [0, {CODEBOOK_SIZE})")
    source.add_argument("--random", action="store_true", help="seeded random codes (the audio is noise)")
    decode.add_argument("--frames", type=int, help="frames of random codes (80 ms each)")
    decode.add_argument("--seed", type=int, default=0, help="seed of the random codes (default %(default)s)")
    decode.add_argument("--out", type=Path, help="WAV file to write; with --streams N > 1, OUT_0.wav ... "
                        "OUT_{N-1}.wav; omit it to only report statistics")
    decode.add_argument("--chunk-frames", type=int, default=DEFAULT_CHUNK_FRAMES,
                        help=f"frames per request after the first, which holds {FIRST_CHUNK_FRAMES} "
                        "(default %(default)s)")
    decode.add_argument("--mode", choices=MODES, default="delta", help="delta: each request holds only its new "
                        "frames; cumulative: the whole stream so far (O(n^2) bytes)")
    decode.add_argument("--no-offsets", action="store_true", help="omit frame_offset: the server reads each request by its dedupe_mode (delta by default; "
                        "--mode cumulative then needs dedupe_mode=cumulative)")
    decode.add_argument("--streams", type=int, default=1, help="concurrent streams, each its own sequence, all decoding the same codes")
    pacing = decode.add_mutually_exclusive_group()
    pacing.add_argument("--paced", dest="paced", action="store_true", default=False,
                        help="send each chunk when its frames would exist (one frame per 80 ms), as a live "
                        "pipeline does, or when the previous response arrives if that is later (one request in "
                        "flight per stream); concurrent streams start spread over one chunk period")
    pacing.add_argument("--unpaced", dest="paced", action="store_false",
                        help="send each stream's next chunk as soon as its previous response arrives (default)")
    decode.add_argument("--catch-up", action="store_true",
                        help="with --paced: each request carries every frame produced since the last, so a stream "
                        "the server runs behind catches up in bigger requests")
    decode.add_argument("--wav-format", choices=SAMPLE_FORMATS, default="float32",
                        help="float32: IEEE float WAV, samples exactly as decoded (default); int16: 16-bit PCM, "
                        "samples clipped to [-1, 1] then scaled by 32767")
    decode.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any one response (default %(default)s)")
    progress = decode.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help=f"always draw a progress bar on stderr (default: on a terminal, for streams of >= {PROGRESS_MIN_FRAMES} frames)")
    progress.add_argument("--no-progress", dest="progress", action="store_false", help="never draw one")
    resume = decode.add_argument_group(
        "resume by replay", f"Every request carries the gRPC header {STREAM_KEY_HEADER}: KEY (for a proxy that routes "
        "a stream to one replica). When the server holding a stream is lost, the stream goes on in a new sequence (on "
        "the next --failover-url, or where the proxy now routes the key) that re-sends its last frames as history; "
        "each resume is reported on stderr. Any of these options turns it on.")
    resume.add_argument("--resume", action="store_true", help="resume streams whose server is lost")
    resume.add_argument("--resume-history-frames", type=int, metavar="R",
                        help=f"frames replayed to rebuild the decoder state (default {DEFAULT_RESUME_HISTORY_FRAMES}: "
                        "20 s, >= 86 dB SNR after the resume)")
    resume.add_argument("--resume-timeout", type=float, metavar="S",
                        help=f"seconds to keep trying to resume before giving up (default {DEFAULT_RESUME_TIMEOUT_S:g})")
    resume.add_argument("--stream-key", metavar="KEY",
                        help="the stream key header's value (default: the sequence id; with --streams N: KEY-0 ... KEY-{N-1})")
    resume.add_argument("--failover-url", action="append", default=[], metavar="HOST:PORT",
                        help="another server to resume on (repeatable; tried in turn after --url)")
    add_credentials_arguments(decode)
    decode.set_defaults(handler=decode_command)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, least in (("streams", 1), ("chunk_frames", 1), ("frames", 1), ("resume_history_frames", 0)):
        value = getattr(args, name, None)  # usage errors: exit 2, like argparse's own
        if value is not None and value < least:
            parser.error(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    if getattr(args, "resume_timeout", None) is not None and not args.resume_timeout > 0:
        parser.error(f"--resume-timeout must be > 0 s, got {args.resume_timeout:g}")
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
