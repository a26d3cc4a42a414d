"""Resume by replay: how well a stream's decoder state is rebuilt from the last R frames of codes.

A stream's decoder state lives on one replica. When that replica is lost, the client starts a new
sequence on another one, sends the last R frames it decoded as history (decoded to rebuild the
state, audio discarded), then goes on with new frames. Streaming decoding only forgets gradually
(a 250-step attention window per layer over 8 layers, plus conv contexts), so the resumed audio
differs from the uninterrupted decode; this module measures by how much.

For every history length R, `measure_resume` gives the SNR of the first 1 s (13 frames) and the
first 10 s (125 frames) after the resume point, resumed vs uninterrupted, per stream, and the same
for a replay of the whole history (which must be exact: the check that the measurement itself is
sound). Its command line, report and plot: `python -m benchmarks resume`.

Two ways of starting the resumed state are measured:
  restart   the new sequence's state starts at position 0 (a fresh stream): what the serving
            contract gives a new sequence. RoPE is relative, so the position offset does not matter.
  continue  position starts at 2 * (t - R), the stream's own position, with an all-zero KV cache.
            The step's mask counts KV slots as filled once slot + position >= 0, so the zero slots
            are attended as if they were real steps until the replay has pushed them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mimi_code2wav.export.reference import snr_db

DEFAULT_HISTORY_FRAMES = (0, 12, 25, 62, 125, 250, 500)
# 1 s and 10 s of audio at 12.5 frames/s (the first second rounded up to whole frames).
DEFAULT_WINDOW_FRAMES = (13, 125)
POSITION_MODES = ("restart", "continue")
FULL_HISTORY_MIN_SNR_DB = 100.0


@dataclass
class ResumeMeasurement:
    """SNR (dB) of resumed vs uninterrupted audio; +inf where the two are identical.

    snr_db[mode] is [len(history_frames), len(window_frames), streams]: history R, window w, stream s
    = SNR over frames [t, t + window_frames[w]) of stream s resumed at frame t after replaying frames
    [t - R, t). full_history_snr_db is [len(window_frames), streams]: replay of frames [0, t).
    """

    resume_frame: int
    history_frames: tuple[int, ...]
    window_frames: tuple[int, ...]
    snr_db: dict[str, np.ndarray]
    full_history_snr_db: np.ndarray


@dataclass
class _Row:
    stream: int
    start_frame: int  # the row's fresh state decodes frames [start_frame, end) of its stream
    start_position: int


def _decode_rows(step, codes, rows: Sequence[_Row], keep_from: int, end_frame: int,
                 frames_per_call: int, max_batch_rows: int) -> np.ndarray:
    """Decode every row from its start frame to end_frame in one shared timeline; a row joins the
    batch at its start frame with a fresh state. Returns PCM [rows, (end_frame - keep_from) * spf]
    of frames [keep_from, end_frame); earlier audio is discarded."""
    import torch

    spf = step.samples_per_frame
    state = list(step.zero_state(len(rows)))
    state[-1][:, 0] = torch.tensor([row.start_position for row in rows], dtype=torch.int32)  # position
    starts = np.array([row.start_frame for row in rows])
    streams = torch.tensor([row.stream for row in rows])
    pcm_out = np.zeros((len(rows), (end_frame - keep_from) * spf), dtype=np.float32)
    # Calls never cross a row's start (it joins between calls) nor keep_from (a call's audio is
    # either all discarded or all kept).
    boundaries = sorted({*starts.tolist(), keep_from, end_frame})
    cursor = int(starts.min())
    with torch.no_grad():
        while cursor < end_frame:
            limit = next(b for b in boundaries if b > cursor)
            frames = min(frames_per_call, limit - cursor)
            active = np.flatnonzero(starts <= cursor)
            for first in range(0, len(active), max_batch_rows):
                chunk = torch.from_numpy(active[first : first + max_batch_rows])
                pcm, *new_state = step(codes[streams[chunk], :, cursor : cursor + frames],
                                       *[tensor[chunk] for tensor in state])
                for tensor, new in zip(state, new_state):
                    tensor[chunk] = new
                if cursor >= keep_from:
                    offset = (cursor - keep_from) * spf
                    pcm_out[chunk.numpy(), offset : offset + frames * spf] = pcm.numpy()
            cursor += frames
    return pcm_out


def measure_resume(step, codes: np.ndarray, resume_frame: int,
                   history_frames: Sequence[int] = DEFAULT_HISTORY_FRAMES,
                   window_frames: Sequence[int] = DEFAULT_WINDOW_FRAMES,
                   modes: Sequence[str] = ("restart",), frames_per_call: int | None = None,
                   max_batch_rows: int = 8) -> ResumeMeasurement:
    """SNR of resumed vs uninterrupted decoding for each history length and position mode.

    step: a `MimiDecoderStep`. codes: int [streams, k, T] with T >= resume_frame + max(window_frames).
    resume_frame t >= max(history_frames). frames_per_call defaults to the step's maximum. The
    uninterrupted decode runs each stream from frame 0; every resumed variant, the full-history
    replay included, runs in one batched timeline whose call boundaries differ from it, so the
    full-history figure also checks that call sizes and batch-mates do not change the audio.
    """
    import torch

    history_frames, window_frames = tuple(history_frames), tuple(window_frames)
    frames_per_call = frames_per_call or step.max_frames_per_step
    streams, _, total_frames = codes.shape
    end_frame = resume_frame + max(window_frames)
    if min(history_frames) < 0 or max(history_frames) > resume_frame:
        raise ValueError(f"history frames must be in [0, resume_frame={resume_frame}], got {history_frames}")
    if total_frames < end_frame:
        raise ValueError(f"codes hold {total_frames} frames; resuming at {resume_frame} with a "
                         f"{max(window_frames)}-frame window needs {end_frame}")
    unknown = set(modes) - set(POSITION_MODES)
    if unknown:
        raise ValueError(f"position modes must be among {POSITION_MODES}, got {sorted(unknown)}")
    tensor = torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int32))

    reference = _decode_rows(step, tensor, [_Row(s, 0, 0) for s in range(streams)], resume_frame, end_frame,
                             frames_per_call, max_batch_rows)
    # Variant order: (mode, R) for every mode and R, then the full-history replay; each for every stream.
    variants = [(mode, history) for mode in modes for history in history_frames] + [("restart", resume_frame)]
    rows = []
    for mode, history in variants:
        start = resume_frame - history
        position = step.steps_per_frame * start if mode == "continue" else 0
        rows += [_Row(s, start, position) for s in range(streams)]
    resumed = _decode_rows(step, tensor, rows, resume_frame, end_frame, frames_per_call, max_batch_rows)
    resumed = resumed.reshape(len(variants), streams, -1)

    spf = step.samples_per_frame
    snr = np.array([[[snr_db(resumed[v, s, : w * spf], reference[s, : w * spf]) for s in range(streams)]
                     for w in window_frames] for v in range(len(variants))])
    per_mode = {mode: snr[i * len(history_frames) : (i + 1) * len(history_frames)] for i, mode in enumerate(modes)}
    return ResumeMeasurement(resume_frame, history_frames, window_frames, per_mode, snr[-1])

