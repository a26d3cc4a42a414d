"""Speech to codes with Mimi's encoder (`code2wav-export encode`): a WAV file -> codes [k, frames] .npy."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from mimi_code2wav.client.protocol import SAMPLE_RATE_HZ
from mimi_code2wav.client.wav import WavError, read_wav


class EncodeError(Exception):
    """The input or the weights cannot be used; the message says which and why."""


def resample_linear(audio: np.ndarray, from_hz: int, to_hz: int) -> np.ndarray:
    """Linear-interpolation resampling (no anti-aliasing filter: fine for speech near 24 kHz)."""
    if from_hz == to_hz:
        return audio
    duration_s = len(audio) / from_hz
    target_times = np.arange(int(round(duration_s * to_hz))) / to_hz
    return np.interp(target_times, np.arange(len(audio)) / from_hz, audio).astype(np.float32)


def encode_file(input_path: Path, weights: str, out_path: Path, num_codebooks: int = 8) -> np.ndarray:
    """Encode a WAV file (any PCM/float format, channels averaged, resampled to 24 kHz) into codes
    int64 [num_codebooks, frames] and save them to `out_path` (.npy). Raises EncodeError."""
    import torch

    from .weights import WeightsError, load_weights

    try:
        wav = read_wav(input_path)
    except (OSError, WavError) as exc:
        raise EncodeError(f"cannot read {input_path}: {exc}") from None
    audio = wav.to_float32_mono()
    if wav.channels > 1:
        print(f"note: {input_path} has {wav.channels} channels; encoding their average", file=sys.stderr)
    if wav.sample_rate_hz != SAMPLE_RATE_HZ:
        print(f"note: resampling {wav.sample_rate_hz} Hz -> {SAMPLE_RATE_HZ} Hz by linear interpolation", file=sys.stderr)
        audio = resample_linear(audio, wav.sample_rate_hz, SAMPLE_RATE_HZ)
    try:
        model = load_weights(weights).model.eval()
    except WeightsError as exc:
        raise EncodeError(str(exc)) from None
    with torch.no_grad():
        codes = model.encode(torch.from_numpy(audio).view(1, 1, -1), num_quantizers=num_codebooks).audio_codes
    codes = codes[0].numpy().astype(np.int64)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    np.save(out_path, codes)
    print(f"wrote {out_path}: codes {list(codes.shape)} ({codes.shape[1]} frames, "
          f"{len(audio) / SAMPLE_RATE_HZ:.2f} s of audio)")
    return codes
