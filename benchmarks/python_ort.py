"""`python -m benchmarks python-ort`: what each of the python-ort decoder's state mechanisms buys.

    python -m benchmarks python-ort [--export EXPORT_DIR] [--streams 8] [--steps 20] [--rounds 5]
                                    [--out bench_results/python-ort]

The python-ort `mimi_decoder` (model_repository/mimi_decoder/python_ort/) keeps its streams' state
itself. Its core runs here without Triton, on the export's real ONNX step in ONNX Runtime, as the
model builds it (the config `render` writes, glibc's mmap threshold pinned), and once more with one
mechanism taken out at a time:

    as served          every mechanism
    no array reuse     free state arrays are not kept (`StateBuffers` holding nothing): every run's
                       output states and gathered inputs are fresh arrays, faulted in page by page
    no feed-back       a run of exactly the streams of the previous run gathers their state into a
                       new batch (`reuse_order` off) instead of feeding the previous outputs back
    no IO binding      `session.run`: ONNX Runtime allocates the output states in its arena
    plain              `session.run` and no array reuse: the simplest stand-in, for reference

Two workloads of --streams streams, one frame per step: `together`, every stream steps in every run
(a duplex tick), and `churn`, each run a different three quarters of the streams (seeded), so the
previous outputs can never be fed back as they are. The variants run in alternating rounds; the table
gives the median ms per run of each and its ratio to `as served`.

Memory, each variant in a fresh process, through the lifecycle of abandoned streams: its resident
size (RSS) once the session is loaded, after --steps churning runs, and after the instance went idle
with the streams still live (`release_idle_memory`, as the model's sweeper calls it a second after
the last run) and they then expired (`expire_idle`): what an idle server keeps.

Writes python_ort.json and python_ort.md to --out (`python -m benchmarks record --add` records the JSON).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .provenance import REPO_ROOT, command_line, run_meta, shown_path, write_run
from .step_profile import FRESH_EXPORT

MODEL_DIRS = (REPO_ROOT / "model_repository" / "mimi_decoder" / "python_ort", REPO_ROOT / "model_repository" / "common")
VARIANTS = ("as served", "no array reuse", "no feed-back", "no IO binding", "plain")  # "plain": both off
WORKLOADS = ("together", "churn")
TRITON_TYPES = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _modules():
    """The python-ort model's core modules, imported as the model imports them (siblings on the path)."""
    for folder in MODEL_DIRS:
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    import python_ort_config
    import python_ort_core
    import python_ort_memory

    return python_ort_config, python_ort_core, python_ort_memory


