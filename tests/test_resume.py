"""Resume by replay (benchmarks/resume_snr.py) on the tiny config: a 20-step attention window (9 frames of KV
cache) over 2 layers, conv contexts shorter than a frame, seeded random weights.

Measured with these seeds (min over 3 streams, first 4 / first 20 frames after resuming at frame 40):
R = 0: 0.0 / 7.5 dB; R = 10 (one window + conv context): 36.8 / 44.4 dB; R = 20 (a window per layer):
82.1 / 89.3 dB; whole history: 125.9 / 128.2 dB. The real architecture (250-step window, 8 layers)
needs R = 500 frames for the same rounding floor; see `python -m benchmarks resume`.
"""

from __future__ import annotations

import json
from xml.dom import minidom

import numpy as np
import pytest

from mimi_fixtures import CODES_SEED, SEED, tiny_config

torch = pytest.importorskip("torch", reason="the export extra (torch) is needed for the resume measurement")

RESUME_FRAME = 40
HISTORY_FRAMES = (0, 10, 20)
WINDOW_FRAMES = (4, 20)
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


@pytest.fixture(scope="module")
def measurement(tiny_step, tiny_codes):
    from benchmarks.resume_snr import measure_resume

    return measure_resume(tiny_step, tiny_codes, RESUME_FRAME, HISTORY_FRAMES, WINDOW_FRAMES, ("restart", "continue"))


def test_full_history_replay_is_exact(measurement):
    assert measurement.full_history_snr_db.shape == (len(WINDOW_FRAMES), STREAMS)
    assert np.min(measurement.full_history_snr_db) >= 100.0, measurement.full_history_snr_db


@pytest.mark.parametrize("mode", ["restart", "continue"])
def test_history_of_a_window_rebuilds_the_state(measurement, mode):
    snr = measurement.snr_db[mode]  # [R, window, stream]
    assert snr.shape == (len(HISTORY_FRAMES), len(WINDOW_FRAMES), STREAMS)
    no_history, one_window, window_per_layer = snr
    # Without history the resumed audio is barely related to the uninterrupted one.
    assert np.max(no_history[0]) < 10.0, no_history
    # One attention window plus the conv contexts: far closer, though deeper layers still remember.
    assert np.min(one_window) >= 30.0 and np.min(one_window) >= np.max(no_history) + 20.0, one_window
    # A window per layer: close to the float rounding floor.
    assert np.min(window_per_layer) >= 70.0, window_per_layer


def test_report_is_json_table_and_svg(measurement):
    from benchmarks.resume import report_dict, svg_plot, table

    report = json.loads(json.dumps(report_dict(measurement, frame_rate_hz=12.5)))
    assert [row["history_frames"] for row in report["rows"]] == list(HISTORY_FRAMES)
    assert set(report["rows"][0]) == {"history_frames", "history_s", "restart", "continue"}
    assert report["full_history"]["first_20_frames"]["min_db"] >= 100.0
    lines = table(measurement, frame_rate_hz=12.5).splitlines()
    assert len(lines) == 2 + len(HISTORY_FRAMES) + 1 and lines[-1].startswith(f"| {RESUME_FRAME} (full)")
    svg = minidom.parseString(svg_plot(measurement, frame_rate_hz=12.5, title="tiny"))
    assert len(svg.getElementsByTagName("polyline")) == len(WINDOW_FRAMES)


def test_rejects_history_beyond_the_resume_point_and_short_codes(tiny_step, tiny_codes):
    from benchmarks.resume_snr import measure_resume

    with pytest.raises(ValueError, match="history frames"):
        measure_resume(tiny_step, tiny_codes, 10, (0, 20), WINDOW_FRAMES)
    with pytest.raises(ValueError, match="needs 60"):
        measure_resume(tiny_step, tiny_codes[:, :, :50], RESUME_FRAME, HISTORY_FRAMES, WINDOW_FRAMES)
    with pytest.raises(ValueError, match="position modes"):
        measure_resume(tiny_step, tiny_codes, RESUME_FRAME, HISTORY_FRAMES, WINDOW_FRAMES, ("sideways",))
