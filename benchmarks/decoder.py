"""Decoder speed on this CPU: moshi's streaming decoder, the step module (eager PyTorch), ONNX Runtime
(as the native config serves it, without memory patterns) and rustymimi, against the measured fp32
matmul peak. Times are per stream-frame (80 ms of audio); `of compute bound` = FLOPs per frame / the
peak at that thread count / the time. Without --weights, a seeded random moshi-format checkpoint
(speed does not depend on the values). Writes OUT/decoder.json and decoder.md."""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

import numpy as np

from mimi_code2wav.client.protocol import FRAME_DURATION_S

from .provenance import add_options, log, md_row, run_meta, timed, write_run

ORT_DTYPES = {"tensor(int32)": np.int32, "tensor(int64)": np.int64, "tensor(float16)": np.float16, "tensor(float)": np.float32}


def ort_step_s(session, batch: int, frames: int, seconds: float, rng) -> float:
    """Seconds per call of an ONNX Runtime session of the step, `batch` x `frames` codes, its state fed back."""
    inputs = session.get_inputs()
    feeds = {arg.name: np.zeros([batch, *arg.shape[1:]], ORT_DTYPES[arg.type]) for arg in inputs[1:]}
    feeds[inputs[0].name] = rng.integers(0, 2048, (batch, 8, frames)).astype(np.int32)
    return timed(lambda: feeds.update(zip([arg.name for arg in inputs[1:]], session.run(None, feeds)[1:])), seconds)


def decoder_markdown(results: dict) -> str:
    """The peak, the table and the ratios of a run (the caller writes the stamp)."""
    peaks = {int(threads): gflops for threads, gflops in results["matmul_peak_gflops"].items()}  # JSON keys are strings
    lines = [
        "fp32 matmul peak: " + ", ".join(f"{g:.1f} GFLOP/s ({k} thread{'s' if k > 1 else ''})" for k, g in peaks.items())
        + f"; decoder {results['gflop_per_frame']:.3f} GFLOP/frame.",
        "",
        "| engine | batch | frames/call | threads | ms/frame | frames/s | x realtime | of compute bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [md_row(r["engine"], r["batch"], r["frames_per_call"], r["threads"], f"{r['ms_per_frame']:.2f}",
                     f"{r['frames_per_s']:.1f}", f"{r['x_realtime']:.1f}", f"{r['fraction_of_bound']:.0%}")
              for r in results["rows"]]
    return "\n".join([*lines, "", *(f"- {name}: {value:.2f}x" for name, value in results["ratios"].items())])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", type=Path, help="moshi-format .safetensors (default: seeded random)")
    add_options(parser, ("--seconds", 2.0, "measuring time per configuration"), ("--batches", [1, 8], "batch sizes"),
                ("--frames-per-call", [1, 2], "frames per call"), ("--threads", [1, 2], "thread counts"),
                ("--out", Path("bench_results"), "where results go"))