def served_config(export: Path, streams: int):
    """The DecoderConfig the python-ort model reads from the config `render` writes for this export,
    with `streams` as its stream cap."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from mimi_code2wav.export.onnx_export import read_manifest
    from mimi_code2wav.export.render import render_config
    from mimi_code2wav.export.spec import DecoderSpec

    config_module, _, _ = _modules()
    manifest = read_manifest(export)
    if manifest is None:
        raise SystemExit(f"{export}: no export (model.onnx + manifest.json) there")
    text = render_config(DecoderSpec.from_dict(manifest["spec"]), "python-ort")
    config = json_format.MessageToDict(text_format.Parse(text, model_config_pb2.ModelConfig()),
                                       preserving_proto_field_name=True)
    config["parameters"]["max_live_streams"] = {"string_value": str(streams)}
    return config_module.parse_model_config(config, TRITON_TYPES.__getitem__)


class Bench:
    """One ONNX Runtime session over the export, and a core built on it per variant."""

    def __init__(self, export: Path, streams: int, threads: int):
        import onnxruntime as ort

        self.config_module, self.core_module, self.memory = _modules()
        self.memory.fix_mmap_threshold()
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(export / "model.onnx"), options, providers=["CPUExecutionProvider"])
        self.release_options = self.memory.arena_release_options()
        config = served_config(export, streams)
        self.config = self.config_module.check_against_onnx(config, self.session.get_inputs(), self.session.get_outputs())
        self.streams = streams
        codes = self.config.inputs[0]
        rng = np.random.default_rng(0)
        low, high = self.config.value_ranges[codes.name]
        self.codes = [rng.integers(low, high, (1, codes.dims[0], 1)).astype(codes.dtype) for _ in range(16)]

    def core(self, variant: str):
        memory, config = self.memory, self.config
        limit = 0 if variant in ("no array reuse", "plain") else memory.state_buffer_limit(config)
        buffers = memory.StateBuffers(limit)
        if variant in ("no IO binding", "plain"):
            run = lambda feeds, options=None: self.session.run(config.output_names, feeds, options)  # noqa: E731
            release = lambda feeds: run(feeds, self.release_options)  # noqa: E731
        else:
            run = memory.BoundRunner(self.session, config, self.release_options, allocate=buffers.take)
            release = run.release
        return self.core_module.StreamingDecoderCore(config, run, buffers=buffers, release=release)

    @contextmanager
    def variant(self, name: str):
        """The core of `name`; with "no feed-back", the core's `reuse_order` finds nothing to reuse."""
        saved = self.core_module.reuse_order
        if name == "no feed-back":
            self.core_module.reuse_order = lambda previous: None
        try:
            yield self.core(name)
        finally:
            self.core_module.reuse_order = saved

    def ms_per_run(self, variant: str, workload: str, steps: int, warmup: int, keep: bool = False) -> float:
        """Median ms of `steps` runs after `warmup`; with `keep`, the core stays in `self.kept`."""
        rng = np.random.default_rng(1)
        name = self.config.inputs[0].name
        with self.variant(variant) as core:
            ids = list(range(1, self.streams + 1))
            core.step([self.core_module.StepRequest(sid, True, False, {name: self.codes[0]}) for sid in ids])
            times = []
            for step in range(warmup + steps):
                members = ids if workload == "together" else sorted(rng.choice(ids, 3 * len(ids) // 4, replace=False))
                requests = [self.core_module.StepRequest(int(sid), False, False, {name: self.codes[step % 16]})
                            for sid in members]
                started = time.perf_counter()
                results = core.step(requests)
                times.append(time.perf_counter() - started)
                failed = [r for r in results if not isinstance(r, dict)]
                if failed:
                    raise SystemExit(f"{variant}: {failed[0]}")
            if keep:
                self.kept = core
        return 1e3 * statistics.median(times[warmup:])


def _rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def memory_of(export: Path, streams: int, threads: int, variant: str, steps: int) -> dict[str, float]:
    """RSS (MiB) of a fresh process running `variant`: loaded, after `steps` churning runs of
    `streams` streams, and once the idle instance let its memory go and the streams expired."""
    bench = Bench(export, streams, threads)
    loaded = _rss_mib()
    bench.ms_per_run(variant, "churn", steps, 0, keep=True)
    busy = _rss_mib()
    core = bench.kept
    core.release_idle_memory(idle_s=0.0)
    core.expire_idle(now=time.monotonic() + core.config.idle_timeout_s + 1)
    core.release_idle_memory(idle_s=0.0)  # once per idle period: a no-op unless the variant ran since
    return {"loaded": loaded, "busy": busy, "idle": _rss_mib()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--export", type=Path, help="export folder (model.onnx + manifest.json; default: export one now)")
    parser.add_argument("--streams", type=int, default=8, help="streams (the model's max_rows_per_run is 8)")
    parser.add_argument("--steps", type=int, default=20, help="measured runs per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    parser.add_argument("--out", type=Path, default=Path("bench_results") / "python-ort")


def python_ort_markdown(results: dict) -> str:
    lines = [f"{results['streams']} streams, one frame per step, {results['rounds']} alternating rounds of "
             f"{results['steps']} runs; median ms per run (x as served: its time over the served one's).", "",
             "| variant | " + " | ".join(f"{w} ms | x as served" for w in WORKLOADS) + " |",
             "|---|" + "---:|---:|" * len(WORKLOADS)]
    for variant in VARIANTS:
        cells = []
        for workload in WORKLOADS:
            ms, base = results["ms_per_run"][workload][variant], results["ms_per_run"][workload]["as served"]
            cells += [f"{ms:.1f}", f"{ms / base:.2f}"]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += ["", f"Resident memory of a fresh process per variant (MiB): loaded, after {results['steps']} churning runs "
              f"of {results['streams']} streams, and once the idle instance let its memory go and the streams expired.", "",
              "| variant | loaded | busy | idle | idle - loaded |", "|---|---:|---:|---:|---:|"]
    for variant in VARIANTS:
        rss = results["rss_mib"][variant]
        lines.append(f"| {variant} | {rss['loaded']:.0f} | {rss['busy']:.0f} | {rss['idle']:.0f} | "
                     f"{rss['idle'] - rss['loaded']:.0f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    meta = run_meta("python-ort", command_line())
    export = args.export
    if export is None:
        from .step_profile import export_fresh

        export = export_fresh()
    bench = Bench(export, args.streams, args.threads)
    rounds: dict[str, dict[str, list[float]]] = {w: {v: [] for v in VARIANTS} for w in WORKLOADS}
    for index in range(args.rounds):
        for workload in WORKLOADS:
            for variant in VARIANTS:
                rounds[workload][variant].append(bench.ms_per_run(variant, workload, args.steps, args.warmup))
        _log(f"round {index + 1}/{args.rounds}: " + "; ".join(
            f"{w} " + ", ".join(f"{v} {rounds[w][v][-1]:.1f}" for v in VARIANTS) for w in WORKLOADS))
    rss = {}
    spawn = multiprocessing.get_context("spawn")
    for variant in VARIANTS:
        with spawn.Pool(1) as pool:
            rss[variant] = pool.apply(memory_of, (export, args.streams, args.threads, variant, args.steps))
        _log(f"memory, {variant}: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in rss[variant].items()))
    results = {"meta": meta, "export": shown_path(export) if args.export else FRESH_EXPORT, "streams": args.streams, "steps": args.steps, "rounds": args.rounds,
               "ms_per_run": {w: {v: statistics.median(times) for v, times in by.items()} for w, by in rounds.items()},
               "rss_mib": rss}
    write_run(args.out, "python_ort", results, python_ort_markdown(results))
    return 0
