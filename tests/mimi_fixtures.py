"""Shared, session-scoped Mimi fixtures, built once per run: the real architecture with seeded random weights
(checkpoints, references, exports, servers) and a tiny config for the rest of the option matrix."""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS, SAMPLES_PER_FRAME
from mimi_code2wav.export.reference import moshi_stream_decode, snr_db

from helpers import export_spec

SEED = 1234
CODES_SEED = 5

# The parity scenario, 168 frames per row: row 0 decodes stream A; row 1 junk, then (reset at call 20) stream B;
# row 2 stream C1, then (reset at call 88) C2. Any schedule of call sizes is cut at the resets.
CALLS = 168
# Every F from 1 to 16 within one stream, on one state.
MIXED_CALLS = (1, 3, 16, 2, 12, 10, 9, 8, 7, 6, 5, 4, 3, 2, 16, 15, 14, 13, 11, 1, 10)
MAX_FRAMES_PER_CALL = 16
B_START = 20
C_RESET = 88


def assert_equal_audio(output, reference, max_abs: float = 1e-4, min_snr_db: float = 100.0, what: str = ""):
    """docs/design.md §2.3 "equal": same sample count, max abs error and SNR within bounds."""
    output, reference = np.asarray(output), np.asarray(reference)
    assert output.shape == reference.shape, f"{what}: shape {output.shape} != reference {reference.shape}"
    error = float(np.max(np.abs(output.astype(np.float64) - reference)))
    snr = snr_db(output, reference)
    assert error <= max_abs and snr >= min_snr_db, f"{what}: max abs error {error:.3g} (<= {max_abs}), SNR {snr:.1f} dB (>= {min_snr_db})"
    return error, snr


def tiny_config():
    from transformers import MimiConfig

    return MimiConfig(
        hidden_size=64, num_filters=8, upsampling_ratios=[4, 3, 2, 2], num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, codebook_size=64, codebook_dim=16, vector_quantization_hidden_dimension=16,
        num_quantizers=8, sliding_window=20, upsample_groups=64,
    )


@dataclass
class Scenario:
    codes: np.ndarray  # [3, k, CALLS] what each row is fed, call by call
    resets: dict[int, list[int]]  # call index -> rows whose state is zeroed before that call
    streams: dict[str, np.ndarray]  # name -> [k, T] codes of each stream
    # where each stream's audio sits in the scenario's output: name -> (row, first call, frames)
    placement: dict[str, tuple[int, int, int]]


def make_scenario(num_codebooks: int = NUM_CODEBOOKS, codebook_size: int = CODEBOOK_SIZE, seed: int = CODES_SEED) -> Scenario:
    rng = np.random.default_rng(seed)
    streams = {
        "A": rng.integers(0, codebook_size, (num_codebooks, CALLS)),
        "B": rng.integers(0, codebook_size, (num_codebooks, CALLS - B_START)),
        "C1": rng.integers(0, codebook_size, (num_codebooks, C_RESET)),
        "C2": rng.integers(0, codebook_size, (num_codebooks, CALLS - C_RESET)),
    }
    junk = rng.integers(0, codebook_size, (num_codebooks, B_START))
    codes = np.stack([
        streams["A"],
        np.concatenate([junk, streams["B"]], axis=1),
        np.concatenate([streams["C1"], streams["C2"]], axis=1),
    ]).astype(np.int32)
    placement = {"A": (0, 0, CALLS), "B": (1, B_START, CALLS - B_START), "C1": (2, 0, C_RESET),
                 "C2": (2, C_RESET, CALLS - C_RESET)}
    return Scenario(codes, {B_START: [1], C_RESET: [2]}, streams, placement)


def call_sizes(schedule: int | tuple[int, ...], scenario: Scenario) -> list[int]:
    """Frames per call over the scenario: the schedule repeated (an int: always that many), each call
    cut short where it would cross a reset or the end."""
    sizes = itertools.cycle((schedule,) if isinstance(schedule, int) else schedule)
    boundaries = sorted({*scenario.resets, CALLS})
    calls, position = [], 0
    while position < CALLS:
        limit = next(b for b in boundaries if b > position)
        calls.append(min(next(sizes), limit - position))
        position += calls[-1]
    return calls


