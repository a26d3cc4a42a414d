"""The step module on a CUDA GPU (PyTorch with CUDA; no TensorRT or onnxruntime-gpu), eager and as a CUDA
graph replaying a whole step with its state feedback, which is what a TensorRT engine under Triton
approaches: no launch overhead. Seeded random weights in the real architecture. Writes OUT/gpu.json
and gpu.md; exits 3 without CUDA."""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

from mimi_code2wav.client.protocol import FRAMES_PER_SECOND

from .provenance import add_options, log, md_row, run_meta, write_run

EXIT_NO_CUDA = 3


def _time_cuda(run, seconds: float, warmup: int = 3) -> float:
    """Mean seconds per call of `run()`, the GPU synchronised every 10 calls."""
    import torch

    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    calls, started = 0, time.perf_counter()
    while calls < 10 or time.perf_counter() - started < seconds:
        run()
        calls += 1
        if calls % 10 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls


def measure(step, batch: int, frames: int, seconds: float, device) -> dict[str, float]:
    """Seconds per call, eager and as a CUDA graph (outputs copied into static state inputs), of one shape."""
    import torch

    codes = torch.randint(0, step.codebook_size, (batch, step.num_codebooks, frames), dtype=torch.int32, device=device)
    state = [s.to(device) for s in step.zero_state(batch)]

    def eager():
        nonlocal state
        with torch.no_grad():
            _, *state = step(codes, *state)

    def step_in_place():
        for target, value in zip(state, step(codes, *state)[1:]):
            target.copy_(value)

    result = {"eager_s": _time_cuda(eager, seconds)}
    state = [s.to(device) for s in step.zero_state(batch)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):  # warm up on a side stream before capture, as CUDA graphs require
            step_in_place()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        step_in_place()
    return {**result, "cuda_graph_s": _time_cuda(graph.replay, seconds)}


def gpu_markdown(results: dict) -> str:
    """The table of a run (the caller writes the stamp)."""
    lines = [f"GPU: {results['gpu']}; PyTorch {results['torch']}; KV cache {results['kv_cache_dtype']}; "
             "fp32 weights (no TF32).",
             "", "| mode | batch | frames/call | ms/call | ms/frame | frames/s | streams at real time |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [md_row(r["mode"], r["batch"], r["frames_per_call"], f"{r['ms_per_call']:.2f}", f"{r['ms_per_frame']:.3f}",
                     f"{r['frames_per_s']:.0f}", f"{r['streams_at_real_time']:.0f}") for r in results["rows"]]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-dtype", choices=("float32", "float16"), default="float32")
    add_options(parser, ("--batches", [1, 8, 64, 256], "batch sizes"), ("--frames-per-call", [1, 2], "frames per call"),
                ("--seconds", 3.0, "measuring time per configuration"), ("--out", Path("bench_results"), "where results go"))


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device (or PyTorch without CUDA): this benchmark needs a GPU", file=sys.stderr)
        return EXIT_NO_CUDA
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32, as the parity tests check
    from mimi_code2wav.export.step import MimiDecoderStep
    from mimi_code2wav.export.weights import random_model

    device = torch.device("cuda")
    step = MimiDecoderStep(random_model(0).model, max_frames_per_step=max(args.frames_per_call),
                           kv_cache_dtype=args.kv_cache_dtype).eval().to(device)
    rows = []
    for frames, batch in itertools.product(args.frames_per_call, args.batches):
        for mode, seconds in measure(step, batch, frames, args.seconds, device).items():
            ms = seconds * 1000 / (batch * frames)
            rows.append({"mode": mode[:-2], "batch": batch, "frames_per_call": frames, "ms_per_call": seconds * 1000,
                         "ms_per_frame": ms, "frames_per_s": 1000 / ms, "streams_at_real_time": 1000 / ms / FRAMES_PER_SECOND})
            log(f"  {mode[:-2]:10s} batch {batch:3d} F {frames}: {seconds * 1000:8.2f} ms/call")
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(0)
    results = {"meta": run_meta("gpu", gpu=name), "gpu": name, "torch": torch.__version__,
               "kv_cache_dtype": args.kv_cache_dtype, "rows": rows}
    write_run(args.out, "gpu", results, gpu_markdown(results))
    return 0
