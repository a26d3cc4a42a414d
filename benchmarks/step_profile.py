"""Where the exported decoder step spends its time in ONNX Runtime: kernel time by op type, and the
speed of one export against another in the same run.

  python benchmarks/step_profile.py [--export DIR] [--baseline DIR] [--batch 8] [--frames 1] [--threads 2]

Without --export the step is exported from seeded random weights (speed does not depend on them);
--export and --baseline take export folders (model.onnx + manifest.json, as `make export` writes).
Each model is profiled with ONNX Runtime's profiler over --runs steps after warm-up steps, and the
kernel time of every op type is summed. Ops that only move bytes (Slice, Concat, Split, Transpose,
Gather, ScatterND, ...) are marked `copy`; their share of kernel time is what a state layout is judged
by. With --baseline, both models are also timed without the profiler in alternating rounds, and the
table gives the median time per step of each and their ratio.

Prints the tables and writes `step_profile.json` to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Ops whose kernels move or duplicate bytes without arithmetic.
COPY_OPS = frozenset({
    "Slice", "Concat", "Split", "Transpose", "Gather", "GatherElements", "GatherND", "Expand", "Tile",
    "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Pad", "ScatterND", "ScatterElements", "Cast",
})
DTYPES = {"int32": np.int32, "float32": np.float32, "float16": np.float16}


class Stepper:
    """One export in one ONNX Runtime session, stepping a batch of streams from a fresh state."""

    def __init__(self, folder: Path, batch: int, frames: int, threads: int, profile: bool):
        import onnxruntime as ort

        from mimi_code2wav.export.onnx_export import MODEL_FILE, read_manifest
        from mimi_code2wav.export.spec import DecoderSpec

        manifest = read_manifest(folder)
        if manifest is None:
            raise SystemExit(f"{folder}: no export (model.onnx + manifest.json) there")
        self.spec = DecoderSpec.from_dict(manifest["spec"])
        if frames > self.spec.max_frames_per_step:
            raise SystemExit(f"{folder}: exported for at most {self.spec.max_frames_per_step} frames per call")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        if profile:
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(tempfile.mkdtemp(prefix="mimi-profile-")) / "ort")
        self.session = ort.InferenceSession(str(folder / MODEL_FILE), options, providers=["CPUExecutionProvider"])
        self.names = [t.name for t in self.spec.inputs]
        self.state = [np.zeros((batch, *s.shape), dtype=DTYPES[s.dtype]) for s in self.spec.states]
        rng = np.random.default_rng(0)
        self.codes = [rng.integers(0, self.spec.codebook_size, (batch, self.spec.num_codebooks, frames)).astype(np.int32)
                      for _ in range(16)]
        self.calls = 0

    def step(self) -> None:
        codes = self.codes[self.calls % len(self.codes)]
        _, *self.state = self.session.run(None, dict(zip(self.names, [codes, *self.state])))
        self.calls += 1

    def seconds_per_step(self, runs: int) -> float:
        started = time.perf_counter()
        for _ in range(runs):
            self.step()
        return (time.perf_counter() - started) / runs

    def kernel_time_by_op(self, runs: int) -> dict[str, float]:
        """Microseconds per op type summed over the last `runs` steps (the profile holds them all)."""
        events = json.loads(Path(self.session.end_profiling()).read_text())
        spans = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
        first = spans[-runs]
        by_op: dict[str, float] = collections.Counter()
        for event in events:
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= first:
                by_op[event["args"]["op_name"]] += event["dur"]
        return dict(by_op)


def profile(folder: Path, args) -> dict:
    stepper = Stepper(folder, args.batch, args.frames, args.threads, profile=True)
    for _ in range(args.warmup):
        stepper.step()
    stepper.seconds_per_step(args.runs)
    by_op = stepper.kernel_time_by_op(args.runs)
    total = sum(by_op.values())
    ops = [{"op": op, "ms_per_step": us / 1000 / args.runs, "share": us / total, "copy": op in COPY_OPS}
           for op, us in sorted(by_op.items(), key=lambda item: -item[1])]
    return {"export": str(folder), "kv_cache_dtype": stepper.spec.kv_cache_dtype,
            "state_mib_per_stream": stepper.spec.state_bytes_per_stream() / 2**20,
            "kernel_ms_per_step": total / 1000 / args.runs,
            "copy_share": sum(o["share"] for o in ops if o["copy"]), "ops": ops}


def compare(folders: dict[str, Path], args) -> dict[str, dict]:
    """Median seconds per step of each export, timed in alternating rounds (no profiler)."""
    steppers = {name: Stepper(folder, args.batch, args.frames, args.threads, profile=False)
                for name, folder in folders.items()}
    for stepper in steppers.values():
        for _ in range(args.warmup):
            stepper.step()
    rounds: dict[str, list[float]] = {name: [] for name in steppers}
    for index in range(args.rounds):
        print(f"  timing round {index + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for name, stepper in steppers.items():
            rounds[name].append(stepper.seconds_per_step(args.runs))
    return {name: {"ms_per_step": statistics.median(times) * 1000,
                   "ms_per_frame": statistics.median(times) * 1000 / (args.batch * args.frames),
                   "rounds_ms": [t * 1000 for t in times]} for name, times in rounds.items()}


def markdown(result: dict) -> str:
    lines = [f"batch {result['batch']}, {result['frames']} frame(s) per call, {result['threads']} threads", ""]
    if result.get("timing"):
        lines += ["| export | ms / step | ms / frame | x baseline |", "|---|---:|---:|---:|"]
        base = result["timing"].get("baseline", {}).get("ms_per_step")
        for name, row in result["timing"].items():
            ratio = f"{base / row['ms_per_step']:.2f}" if base else ""
            lines.append(f"| {name} | {row['ms_per_step']:.2f} | {row['ms_per_frame']:.2f} | {ratio} |")
        lines.append("")
    for name, prof in result["profiles"].items():
        lines += [f"{name}: kv cache {prof['kv_cache_dtype']}, state {prof['state_mib_per_stream']:.2f} MiB per stream, "
                  f"kernel time {prof['kernel_ms_per_step']:.2f} ms per step, copy ops {prof['copy_share']:.1%}", "",
                  "| op | kernel ms / step | share | copy |", "|---|---:|---:|---|"]
        for row in prof["ops"]:
            if row["share"] >= 0.005:
                lines.append(f"| {row['op']} | {row['ms_per_step']:.3f} | {row['share']:.1%} | {'yes' if row['copy'] else ''} |")
        lines.append("")
    return "\n".join(lines)


def _export_fresh(work: Path, args) -> Path:
    import warnings

    warnings.filterwarnings("ignore")
    from mimi_code2wav.export.onnx_export import ExportOptions, build_step, export_onnx, write_manifest
    from mimi_code2wav.export.weights import load_weights

    loaded = load_weights(args.weights, seed=None if args.weights else 0)
    options = ExportOptions(max_frames_per_step=max(args.frames, 1), kv_cache_dtype=args.kv_cache_dtype)
    print("exporting the step ...", file=sys.stderr, flush=True)
    spec = export_onnx(build_step(loaded.model, options), work / "model.onnx", log=lambda *_: None)
    write_manifest(work, spec, options, loaded.source, loaded.kind, loaded.sha256)
    return work


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", type=Path, help="export folder to profile (default: export one now)")
    parser.add_argument("--baseline", type=Path, help="export folder to time and profile against")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--frames", type=int, default=1, help="frames per call")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=20, help="steps per profile and per timing round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds (with --baseline)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "float16"),
                        help="for the fresh export")
    parser.add_argument("--weights", type=Path, help="moshi-format .safetensors for the fresh export")
    parser.add_argument("--out", type=Path, default=Path("bench_results") / "step-profile")
    args = parser.parse_args(argv)

    folders = {"export": args.export or _export_fresh(Path(tempfile.mkdtemp(prefix="mimi-export-")), args)}
    if args.baseline:
        folders = {"baseline": args.baseline, **folders}
    result = {"batch": args.batch, "frames": args.frames, "threads": args.threads, "runs": args.runs,
              "timing": compare(folders, args) if args.baseline else None,
              "profiles": {}}
    for name, folder in folders.items():
        print(f"profiling {name} ({args.runs} steps) ...", file=sys.stderr, flush=True)
        result["profiles"][name] = profile(folder, args)
    print(markdown(result))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_profile.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
