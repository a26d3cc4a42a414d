"""Check a RUNNING code2wav server against a streaming reference decode of the same weights.

Seeded codes are streamed through the server concurrently and decoded by the reference one frame per call: moshi's
streaming decoder for a moshi .safetensors file, else this project's streaming step (held equal to moshi's by the
parity tests). Each stream passes with max abs error <= 1e-4 and SNR >= 100 dB: exit code 0 on PASS, 1 on FAIL or
error. Needs the export extra (PyTorch, transformers), and moshi for moshi checkpoints."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from mimi_code2wav.client.protocol import (
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_URL,
    NUM_CODEBOOKS,
    SAMPLES_PER_FRAME,
    ClientError,
    StreamOptions,
    random_codes,
)
from mimi_code2wav.client.sync import Code2WavClient, run_streams

from .processes import report

MAX_ABS_ERROR = 1e-4
MIN_SNR_DB = 100.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help="Triton gRPC address of the running server (default %(default)s)")
    parser.add_argument("--weights", help="the weights the server serves: moshi .safetensors file, transformers folder "
                        "or hub id (default: as `make serve`: kyutai/mimi when available, else random seed 0)")
    parser.add_argument("--random-init", action="store_true", help="the server serves seeded random weights")
    parser.add_argument("--seed", type=int, default=None, help="seed of --random-init (default 0)")
    parser.add_argument("--streams", type=int, default=2, help="concurrent streams (default %(default)s)")
    parser.add_argument("--frames", type=int, default=150, help="frames per stream (default %(default)s: past "
                        "the decoder's 125-frame attention window)")
    parser.add_argument("--chunk-frames", type=int, default=DEFAULT_CHUNK_FRAMES, help="frames per request after the first")
    parser.add_argument("--codes-seed", type=int, default=0, help="seed of stream 0's codes; stream i uses seed + i")


def run(args: argparse.Namespace) -> int:
    if args.streams < 1 or args.frames < 1:
        print("error: --streams and --frames must be >= 1", file=sys.stderr)
        return 2
    codes = np.stack([random_codes(args.frames, args.codes_seed + i) for i in range(args.streams)])
    try:
        import torch  # noqa: F401
    except ImportError:
        return report("verify needs PyTorch and transformers for the reference: pip install -e '.[export]'")
    from mimi_code2wav.export.reference import reference_decode, snr_db
    from mimi_code2wav.export.weights import WeightsError

    try:
        # The reference first: weights that cannot be read fail before anything is streamed.
        reference, what = reference_decode(args.weights, args.random_init, args.seed, codes)
        options = StreamOptions(chunk_frames=args.chunk_frames, resume=False)
        Code2WavClient(args.url, options).check_ready()
        print(f"server {args.url}: streaming {args.streams} x {args.frames} frames of seeded codes "
              f"(chunks of 1 then {args.chunk_frames} frames, with frame_offset)", flush=True)
        streamed = run_streams(args.url, list(codes), options)
    except (ClientError, WeightsError) as exc:
        return report(exc)
    print(f"reference: {what}\nnote: the server must be serving these same weights; it does not say which it "
          "serves, so different weights show as FAIL")
    passed = True
    for index, (result, expected) in enumerate(zip(streamed.results, reference)):
        if result.pcm.shape != expected.shape:
            print(f"  stream {index}: FAIL: {result.pcm.size} samples, reference {expected.size}")
            passed = False
            continue
        error = float(np.max(np.abs(result.pcm.astype(np.float64) - expected)))
        snr = snr_db(result.pcm, expected)
        ok = error <= MAX_ABS_ERROR and snr >= MIN_SNR_DB
        passed &= ok
        print(f"  stream {index} (sequence {result.sequence_id}): max abs error {error:.3g}, SNR {snr:.1f} dB "
              f"over {result.frames} frames: {'ok' if ok else 'FAIL'}")
    print(f"{'PASS' if passed else 'FAIL'}: server vs reference, tolerances max abs <= {MAX_ABS_ERROR:g}, SNR >= "
          f"{MIN_SNR_DB:g} dB ({SAMPLES_PER_FRAME} samples x {args.frames} frames x {args.streams} streams, "
          f"{NUM_CODEBOOKS} codebooks)")
    return 0 if passed else 1
