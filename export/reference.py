"""Streaming references, one frame per call: moshi's decoder for moshi-format checkpoints (installed with
--no-deps: it pins an older torch), else the PyTorch step module (the parity tests hold it equal to moshi's)."""

from __future__ import annotations

import numpy as np


def snr_db(output: np.ndarray, reference: np.ndarray) -> float:
    output, reference = np.asarray(output, np.float64), np.asarray(reference, np.float64)
    noise = np.sum((output - reference) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(reference**2) / noise))


def moshi_stream_decode(model, codes: np.ndarray) -> np.ndarray:
    """moshi's streaming decode, one frame per call as Moshi-family servers run it: [B, k, F] -> [B, F*1920]."""
    import torch

    with torch.no_grad(), model.streaming(codes.shape[0]):
        tensor = torch.from_numpy(np.asarray(codes)).long()
        return np.concatenate([model.decode(tensor[:, :, frame : frame + 1])[:, 0].numpy()
                               for frame in range(codes.shape[2])], axis=1)


def step_reference(model, codes: np.ndarray, window: str = "moshi") -> np.ndarray:
    """The PyTorch streaming step, one frame per call: [B, k, F] -> [B, F*1920]."""
    import torch

    from .step import MimiDecoderStep

    step = MimiDecoderStep(model, num_codebooks=codes.shape[1], max_frames_per_step=1, window=window).eval()
    state = step.zero_state(codes.shape[0])
    chunks = []
    with torch.no_grad():
        tensor = torch.from_numpy(codes.astype(np.int32))
        for frame in range(codes.shape[2]):
            pcm, *state = step(tensor[:, :, frame : frame + 1], *state)
            chunks.append(pcm.numpy())
    return np.concatenate(chunks, axis=1)


def reference_decode(weights: str | None, random_init: bool, seed: int | None,
                     codes: np.ndarray) -> tuple[np.ndarray, str]:
    """(PCM [B, F*1920], what it is): the reference decode for the weights `code2wav-server serve` would choose."""
    from .pipeline import choose_weights

    loaded = choose_weights(weights, random_init, seed, allow_default=True)
    if loaded.kind == "moshi":
        try:
            from moshi.models.loaders import get_mimi

            model = get_mimi(loaded.source, device="cpu", num_codebooks=codes.shape[1])
            return moshi_stream_decode(model, codes), f"moshi streaming decode of {loaded.source}"
        except ImportError:
            note = " (moshi is not installed: using the step module instead)"
    else:
        note = f" (no moshi loader reads {loaded.kind} weights)"
    pcm = step_reference(loaded.model, codes)
    return pcm, f"PyTorch streaming step module (moshi window) with weights {loaded.source}{note}"
