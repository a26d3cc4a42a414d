"""Check a RUNNING code2wav server against a streaming reference decode of the same weights.

    python -m client.verify [--url 127.0.0.1:8001] [--weights PATH | --random-init [--seed N]]
                            [--streams 2] [--frames 150] [--chunk-frames 4] [--codes-seed 0]

Seeded codes are streamed through the server (one sequence per stream, concurrently) and decoded by
the reference in PyTorch, one frame per call:
- a moshi-format .safetensors file: moshi's own streaming decoder (`moshi.models.loaders.get_mimi`,
  inside `mimi.streaming(B)`), the reference Moshi-family systems run;
- a transformers folder, a hub id or random weights: no moshi loader reads those, so the reference is
  this project's PyTorch streaming step (`export.step.MimiDecoderStep`, moshi window), which the
  parity tests hold equal to moshi's streaming decode.
Each stream passes with max abs error <= 1e-4 and SNR >= 100 dB (the README's tolerances). Exit code 0 on PASS,
1 on FAIL or error. The server must be serving the same weights (`make serve MIMI_WEIGHTS=...` with
the same file): it does not report which weights it serves, so a mismatch shows as FAIL.

Needs the export extra (PyTorch, transformers), and moshi for moshi-format checkpoints.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from client.stream import (
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_URL,
    NUM_CODEBOOKS,
    SAMPLES_PER_FRAME,
    ClientError,
    Code2WavStreamer,
    StreamOptions,
    random_codes,
)

MAX_ABS_ERROR = 1e-4
MIN_SNR_DB = 100.0
# 150 frames (12 s) fills the decoder's 250-step attention window (125 frames) and goes past it.
DEFAULT_FRAMES = 150


def snr_db(output: np.ndarray, reference: np.ndarray) -> float:
    output, reference = np.asarray(output, np.float64), np.asarray(reference, np.float64)
    noise = np.sum((output - reference) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(reference**2) / noise))


def moshi_stream_decode(model, codes: np.ndarray) -> np.ndarray:
    """moshi's streaming decode (inside `model.streaming(B)`), one frame per call, as Moshi-family
    servers run it: codes [B, k, F] -> PCM float32 [B, F*1920]."""
    import torch

    chunks = []
    with torch.no_grad(), model.streaming(codes.shape[0]):
        tensor = torch.from_numpy(np.asarray(codes)).long()
        for frame in range(codes.shape[2]):
            chunks.append(model.decode(tensor[:, :, frame : frame + 1])[:, 0].numpy())
    return np.concatenate(chunks, axis=1)


def moshi_reference(checkpoint: str, codes: np.ndarray) -> np.ndarray:
    """moshi's streaming decode of a moshi-format checkpoint: codes [B, k, F] -> [B, F*1920]."""
    from moshi.models.loaders import get_mimi

    return moshi_stream_decode(get_mimi(checkpoint, device="cpu", num_codebooks=codes.shape[1]), codes)


def step_reference(model, codes: np.ndarray) -> np.ndarray:
    """The PyTorch streaming step (moshi window), one frame per call: [B, k, F] -> [B, F*1920]."""
    import torch

    from export.step import MimiDecoderStep

    step = MimiDecoderStep(model, num_codebooks=codes.shape[1], frames_per_step=1, window="moshi").eval()
    state = step.zero_state(codes.shape[0])
    chunks = []
    with torch.no_grad():
        tensor = torch.from_numpy(codes.astype(np.int32))
        for frame in range(codes.shape[2]):
            pcm, *state = step(tensor[:, :, frame : frame + 1], *state)
            chunks.append(pcm.numpy())
    return np.concatenate(chunks, axis=1)


def reference_decode(args: argparse.Namespace, codes: np.ndarray) -> tuple[np.ndarray, str]:
    """(reference PCM [B, F*1920], a line saying what the reference is)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ClientError("verify needs PyTorch and transformers for the reference: pip install -e '.[export]'") from None
    from export.__main__ import load_weights_arg
    from export.weights import WeightsError

    try:
        loaded = load_weights_arg(args.weights, args.random_init, args.seed, allow_default=True)
    except WeightsError as exc:
        raise ClientError(str(exc)) from None
    if loaded.kind == "moshi":
        try:
            pcm = moshi_reference(loaded.source, codes)
            return pcm, f"moshi streaming decode of {loaded.source}"
        except ImportError:
            note = " (moshi is not installed: using the step module instead)"
    else:
        note = f" (no moshi loader reads {loaded.kind} weights)"
    pcm = step_reference(loaded.model, codes)
    return pcm, f"PyTorch streaming step module (moshi window) with weights {loaded.source}{note}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m client.verify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default=DEFAULT_URL, help="Triton gRPC address of the running server (default %(default)s)")
    parser.add_argument("--weights", help="the weights the server serves: moshi .safetensors file, transformers folder "
                        "or hub id (default: as `make serve`: kyutai/mimi when available, else random seed 0)")
    parser.add_argument("--random-init", action="store_true", help="the server serves seeded random weights")
    parser.add_argument("--seed", type=int, default=None, help="seed of --random-init (default 0)")
    parser.add_argument("--streams", type=int, default=2, help="concurrent streams (default %(default)s)")
    parser.add_argument("--frames", type=int, default=DEFAULT_FRAMES, help="frames per stream (default %(default)s)")
    parser.add_argument("--chunk-frames", type=int, default=DEFAULT_CHUNK_FRAMES, help="frames per request after the first")
    parser.add_argument("--codes-seed", type=int, default=0, help="seed of stream 0's codes; stream i uses seed + i")
    args = parser.parse_args(argv)
    if args.streams < 1 or args.frames < 1:
        parser.error("--streams and --frames must be >= 1")

    codes = np.stack([random_codes(args.frames, args.codes_seed + i) for i in range(args.streams)])
    try:
        # The reference first: weights that cannot be read fail before anything is streamed.
        reference, what = reference_decode(args, codes)
        with Code2WavStreamer(args.url) as streamer:
            streamer.check_ready()
            print(f"server {args.url}: streaming {args.streams} x {args.frames} frames of seeded codes "
                  f"(chunks of 1 then {args.chunk_frames} frames, with frame_offset)", flush=True)
            report = streamer.run(list(codes), StreamOptions(chunk_frames=args.chunk_frames))
    except ClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"reference: {what}")
    print("note: the server must be serving these same weights; it does not say which it serves, "
          "so different weights show as FAIL")
    passed = True
    for index, result in enumerate(report.results):
        expected = reference[index]
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
    verdict = "PASS" if passed else "FAIL"
    print(f"{verdict}: server vs reference, tolerances max abs <= {MAX_ABS_ERROR:g}, SNR >= {MIN_SNR_DB:g} dB "
          f"({SAMPLES_PER_FRAME} samples x {args.frames} frames x {args.streams} streams, {NUM_CODEBOOKS} codebooks)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
