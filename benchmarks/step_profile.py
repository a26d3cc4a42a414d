"""Where the exported decoder step spends its time in ONNX Runtime: kernel time by op type, and the
speed of one export against another in the same run.

  python -m benchmarks step-profile [--export DIR] [--baseline DIR] [--batches 8 1]
                                                    [--threads 2] [--out bench_results/step-profile]

Without --export the step is exported from seeded random weights (speed does not depend on them);
--export and --baseline take export folders (model.onnx + manifest.json, as `make export` writes).
For each batch size, every model is profiled with ONNX Runtime's profiler over --runs steps of one
frame after warm-up steps, and the kernel time of each op type is summed. Ops that only move bytes
(Slice, Concat, Split, Transpose, Gather, ScatterND, ...) are marked `copy`: their share of kernel
time is what a state layout is judged by. Nodes under 30 us per step are counted with their share of
kernel time: mostly dispatch, what fewer and larger nodes would save. With --baseline both models are
also timed without the profiler, in alternating rounds, and the table gives the median time per step
and the ratio.

Prints the tables and writes `step_profile.json` (`python -m benchmarks record --add` records it) and
`step_profile.md` to --out.
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

from .provenance import command_line, run_meta, shown_path, write_run

# Ops whose kernels move or duplicate bytes without arithmetic.
COPY_OPS = frozenset({
    "Slice", "Concat", "Split", "Transpose", "Gather", "GatherElements", "GatherND", "Expand", "Tile",
    "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Pad", "ScatterND", "ScatterElements", "Cast",
})
DTYPES = {"int32": np.int32, "float32": np.float32, "float16": np.float16}
SHOWN_SHARE = 0.005  # ops below half a percent of kernel time are summed into "other"
# Nodes whose kernel runs shorter than this per step cost mostly their dispatch: their count and share
# of kernel time say what fewer, larger nodes would save (most at batch 1).
SMALL_NODE_US = 30


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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

    def kernel_us_by_node(self, runs: int) -> dict[str, tuple[str, float]]:
        """{node: (op type, microseconds)} summed over the last `runs` steps (the profile holds them all)."""
        events = json.loads(Path(self.session.end_profiling()).read_text())
        first = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")[-runs]
        by_node: dict[str, tuple[str, float]] = {}
        for event in events:
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= first:
                op, us = by_node.get(event["name"], (event["args"]["op_name"], 0.0))
                by_node[event["name"]] = (op, us + event["dur"])
        return by_node


def profile(folder: Path, batch: int, args) -> dict:
    """Kernel ms per step by op type (ops under SHOWN_SHARE summed as "other") and the copy share."""
    stepper = Stepper(folder, batch, 1, args.threads, profile=True)
    for _ in range(args.warmup):
        stepper.step()
    stepper.seconds_per_step(args.runs)
    by_node = stepper.kernel_us_by_node(args.runs)
    by_op: dict[str, float] = collections.Counter()
    for op, us in by_node.values():
        by_op[op] += us
    total = sum(by_op.values())
    small = [us for _, us in by_node.values() if us / args.runs < SMALL_NODE_US]
    ops, other = {}, 0.0
    for op, us in sorted(by_op.items(), key=lambda item: -item[1]):
        if us / total >= SHOWN_SHARE:
            ops[op] = round(us / 1000 / args.runs, 3)
        else:
            other += us / 1000 / args.runs
    return {"kv_cache_dtype": stepper.spec.kv_cache_dtype,
            "state_mib_per_stream": round(stepper.spec.state_bytes_per_stream() / 2**20, 3),
            "kernel_ms_per_step": round(total / 1000 / args.runs, 3),
            "copy_share": round(sum(us for op, us in by_op.items() if op in COPY_OPS) / total, 4),
            "nodes": len(by_node),
            "small_nodes": len(small),
            "small_nodes_share": round(sum(small) / total, 4),
            "ops_ms_per_step": {**ops, "other": round(other, 3)}}


def timing(folders: dict[str, Path], batch: int, args) -> dict[str, dict]:
    """Median ms per step of each export, timed in alternating rounds without the profiler."""
    steppers = {name: Stepper(folder, batch, 1, args.threads, profile=False) for name, folder in folders.items()}
    for stepper in steppers.values():
        for _ in range(args.warmup):
            stepper.step()
    rounds: dict[str, list[float]] = {name: [] for name in steppers}
    for index in range(args.rounds):
        _log(f"  batch {batch}: timing round {index + 1}/{args.rounds}")
        for name, stepper in steppers.items():
            rounds[name].append(stepper.seconds_per_step(args.runs) * 1000)
    return {name: {"ms_per_step": round(statistics.median(ms), 3), "ms_per_frame": round(statistics.median(ms) / batch, 3),
                   "frames_per_s": round(1000 * batch / statistics.median(ms), 2)}
            for name, ms in rounds.items()}


def step_profile_markdown(results: dict) -> str:
    """The timing and the op-type tables of every batch size of a run (the caller writes the stamp)."""
    lines = [f"One frame per call, {results['threads']} threads; exports: "
             + "; ".join(f"{name} `{path}`" for name, path in results["exports"].items()) + "."]
    for point in results["points"]:
        batch, times, profiles = point["batch"], point["timing"], point["profiles"]
        lines += ["", f"Batch {batch}:", ""]
        if times:
            base = times.get("baseline", {}).get("ms_per_step")
            lines += ["| export | ms / step | ms / frame | frames/s | x baseline |", "|---|---:|---:|---:|---:|"]
            for name, row in times.items():
                ratio = f"{base / row['ms_per_step']:.2f}" if base else ""
                lines.append(f"| {name} | {row['ms_per_step']:.2f} | {row['ms_per_frame']:.2f} | {row['frames_per_s']:.1f} | {ratio} |")
            lines.append("")
        names = list(profiles)
        lines += ["| kernel ms / step | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        ops = list(dict.fromkeys(op for name in names for op in profiles[name]["ops_ms_per_step"] if op != "other"))
        for op in [*sorted(ops, key=lambda o: -max(p["ops_ms_per_step"].get(o, 0) for p in profiles.values())), "other"]:
            mark = " (copy)" if op in COPY_OPS else ""
            lines.append(f"| {op}{mark} | " + " | ".join(
                f"{profiles[name]['ops_ms_per_step'].get(op, 0):.2f}" for name in names) + " |")
        lines.append("| **all kernels** | " + " | ".join(f"**{profiles[n]['kernel_ms_per_step']:.2f}**" for n in names) + " |")
        lines.append("| **copy ops, share** | " + " | ".join(f"**{profiles[n]['copy_share']:.1%}**" for n in names) + " |")
        lines.append(f"| nodes, of them under {SMALL_NODE_US} us (their share) | " + " | ".join(
            f"{profiles[n]['nodes']}, {profiles[n]['small_nodes']} ({profiles[n]['small_nodes_share']:.1%})"
            if "nodes" in profiles[n] else "" for n in names) + " |")
        lines.append("| state MiB / stream, KV cache | " + " | ".join(
            f"{profiles[n]['state_mib_per_stream']:.2f}, {profiles[n]['kv_cache_dtype']}" for n in names) + " |")
    return "\n".join(lines)


# How a record names the export a benchmark made for itself (in a temporary folder).
FRESH_EXPORT = "a fresh export (seeded random weights unless --weights)"


def export_fresh(weights: Path | None = None, kv_cache_dtype: str = "float32") -> Path:
    """Export the step now (`weights`, or seeded random ones) into a new temporary folder."""
    import warnings

    warnings.filterwarnings("ignore")
    from mimi_code2wav.export.onnx_export import ExportOptions, build_step, export_onnx, write_manifest
    from mimi_code2wav.export.weights import load_weights

    work = Path(tempfile.mkdtemp(prefix="mimi-export-"))
    loaded = load_weights(weights, seed=None if weights else 0)
    options = ExportOptions(kv_cache_dtype=kv_cache_dtype)
    _log("exporting the step ...")
    spec = export_onnx(build_step(loaded.model, options), work / "model.onnx", log=lambda *_: None)
    write_manifest(work, spec, options, loaded.source, loaded.kind, loaded.sha256)
    return work


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--export", type=Path, help="export folder to profile (default: export one now)")
    parser.add_argument("--baseline", type=Path, help="export folder to time and profile against")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=20, help="steps per profile and per timing round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timing rounds (with --baseline)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--kv-cache-dtype", default="float32", choices=("float32", "float16"),
                        help="of the export made without --export")
    parser.add_argument("--weights", type=Path, help="moshi-format .safetensors for the export made without --export")
    parser.add_argument("--out", type=Path, default=Path("bench_results") / "step-profile")


def run(args: argparse.Namespace) -> int:
    meta = run_meta("step-profile", command_line())
    fresh = None if args.export else export_fresh(args.weights, args.kv_cache_dtype)
    folders = {"export": args.export or fresh}
    if args.baseline:
        folders = {"baseline": args.baseline, **folders}
    points = []
    for batch in args.batches:
        point = {"batch": batch, "timing": timing(folders, batch, args) if args.baseline else None, "profiles": {}}
        for name, folder in folders.items():
            _log(f"  batch {batch}: profiling {name} ({args.runs} steps)")
            point["profiles"][name] = profile(folder, batch, args)
        points.append(point)
    results = {"meta": meta, "threads": args.threads, "exports": {name: shown_path(path) if path is not fresh else FRESH_EXPORT for name, path in folders.items()},
               "points": points}
    write_run(args.out, "step_profile", results, step_profile_markdown(results))
    return 0

