"""perf_analyzer `--input-data` for code2wav (or mimi_decoder itself): one sequence per stream, one step per chunk.

Steps lack the batch dimension (perf_analyzer adds it). They are deltas WITHOUT frame_offset: perf_analyzer ends a
sequence in flight by sending its last step with END, skipping those between, which an offset would reject."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .protocol import DEFAULT_CHUNK_FRAMES, NUM_CODEBOOKS, chunk_bounds, random_codes

MODELS = ("code2wav", "mimi_decoder")


def sequence_steps(codes: np.ndarray, chunk_frames: int = DEFAULT_CHUNK_FRAMES, schedule: tuple[int, ...] | None = None,
                   model: str = "code2wav") -> list[dict]:
    """perf_analyzer steps for one stream of codes [k, F]: 1 frame, then `chunk_frames` (or the `schedule`)."""
    pieces = [codes[:, start:stop] for start, stop in chunk_bounds(codes.shape[1], chunk_frames, schedule=schedule)]
    if model == "mimi_decoder":
        return [{"codes": {"content": piece.reshape(-1).tolist(), "shape": list(piece.shape)}} for piece in pieces]
    return [{"input_ids": {"content": piece.reshape(-1).tolist(), "shape": [piece.size]}} for piece in pieces]


def input_data(streams: int, frames: int, chunk_frames: int = DEFAULT_CHUNK_FRAMES, seed: int = 0,
               schedule: tuple[int, ...] | None = None, model: str = "code2wav") -> dict:
    """The --input-data document: `streams` sequences of `frames` random frames (stream i: seed + i)."""
    if streams < 1 or model not in MODELS:
        raise ValueError(f"needs streams >= 1 and a model of {MODELS}, got {streams} and {model!r}")
    return {"data": [sequence_steps(random_codes(frames, seed + i), chunk_frames, schedule=schedule, model=model)
                     for i in range(streams)]}


def describe(document: dict) -> dict:
    """Steps per sequence and frames per step of an `input_data` document (every sequence alike)."""
    step_frames = [step["codes"]["shape"][1] if "codes" in step else step["input_ids"]["shape"][0] // NUM_CODEBOOKS
                   for step in document["data"][0]]
    return {"sequences": len(document["data"]), "steps_per_sequence": len(step_frames),
            "frames_per_sequence": sum(step_frames), "mean_frames_per_step": sum(step_frames) / len(step_frames)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.perf_inputs", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", type=Path, required=True, help="JSON file to write")
    add("--streams", type=int, default=4, help="sequences in the file (default %(default)s)")
    add("--frames", type=int, default=64, help="frames per sequence (default %(default)s)")
    add("--chunk-frames", type=int, default=DEFAULT_CHUNK_FRAMES,
        help="frames per step after the first, which holds 1 (default %(default)s)")
    add("--schedule", type=lambda text: tuple(int(v) for v in text.split(",") if v.strip()),
        help="frames per step in turn, e.g. 1,3,1,16,2 (instead of --chunk-frames)")
    add("--model", choices=MODELS, default="code2wav", help="whose inputs (default %(default)s)")
    add("--seed", type=int, default=0, help="seed of stream 0; stream i uses seed + i")
    args = parser.parse_args(argv)
    document = input_data(args.streams, args.frames, args.chunk_frames, args.seed, args.schedule, args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, separators=(",", ":")))
    print(json.dumps(describe(document)))  # perf.sh reads steps_per_sequence
    return 0


if __name__ == "__main__":
    sys.exit(main())