def run_scenario(stepper, scenario: Scenario, schedule: int | tuple[int, ...]) -> np.ndarray:
    """PCM [3, CALLS * samples_per_frame] of the scenario through a (step_fn, zero_state_fn), `schedule`
    frames per call (an int, or call sizes that repeat)."""
    step_fn, zero_state_fn = stepper
    state = list(zero_state_fn(3))
    chunks = []
    call = 0
    for frames in call_sizes(schedule, scenario):
        for row in scenario.resets.get(call, []):
            fresh = zero_state_fn(1)
            for index, tensor in enumerate(state):
                tensor[row] = fresh[index][0]
        pcm, *state = step_fn(scenario.codes[:, :, call : call + frames], state)
        chunks.append(np.asarray(pcm))
        call += frames
    return np.concatenate(chunks, axis=1)


def stream_audio(pcm: np.ndarray, scenario: Scenario, name: str, samples_per_frame: int = SAMPLES_PER_FRAME) -> np.ndarray:
    row, first, frames = scenario.placement[name]
    return pcm[row, first * samples_per_frame : (first + frames) * samples_per_frame]


def torch_stepper(step):
    """(step_fn, zero_state_fn) over numpy arrays of a PyTorch step module."""
    import torch

    def run(codes, state):
        with torch.no_grad():
            out = step(torch.from_numpy(np.ascontiguousarray(codes)), *[torch.as_tensor(s) for s in state])
        return [o.numpy().copy() for o in out]

    return run, lambda batch: [s.numpy().copy() for s in step.zero_state(batch)]


ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int32)": np.int32}


def ort_stepper(folder: Path, threads: int = 2):
    """(step_fn, zero_state_fn) of the model.onnx in `folder`, run by ONNX Runtime on the CPU."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()

    def run(codes, state):
        return session.run(None, dict(zip([i.name for i in inputs], [np.ascontiguousarray(codes, np.int32), *state])))

    return run, lambda batch: [np.zeros((batch, *i.shape[1:]), ORT_DTYPES[i.type]) for i in inputs[1:]]


# ---- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def moshi_checkpoint(tmp_path_factory):
    """A moshi-format Mimi checkpoint of seeded random weights, and the moshi model it came from."""
    import torch
    from safetensors.torch import save_file

    from mimi_code2wav.export.weights import randomize_, to_shipped_moshi_names

    warnings.filterwarnings("ignore", category=UserWarning)
    from moshi.models.loaders import get_mimi

    torch.manual_seed(SEED)
    model = get_mimi(None, device="cpu", num_codebooks=NUM_CODEBOOKS)
    randomize_(model, SEED)
    model.eval()
    path = tmp_path_factory.mktemp("moshi") / "tokenizer-test-checkpoint.safetensors"
    # Written with the names of the checkpoints Kyutai ships (in_proj_weight, out_proj.weight).
    save_file(to_shipped_moshi_names({n: t.contiguous() for n, t in model.state_dict().items()}), str(path))
    return path, model


@pytest.fixture(scope="session")
def mimi(moshi_checkpoint):
    """The transformers MimiModel loaded from the moshi checkpoint through the name mapping."""
    from mimi_code2wav.export.weights import load_weights

    return load_weights(moshi_checkpoint[0])


@pytest.fixture(scope="session")
def scenario():
    return make_scenario()


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `build(folder)` filled, once per run: under pytest-xdist other workers wait and reuse it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: nothing to share
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    from filelock import FileLock

    folder = tmp_path_factory.getbasetemp().parent / name
    with FileLock(f"{folder}.lock"):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def moshi_streams(request, tmp_path_factory, scenario):
    """moshi's streaming decode (one frame per call inside mimi.streaming) of each scenario stream."""
    names = list(scenario.streams)

    def decode(folder: Path) -> None:
        # Shorter streams are padded at the end: streaming is causal, so padding cannot change earlier audio.
        padded = np.stack([np.pad(scenario.streams[n], ((0, 0), (0, CALLS - scenario.streams[n].shape[1])))
                           for n in names])
        np.save(folder / "pcm.npy", moshi_stream_decode(request.getfixturevalue("moshi_checkpoint")[1], padded))

    pcm = np.load(built_once(tmp_path_factory, "moshi-streams", decode) / "pcm.npy")
    return {n: pcm[i, : scenario.streams[n].shape[1] * SAMPLES_PER_FRAME] for i, n in enumerate(names)}


def _export(request, tmp_path_factory, **options) -> Path:
    from mimi_code2wav.export.onnx_export import ExportOptions
    from mimi_code2wav.export.pipeline import build

    opts = ExportOptions(**options)
    return built_once(tmp_path_factory, f"export-{opts.kv_cache_dtype}",
                      lambda folder: build(opts, request.getfixturevalue("mimi"), folder))


