"""Parity of the streaming decoder step in layers (moshi streaming vs offline, step module vs moshi for every
call size, exact window vs offline, ONNX Runtime vs step module, fp32 vs float64 at long positions), and
the exported graph's structure (opset, IR version, dynamic batch and frames only, TensorRT-parsable ops)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS, SAMPLES_PER_FRAME

from helpers import REPO_ROOT, export_spec
from mimi_fixtures import (
    CALLS,
    MAX_FRAMES_PER_CALL,
    MIXED_CALLS,
    assert_equal_audio,
    call_sizes,
    make_scenario,
    ort_stepper,
    run_scenario,
    snr_db,
    stream_audio,
    tiny_config,
    torch_stepper,
)

torch = pytest.importorskip("torch", reason="the export extra (torch) is needed for export tests")

STREAMS = ("A", "B", "C1", "C2")


@pytest.fixture(scope="session")
def step_pcm(mimi, scenario):
    """Scenario PCM of the step module, per call schedule (see run_scenario), computed once."""
    from mimi_code2wav.export.step import MimiDecoderStep

    @functools.cache
    def stepper(window: str):
        return torch_stepper(MimiDecoderStep(mimi.model, max_frames_per_step=MAX_FRAMES_PER_CALL, window=window).eval())

    @functools.cache
    def get(schedule: int | tuple[int, ...], window: str = "moshi"):
        return run_scenario(stepper(window), scenario, schedule)

    return get


def test_moshi_streaming_reference_matches_offline_until_window_fills(moshi_checkpoint, moshi_streams, scenario):
    model = moshi_checkpoint[1]
    with torch.no_grad():
        offline = model.decode(torch.from_numpy(scenario.streams["A"])[None].long())[0, 0].numpy()
    streaming = moshi_streams["A"]
    assert streaming.shape == offline.shape == (CALLS * SAMPLES_PER_FRAME,)
    # Until 125 frames (250 steps) both see every past step: equal.
    assert_equal_audio(streaming[: 120 * SAMPLES_PER_FRAME], offline[: 120 * SAMPLES_PER_FRAME], what="moshi streaming vs offline, frames < 120")
    # Then moshi's ring gives the first step of each frame one key less: close, but not equal.
    late = snr_db(streaming[130 * SAMPLES_PER_FRAME :], offline[130 * SAMPLES_PER_FRAME :])
    assert 45 < late < 90, f"window semantics difference expected ~60-67 dB, got {late:.1f} dB"


def test_test_weights_are_not_degenerate(moshi_streams):
    a, b = moshi_streams["A"], moshi_streams["B"]
    assert a.std() > 0.05 and b.std() > 0.05, (a.std(), b.std())
    # Different codes give different audio (far from equal); every frame carries signal (no silent
    # stretch that parity could pass on).
    n = min(len(a), len(b))
    assert snr_db(a[:n], b[:n]) < 10
    assert a.reshape(-1, SAMPLES_PER_FRAME).std(axis=1).min() > 0.01


SCHEDULES = [pytest.param(1, id="F1"), pytest.param(2, id="F2"), pytest.param(4, id="F4"),
             pytest.param(16, id="F16"), pytest.param(MIXED_CALLS, id="mixed")]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_step_equals_moshi_streaming(step_pcm, moshi_streams, scenario, schedule):
    pcm = step_pcm(schedule)
    for name in STREAMS:
        assert_equal_audio(stream_audio(pcm, scenario, name), moshi_streams[name], what=f"F={schedule} stream {name}")


@pytest.mark.parametrize("schedule", SCHEDULES[1:])
def test_frames_per_call_do_not_change_audio(step_pcm, scenario, schedule):
    """One state for every call size (to fp32 round-off: some CPUs' kernels sum F frames a hair past 1e-5)."""
    sizes = call_sizes(schedule, scenario)
    assert sum(sizes) == CALLS and (schedule != MIXED_CALLS or set(range(1, MAX_FRAMES_PER_CALL + 1)) <= set(sizes))
    np.testing.assert_allclose(step_pcm(schedule), step_pcm(1), atol=2e-5, rtol=0)


def test_exact_window_equals_transformers_offline_decode(mimi, scenario, step_pcm):
    pcm = step_pcm(1, "exact")
    with torch.no_grad():
        offline = mimi.model.decode(torch.from_numpy(scenario.streams["A"])[None].long()).audio_values[0, 0].numpy()
    assert_equal_audio(stream_audio(pcm, scenario, "A"), offline, what="exact window vs MimiModel.decode")
    # And the two windows really differ once the window is full.
    moshi_window = stream_audio(step_pcm(1), scenario, "A")
    assert snr_db(moshi_window[130 * SAMPLES_PER_FRAME :], offline[130 * SAMPLES_PER_FRAME :]) < 90


# fp16 keys/values against moshi's fp32 streaming decode: bounds with a margin for other CPUs' kernels.
@pytest.mark.parametrize("kv_cache_dtype, schedule, max_abs, min_snr_db", [
    pytest.param("float32", 1, 1e-4, 100.0, id="fp32-F1"),
    pytest.param("float32", MIXED_CALLS, 1e-4, 100.0, id="fp32-mixed"),
    pytest.param("float16", 1, 5e-4, 90.0, id="fp16-F1"),
])
def test_onnx_runtime_equals_step_module_and_moshi(request, scenario, step_pcm, moshi_streams, kv_cache_dtype, schedule,
                                                   max_abs, min_snr_db):
    """One graph for every F; the fp32 KV cache equals the step module, fp16 stays within its measured bound."""
    folder = request.getfixturevalue("onnx_fp32" if kv_cache_dtype == "float32" else "onnx_fp16")
    spec = export_spec(folder)
    assert spec.max_frames_per_step == MAX_FRAMES_PER_CALL
    assert spec.kv_cache_dtype == spec.states[0].dtype == kv_cache_dtype
    pcm = run_scenario(ort_stepper(folder), scenario, schedule)
    for name in STREAMS:
        if kv_cache_dtype == "float32":
            assert_equal_audio(stream_audio(pcm, scenario, name), stream_audio(step_pcm(1), scenario, name),
                               what=f"ORT F={schedule} vs step F=1, stream {name}")
        assert_equal_audio(stream_audio(pcm, scenario, name), moshi_streams[name], max_abs, min_snr_db,
                           what=f"ORT {kv_cache_dtype} KV F={schedule} vs moshi, stream {name}")


def test_long_stream_position_matches_float64(mimi):
    """At ~100,000 transformer steps (over an hour of audio), fp32 RoPE stays close to float64."""
    import copy

    from mimi_code2wav.export.step import MimiDecoderStep

    start = 100_000
    step32 = MimiDecoderStep(mimi.model, window="moshi").eval()
    step64 = MimiDecoderStep(copy.deepcopy(mimi.model).double(), window="moshi", dtype=torch.float64).eval()
    rng = np.random.default_rng(11)
    codes = torch.from_numpy(rng.integers(0, CODEBOOK_SIZE, (1, NUM_CODEBOOKS, 24)).astype(np.int32))
    out = {}
    for name, step in (("fp32", step32), ("fp64", step64)):
        state = list(step.zero_state(1))
        state[-1] += start  # position
        chunks = []
        with torch.no_grad():
            for frame in range(codes.shape[2]):
                pcm, *state = step(codes[:, :, frame : frame + 1], *state)
                chunks.append(pcm.double().numpy())
        assert int(state[-1]) == start + 2 * codes.shape[2]
        out[name] = np.concatenate(chunks, axis=1)[0]
    assert_equal_audio(out["fp32"], out["fp64"], what="fp32 vs float64 at position 100,000")


# ---- tiny config: the rest of the option matrix ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny_mimi():
    from mimi_code2wav.export.weights import random_model

    return random_model(7, tiny_config()).model


@pytest.mark.parametrize("window", ["moshi", "exact"])
def test_tiny_onnx_matches_step(tiny_mimi, tmp_path, window):
    """The tiny config's window (20 steps) holds at most 9 frames per call: F = 1, 2, 4, 9 and mixed; and
    reference.step_reference is the step module, one frame per call."""
    from mimi_code2wav.export.onnx_export import export_onnx
    from mimi_code2wav.export.reference import step_reference
    from mimi_code2wav.export.step import MimiDecoderStep

    step = MimiDecoderStep(tiny_mimi, max_frames_per_step=9, window=window).eval()
    export_onnx(step, tmp_path / "model.onnx", log=lambda *_: None)
    scenario, spf = make_scenario(codebook_size=64), step.samples_per_frame
    stepper = ort_stepper(tmp_path)
    reference = run_scenario(torch_stepper(step), scenario, 1)
    assert reference.std() > 0.05
    assert_equal_audio(step_reference(tiny_mimi, scenario.streams["A"][None], window)[0],
                       stream_audio(reference, scenario, "A", spf), what=f"tiny {window} step_reference")
    for schedule in (1, 2, 4, 9, (1, 3, 9, 2, 5)):
        pcm = run_scenario(stepper, scenario, schedule)
        assert pcm.shape == (3, CALLS * spf)
        for name in STREAMS:
            assert_equal_audio(stream_audio(pcm, scenario, name, spf), stream_audio(reference, scenario, name, spf),
                               what=f"tiny {window} F={schedule} stream {name}")


def test_max_frames_per_step_must_fit_the_cache(tiny_mimi):
    from mimi_code2wav.export.step import MimiDecoderStep

    with pytest.raises(ValueError, match=r"max_frames_per_step must be in \[1, 9\], got 10"):
        MimiDecoderStep(tiny_mimi, max_frames_per_step=10)


# ---- graph structure ------------------------------------------------------------------------------

def _graph(folder: Path):
    import onnx

    return onnx.load(str(folder / "model.onnx"), load_external_data=False)


def test_graph_fits_the_ngc_runtime_and_is_static_apart_from_batch_and_frames(onnx_fp32):
    from mimi_code2wav.export.onnx_export import FORBIDDEN_OPS, MAX_IR_VERSION

    model = _graph(onnx_fp32)
    opsets = {o.domain: o.version for o in model.opset_import}
    assert 17 <= opsets.get("", opsets.get("ai.onnx", 0)) <= 20
    assert model.ir_version <= MAX_IR_VERSION == 10
    ops = {node.op_type for node in model.graph.node}
    assert not ops & set(FORBIDDEN_OPS), ops & set(FORBIDDEN_OPS)
    symbolic = {"codes": {0: "batch", 2: "frames"}, "pcm": {0: "batch", 1: "samples"}}
    for value in (*model.graph.input, *model.graph.output):
        dims = [dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim]
        # The batch (and the frames of codes, the samples of pcm) symbolic, every other dim static.
        assert {i: d for i, d in enumerate(dims) if isinstance(d, str)} == symbolic.get(value.name, {0: "batch"}), dims
        assert all(d > 0 for d in dims if isinstance(d, int)), (value.name, dims)


def test_every_op_is_supported_by_tensorrt_onnx_parser(onnx_fp32, onnx_fp16):
    listed = Path(__file__).parent.parent / "export" / "tensorrt_onnx_ops.txt"
    supported = {line.strip() for line in listed.read_text().splitlines() if line.strip() and not line.startswith("#")}
    assert {"MatMul", "Conv", "ConvTranspose", "LayerNormalization"} <= supported
    for folder in (onnx_fp32, onnx_fp16):
        ops = {node.op_type for node in _graph(folder).graph.node}
        assert ops <= supported, f"not parsable by TensorRT: {sorted(ops - supported)}"


def test_tensorrt_profile_covers_every_input(onnx_fp32):
    from mimi_code2wav.export.tensorrt_build import profile_shapes, trtexec_command

    spec = export_spec(onnx_fp32)
    inputs = {i.name for i in _graph(onnx_fp32).graph.input}
    shapes = profile_shapes(spec, max_batch=64)
    assert set(shapes) == inputs
    assert shapes["codes"] == {"min": [1, 8, 1], "opt": [16, 8, 1], "max": [64, 8, MAX_FRAMES_PER_CALL]}
    for name, dims in shapes.items():
        assert dims["min"][0] == 1 and dims["max"][0] == 64
        if name != "codes":
            assert dims["min"][1:] == dims["max"][1:], name
    command = " ".join(trtexec_command("trtexec", onnx_fp32 / "model.onnx", Path("x.plan"), spec, 64, fp16=True))
    assert "Cos" in command and ":fp32" in command  # RoPE angles pinned to fp32 in fp16 builds


def test_tensorrt_build_without_tensorrt_exits_clearly(onnx_fp32, capsys, monkeypatch):
    from mimi_code2wav.export import tensorrt_build

    monkeypatch.setenv("PATH", "/nonexistent")
    code = tensorrt_build.main(["--export-dir", str(onnx_fp32)])
    assert code == tensorrt_build.EXIT_NO_TENSORRT
    assert "TensorRT is not available here" in capsys.readouterr().err


def test_export_is_skipped_when_manifest_matches_and_redone_when_options_change(mimi, onnx_fp32, capsys):
    from mimi_code2wav.export.onnx_export import ExportOptions, stale_reason
    from mimi_code2wav.export.pipeline import build

    before = (onnx_fp32 / "model.onnx").stat().st_mtime_ns
    build(ExportOptions(), mimi, onnx_fp32)
    assert "up to date" in capsys.readouterr().err
    assert (onnx_fp32 / "model.onnx").stat().st_mtime_ns == before
    assert "options changed" in stale_reason(onnx_fp32, ExportOptions(kv_cache_dtype="float16"), mimi.sha256)
    assert stale_reason(onnx_fp32, ExportOptions(), "0" * 64) == "the weights changed"


def test_gpu_benchmark_without_cuda_exits_clearly(capsys):
    from benchmarks import gpu as bench_gpu

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark would run")
    from benchmarks.__main__ import main as benchmarks_main

    assert benchmarks_main(["gpu", "--batches", "1"]) == bench_gpu.EXIT_NO_CUDA
    assert "no CUDA device" in capsys.readouterr().err


def test_render_works_from_a_plain_install_outside_the_checkout(onnx_fp32, tmp_path):
    """`pip install .` (not editable) ships the model sources as package data: `render` run outside the
    checkout writes the same model files as the checkout's."""
    wheels, site, out = tmp_path / "wheels", tmp_path / "site", tmp_path / "repo"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels),
                    str(REPO_ROOT)], check=True, timeout=600)
    (wheel,) = wheels.glob("mimi_code2wav-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import mimi_code2wav.export.render as r; print(r.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(site), where
    subprocess.run([sys.executable, "-m", "mimi_code2wav.export", "render", "--target", "python-ort",
                    "--export-dir", str(onnx_fp32), "--out", str(out)], cwd=tmp_path, env=env, check=True, timeout=600)
    sources = REPO_ROOT / "model_repository"
    copies = {"code2wav/1/model.py": "code2wav/1/model.py", "code2wav/1/model_errors.py": "common/model_errors.py",
              "mimi_decoder/1/model.py": "mimi_decoder/python_ort/model.py",
              "mimi_decoder/1/python_ort_core.py": "mimi_decoder/python_ort/python_ort_core.py"}
    for rendered, source in copies.items():
        assert (out / rendered).read_bytes() == (sources / source).read_bytes(), rendered
