"""perf_analyzer input data for code2wav (or mimi_decoder itself): one sequence per stream, one step per chunk.

    python -m client.perf_inputs --out build/perf/inputs.json [--streams 4] [--frames 64]
                                 [--chunk-frames 4 | --schedule 1,3,1,16,2] [--seed 0] [--model code2wav]

perf_analyzer's `--input-data` JSON for sequence models (checked with 2.51.0), one list of steps per
sequence, each input without the batch dimension (perf_analyzer adds it, max_batch_size > 0):

    {"data": [[{"input_ids": {"content": [...], "shape": [8]}}, {"input_ids": {...}}, ...], [...]]}

Steps are deltas WITHOUT frame_offset: perf_analyzer ends in-flight sequences (end of a window, a load
change) by sending their last step with END, skipping those between, which an offset would (rightly)
reject as a gap. One frame, then `chunk_frames` per step (or `--schedule` sizes in turn); `--model
mimi_decoder`: the decoder's own steps, `{"codes": {"content": [...], "shape": [8, F]}}` INT32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .protocol import (
    DEFAULT_CHUNK_FRAMES,
    FIRST_CHUNK_FRAMES,
    NUM_CODEBOOKS,
    chunk_bounds,
    random_codes,
    request_arrays,
)

DEFAULT_FRAMES = 64
MODELS = ("code2wav", "mimi_decoder")


def schedule_bounds(total_frames: int, schedule: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, stop) frame ranges taking `schedule` sizes in turn (the last one the remainder)."""
    if not schedule or min(schedule) < 1:
        raise ValueError(f"schedule sizes must be >= 1, got {list(schedule)}")
    bounds, start = [], 0
    while start < total_frames:
        stop = min(start + schedule[len(bounds) % len(schedule)], total_frames)
        bounds.append((start, stop))
        start = stop
    return bounds


def sequence_steps(codes: np.ndarray, chunk_frames: int = DEFAULT_CHUNK_FRAMES,
                   first_chunk_frames: int = FIRST_CHUNK_FRAMES, schedule: tuple[int, ...] | None = None,
                   model: str = "code2wav") -> list[dict]:
    """perf_analyzer steps for one stream of codes [k, F]: code2wav's delta input_ids (no
    frame_offset), or the decoder's codes [k, S] for `model="mimi_decoder"`."""
    if schedule:
        bounds = schedule_bounds(codes.shape[1], schedule)
    else:
        bounds = chunk_bounds(codes.shape[1], chunk_frames, first_chunk_frames)
    steps = []
    for start, stop in bounds:
        if model == "mimi_decoder":
            piece = codes[:, start:stop].astype(np.int32)
            steps.append({"codes": {"content": piece.reshape(-1).tolist(), "shape": list(piece.shape)}})
            continue
        input_ids = request_arrays(codes, start, stop, "delta", send_frame_offset=False)["input_ids"][0]
        steps.append({"input_ids": {"content": input_ids.tolist(), "shape": [int(input_ids.size)]}})
    return steps


def input_data(streams: int, frames: int, chunk_frames: int = DEFAULT_CHUNK_FRAMES, seed: int = 0,
               schedule: tuple[int, ...] | None = None, model: str = "code2wav") -> dict:
    """The --input-data document: `streams` sequences of `frames` random frames (stream i: seed + i)."""
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    return {"data": [sequence_steps(random_codes(frames, seed + i), chunk_frames, schedule=schedule, model=model)
                     for i in range(streams)]}


def _step_frames(step: dict) -> int:
    if "codes" in step:
        return step["codes"]["shape"][1]
    return step["input_ids"]["shape"][0] // NUM_CODEBOOKS


def describe(document: dict) -> dict:
    """Steps per sequence and frames per step of a document (to turn requests/s into frames/s)."""
    step_frames = [[_step_frames(step) for step in sequence] for sequence in document["data"]]
    steps = {len(s) for s in step_frames}
    if len(steps) != 1:
        raise ValueError(f"sequences differ in length: {sorted(steps)} steps")
    all_frames = [f for s in step_frames for f in s]
    return {
        "sequences": len(step_frames),
        "steps_per_sequence": steps.pop(),
        "frames_per_sequence": sum(step_frames[0]),
        "mean_frames_per_step": float(np.mean(all_frames)),
    }


def write_input_data(path: Path, streams: int, frames: int, chunk_frames: int = DEFAULT_CHUNK_FRAMES, seed: int = 0,
                     schedule: tuple[int, ...] | None = None, model: str = "code2wav") -> dict:
    """Write the document to `path`; returns `describe()` of it."""
    document = input_data(streams, frames, chunk_frames, seed, schedule, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, separators=(",", ":")))
    return describe(document)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.perf_inputs", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--streams", type=int, default=4, help="sequences in the file (default %(default)s)")
    parser.add_argument("--frames", type=int, default=DEFAULT_FRAMES, help="frames per sequence (default %(default)s)")
    parser.add_argument("--chunk-frames", type=int, default=DEFAULT_CHUNK_FRAMES,
                        help=f"frames per step after the first, which holds {FIRST_CHUNK_FRAMES} (default %(default)s)")
    parser.add_argument("--schedule", type=lambda text: tuple(int(v) for v in text.split(",") if v.strip()),
                        help="frames per step in turn, e.g. 1,3,1,16,2 (instead of --chunk-frames)")
    parser.add_argument("--model", choices=MODELS, default="code2wav",
                        help="whose inputs: code2wav's input_ids or mimi_decoder's codes (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of stream 0; stream i uses seed + i")
    args = parser.parse_args(argv)
    info = write_input_data(args.out, args.streams, args.frames, args.chunk_frames, args.seed, args.schedule,
                            args.model)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