@pytest.fixture(scope="session")
def onnx_fp32(request, tmp_path_factory):
    """The serving export (1-16 frames per call, moshi window, fp32 KV cache) of the real architecture."""
    return _export(request, tmp_path_factory)


@pytest.fixture(scope="session")
def onnx_fp16(request, tmp_path_factory):
    return _export(request, tmp_path_factory, kv_cache_dtype="float16")


@pytest.fixture(scope="session")
def ort_decode(onnx_fp32):
    """The served ONNX step in ONNX Runtime: `decode(codes [k, T] or [B, k, T], frames_per_call=1)` -> PCM
    [T * 1920] or [B, T * 1920]."""
    step, zero_state = ort_stepper(onnx_fp32)

    def decode(codes: np.ndarray, frames_per_call: int = 1) -> np.ndarray:
        codes = np.asarray(codes)
        batch = codes if codes.ndim == 3 else codes[None]
        state, chunks = zero_state(batch.shape[0]), []
        for first in range(0, batch.shape[2], frames_per_call):
            pcm, *state = step(batch[:, :, first : first + frames_per_call], state)
            chunks.append(np.asarray(pcm))
        pcm = np.concatenate(chunks, axis=1)
        return pcm if codes.ndim == 3 else pcm[0]

    return decode


# The decoder targets the contract suite runs on: the stand-in any machine serves, and Triton's native
# ONNX Runtime backend with implicit state, which every deployment serves (docs/design.md §4).
DECODER_TARGETS = ("python-ort", "onnxruntime")


def require_target(target: str) -> str:
    """`target`, or a skip saying why it cannot be served here; in CI (CI=true) a failure instead:
    the native cases are core and never skipped there."""
    from mimi_code2wav.server.ort_backend import BACKEND_LIBRARY, ORT_BACKEND_ENV, backend_source

    if target == "onnxruntime" and not (backend_source() / BACKEND_LIBRARY).is_file():
        reason = (f"Triton's ONNX Runtime backend is not at {backend_source()} (set {ORT_BACKEND_ENV}=<folder holding "
                  f"{BACKEND_LIBRARY}>): the native onnxruntime decoder cannot be served here")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{reason}; CI runs the contract suite on both decoder targets")
        pytest.skip(reason)
    return target


@pytest.fixture(scope="session")
def repository_for(onnx_fp32, tmp_path_factory):
    """`repository_for(target)`: code2wav + `target` mimi_decoder (KIND_CPU) over `onnx_fp32`, rendered once."""
    from mimi_code2wav.export.render import DecoderServing, render_repository

    @functools.cache
    def render(target: str) -> Path:
        out = tmp_path_factory.mktemp(f"served-{target}") / "model_repository"
        return render_repository(export_spec(onnx_fp32), onnx_fp32 / "model.onnx", out, target,
                                 DecoderServing(instance_kind="KIND_CPU"))

    return render


@pytest.fixture(scope="session")
def server_for(repository_for, triton_server_factory):
    """`server_for(target)`: a tritonserver serving `repository_for(target)`, started once per target."""
    @functools.cache
    def serve(target: str):
        return triton_server_factory(repository_for(require_target(target)))

    return serve


def fixtures_on_each_target():
    """Module fixtures that run a module's server tests on each decoder target: assign them in the module
    (`decoder_target, served_repository, code2wav_server = fixtures_on_each_target()`)."""

    @pytest.fixture(scope="module", params=DECODER_TARGETS, name="decoder_target")
    def target(request):
        return require_target(request.param)

    @pytest.fixture(scope="module", name="served_repository")
    def repository(decoder_target, repository_for):
        return repository_for(decoder_target)

    @pytest.fixture(scope="module", name="code2wav_server")
    def server(decoder_target, server_for):
        return server_for(decoder_target)

    return target, repository, server


@pytest.fixture(scope="session")
def served_repository(repository_for):
    """The python-ort model repository (code2wav + mimi_decoder) over the real-architecture export."""
    return repository_for("python-ort")


@pytest.fixture(scope="session")
def code2wav_server(server_for):
    """A real tritonserver serving code2wav + the python-ort mimi_decoder (started once per session)."""
    return server_for("python-ort")


@pytest.fixture
def grpc_client(code2wav_server):
    """A gRPC client of the session's code2wav server."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(code2wav_server.grpc_url) as client:
        yield client
