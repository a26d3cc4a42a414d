"""perf_analyzer `--input-data` for code2wav (or mimi_decoder itself): one sequence per stream, one step per chunk.

Each step's inputs lack the batch dimension (perf_analyzer adds it): code2wav's `input_ids` [8 * F], or
the decoder's `codes` [8, F] INT32 with `--model mimi_decoder` (checked with perf_analyzer 2.51.0). Steps
are deltas WITHOUT frame_offset: perf_analyzer ends a sequence in flight (end of a window, a load change)
by sending its last step with END, skipping those between, which an offset would reject as a gap.
"""

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
    steps = []
    for start, stop in chunk_bounds(codes.shape[1], chunk_frames, schedule=schedule):
        piece = codes[:, start:stop]
        if model == "mimi_decoder":
            steps.append({"codes": {"content": piece.reshape(-1).tolist(), "shape": list(piece.shape)}})
        else:  # codebook-major, as the contract's input_ids
            steps.append({"input_ids": {"content": piece.reshape(-1).tolist(), "shape": [piece.size]}})
    return steps


def input_data(streams: int, frames: int, chunk_frames: int = DEFAULT_CHUNK_FRAMES, seed: int = 0,
               schedule: tuple[int, ...] | None = None, model: str = "code2wav") -> dict:
    """The --input-data document: `streams` sequences of `frames` random frames (stream i: seed + i)."""
    if streams < 1 or model not in MODELS:
        raise ValueError(f"needs streams >= 1 and a model of {MODELS}, got {streams} and {model!r}")
    return {"data": [sequence_steps(random_codes(frames, seed + i), chunk_frames, schedule=schedule, model=model)
                     for i in range(streams)]}


def describe(document: dict) -> dict:
    """Steps per sequence and frames per step of a document (to turn requests/s into frames/s); every sequence
    of an `input_data` document has the same steps."""
    step_frames = [step["codes"]["shape"][1] if "codes" in step else step["input_ids"]["shape"][0] // NUM_CODEBOOKS
                   for step in document["data"][0]]
    return {"sequences": len(document["data"]), "steps_per_sequence": len(step_frames),
            "frames_per_sequence": sum(step_frames), "mean_frames_per_step": sum(step_frames) / len(step_frames)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.perf_inputs", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--streams", type=int, default=4, help="sequences in the file (default %(default)s)")
    parser.add_argument("--frames", type=int, default=64, help="frames per sequence (default %(default)s)")
    parser.add_argument("--chunk-frames", type=int, default=DEFAULT_CHUNK_FRAMES,
                        help="frames per step after the first, which holds 1 (default %(default)s)")
    parser.add_argument("--schedule", type=lambda text: tuple(int(v) for v in text.split(",") if v.strip()),
                        help="frames per step in turn, e.g. 1,3,1,16,2 (instead of --chunk-frames)")
    parser.add_argument("--model", choices=MODELS, default="code2wav",
                        help="whose inputs: code2wav's input_ids or mimi_decoder's codes (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of stream 0; stream i uses seed + i")
    args = parser.parse_args(argv)
    document = input_data(args.streams, args.frames, args.chunk_frames, args.seed, args.schedule, args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, separators=(",", ":")))
    print(json.dumps(describe(document)))  # perf.sh reads steps_per_sequence
    return 0


if __name__ == "__main__":
    sys.exit(main())
