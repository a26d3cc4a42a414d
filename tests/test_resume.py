"""Resume by replay (docs/design.md §2.4) on the tiny decoder step (a 20-step window over 2 layers): a fresh
state replaying the R frames before the resume point decodes what follows closer to the uninterrupted decode
as R covers one window, then a window per layer; the whole history is exact (serving: test_resume_serving.py)."""

from __future__ import annotations

import numpy as np
import pytest

from mimi_code2wav.export.reference import snr_db

from mimi_fixtures import CODES_SEED, SEED, tiny_config

torch = pytest.importorskip("torch", reason="the export extra (torch) is needed for the resume measurement")

RESUME_FRAME = 40
WINDOW_FRAMES = (4, 20)  # SNR over the first 4 and the first 20 frames after the resume point
STREAMS = 3


@pytest.fixture(scope="module")
def tiny_step():
    from mimi_code2wav.export.step import MimiDecoderStep
    from mimi_code2wav.export.weights import random_model

    return MimiDecoderStep(random_model(SEED, tiny_config()).model, max_frames_per_step=8).eval()


@pytest.fixture(scope="module")
def tiny_codes(tiny_step):
    rng = np.random.default_rng(CODES_SEED)
    return rng.integers(0, tiny_step.codebook_size, (STREAMS, tiny_step.num_codebooks, RESUME_FRAME + max(WINDOW_FRAMES)))


def decode(step, codes: np.ndarray, first_frame: int, frames_per_call: int) -> np.ndarray:
    """PCM [streams, samples] of frames [first_frame, T) of codes [streams, k, T], from a fresh state."""
    state = list(step.zero_state(codes.shape[0]))
    pcm = []
    with torch.no_grad():
        for first in range(first_frame, codes.shape[2], frames_per_call):
            chunk = torch.from_numpy(np.ascontiguousarray(codes[:, :, first : first + frames_per_call], dtype=np.int32))
            out, *state = step(chunk, *state)
            pcm.append(out.numpy())
    return np.concatenate(pcm, axis=1)


@pytest.fixture(scope="module")
def resumed_snr_db(tiny_step, tiny_codes):
    """R -> SNR (dB) [window, stream] after RESUME_FRAME having replayed R frames, against the uninterrupted
    decode (one frame per call, so that call sizes differ too)."""
    spf = tiny_step.samples_per_frame
    reference = decode(tiny_step, tiny_codes, 0, 1)[:, RESUME_FRAME * spf :]

    def measure(history_frames: int) -> np.ndarray:
        resumed = decode(tiny_step, tiny_codes, RESUME_FRAME - history_frames, 8)[:, history_frames * spf :]
        return np.array([[snr_db(resumed[s, : w * spf], reference[s, : w * spf]) for s in range(STREAMS)]
                         for w in WINDOW_FRAMES])

    return {history: measure(history) for history in (0, 10, 20, RESUME_FRAME)}


def test_full_history_replay_is_exact(resumed_snr_db):
    assert np.min(resumed_snr_db[RESUME_FRAME]) >= 100.0, resumed_snr_db[RESUME_FRAME]


def test_history_of_a_window_rebuilds_the_state(resumed_snr_db):
    no_history, one_window, window_per_layer = resumed_snr_db[0], resumed_snr_db[10], resumed_snr_db[20]
    # Without history the resumed audio is barely related to the uninterrupted one.
    assert np.max(no_history[0]) < 10.0, no_history
    # One attention window plus the conv contexts: far closer, though deeper layers still remember.
    assert np.min(one_window) >= 30.0 and np.min(one_window) >= np.max(no_history) + 20.0, one_window
    # A window per layer: close to the float rounding floor.
    assert np.min(window_per_layer) >= 70.0, window_per_layer