def run(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    import onnxruntime as ort
    import torch
    from moshi.models.loaders import get_mimi
    from safetensors.torch import save_file
    from torch.utils.flop_counter import FlopCounterMode

    from mimi_code2wav.export.onnx_export import ExportOptions, build_step, export_onnx
    from mimi_code2wav.export.weights import load_weights, randomize_, to_shipped_moshi_names

    meta = run_meta("decoder")
    work = Path(tempfile.mkdtemp(prefix="mimi-bench-"))
    weights = args.weights
    if weights is None:  # a seeded random moshi-format checkpoint
        model = get_mimi(None, device="cpu")
        randomize_(model, 0)
        weights = work / "mimi-random.safetensors"
        save_file(to_shipped_moshi_names({k: v.contiguous() for k, v in model.state_dict().items()}), str(weights))
    loaded = load_weights(weights)
    rng = np.random.default_rng(0)
    peaks = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        peaks[threads] = 2 * 1024**3 / timed(lambda: torch.mm(a, b), args.seconds) / 1e9
    log("fp32 matmul peak (1024^3 torch.mm): " + ", ".join(f"{t} thread(s) {g:.1f} GFLOP/s" for t, g in peaks.items()))
    step = build_step(loaded.model, ExportOptions())
    with torch.no_grad(), FlopCounterMode(display=False) as counter:  # multiply-adds x 2, as torch counts them
        step(torch.zeros(1, step.num_codebooks, 1, dtype=torch.int32), *step.zero_state(1))
    flops = float(counter.get_total_flops())
    log(f"decoder: {flops / 1e9:.3f} GFLOP per frame")
    rows = {}  # by (engine, batch, frames per call, threads), each against the compute bound

    def add(engine: str, batch: int, frames: int, threads: int, seconds_per_call: float) -> None:
        ms = seconds_per_call * 1000 / (batch * frames)
        rows[engine, batch, frames, threads] = {
            "engine": engine, "batch": batch, "frames_per_call": frames, "threads": threads, "ms_per_frame": ms,
            "frames_per_s": 1000 / ms, "x_realtime": FRAME_DURATION_S * 1000 / ms,
            "fraction_of_bound": flops / (peaks[threads] * 1e6) / ms}
        log(f"  {engine:10s} batch {batch:2d} F {frames} threads {threads}: {ms:7.2f} ms/frame")

    moshi = get_mimi(str(weights), device="cpu", num_codebooks=8)  # moshi's streaming, what Moshi-family servers run
    for threads, batch in itertools.product(args.threads, args.batches):
        torch.set_num_threads(threads)
        codes = torch.from_numpy(rng.integers(0, 2048, (batch, 8, 1)))
        with torch.no_grad(), moshi.streaming(batch):
            add("moshi", batch, 1, threads, timed(lambda: moshi.decode(codes), args.seconds))
    # The step module in eager PyTorch and in ONNX Runtime.
    step = build_step(loaded.model, ExportOptions(max_frames_per_step=max(args.frames_per_call)))
    export_onnx(step, work / "model.onnx", log=lambda *_: None)
    for frames, threads in itertools.product(args.frames_per_call, args.threads):
        torch.set_num_threads(threads)
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads, options.enable_mem_pattern = threads, 1, False
        session = ort.InferenceSession(str(work / "model.onnx"), options, providers=["CPUExecutionProvider"])
        for batch in args.batches:
            codes = torch.from_numpy(rng.integers(0, 2048, (batch, 8, frames)).astype(np.int32))
            state = list(step.zero_state(batch))

            def eager():
                nonlocal state
                with torch.no_grad():
                    _, *state = step(codes, *state)

            add("step-eager", batch, frames, threads, timed(eager, args.seconds))
            add("onnxruntime", batch, frames, threads, ort_step_s(session, batch, frames, args.seconds, rng))
    try:  # rustymimi (Kyutai's Rust Mimi), batch 1, one frame per call; it picks its own threads
        import rustymimi
    except ImportError as error:
        log(f"rustymimi not installed ({error}); skipped")
    else:
        tokenizer, codes = rustymimi.Tokenizer(str(weights), num_codebooks=8), rng.integers(0, 2048, (1, 8, 1)).astype(np.uint32)
        add("rustymimi", 1, 1, max(args.threads), timed(lambda: tokenizer.decode_step(codes), args.seconds))
    ratios, threads = {}, max(args.threads)
    ort1, moshi1, rusty = (rows.get((engine, 1, 1, threads)) for engine in ("onnxruntime", "moshi", "rustymimi"))
    if ort1 and moshi1:
        ratios[f"moshi / onnxruntime, batch 1, {threads} threads"] = moshi1["ms_per_frame"] / ort1["ms_per_frame"]
    if ort1 and rusty:
        ratios["rustymimi / onnxruntime, batch 1"] = rusty["ms_per_frame"] / ort1["ms_per_frame"]
    best = min((r for r in rows.values() if r["engine"] == "onnxruntime" and r["batch"] == max(args.batches)),
               key=lambda r: r["ms_per_frame"], default=None)
    if best:
        ratios[f"onnxruntime batch {best['batch']} (F={best['frames_per_call']}, {best['threads']} threads) "
               "measured / compute bound"] = 1 / best["fraction_of_bound"]
    results = {"meta": meta, "matmul_peak_gflops": peaks, "gflop_per_frame": flops / 1e9, "rows": list(rows.values()),
               "ratios": ratios}
    write_run(args.out, "decoder", results, decoder_markdown(results))
    return 0
