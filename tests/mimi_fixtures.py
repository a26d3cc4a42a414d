"""Shared, session-scoped Mimi fixtures: seeded checkpoints, references, exports (built once per run).

The real architecture (kyutai/mimi's config) with seeded random weights is used wherever parity or
serving needs it; a tiny config covers the rest of the option matrix.
"""

from __future__ import annotations

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

# The streaming scenario of the parity tests: 168 calls of one frame per row, where
#   row 0 decodes stream A from the start,
#   row 1 decodes junk until call 20, is reset, then decodes stream B (rows of different ages),
#   row 2 decodes stream C1 for 88 frames, is reset mid-run, then decodes stream C2.
# A schedule of call sizes is cut at the resets, so any schedule runs the same scenario.
CALLS = 168
# Mixed call sizes within one stream, every F from 1 to 16, laid out so that the resets (calls 20 and
# 88) fall between calls: streams may mix call sizes freely on one state.
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


def run_scenario(step_fn, zero_state_fn, scenario: Scenario, schedule: int | tuple[int, ...]) -> np.ndarray:
    """Run the batched scenario through a step function, `schedule` frames per call (an int, or call
    sizes that repeat); returns PCM [3, CALLS * samples_per_frame]."""
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


def torch_step_fn(step):
    import torch

    def run(codes, state):
        with torch.no_grad():
            out = step(torch.from_numpy(np.ascontiguousarray(codes)), *[torch.as_tensor(s) for s in state])
        return [o.numpy().copy() for o in out]

    return run


def torch_zero_state(step):
    return lambda batch: [s.numpy().copy() for s in step.zero_state(batch)]


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
    """The folder `build(folder)` filled, built once for the whole run: under pytest-xdist the first
    worker to ask builds it in the run's shared temporary folder and the others wait and reuse it."""
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
    name = f"export-f{opts.max_frames_per_step}-{opts.window}-{opts.kv_cache_dtype}"
    return built_once(tmp_path_factory, name,
                      lambda folder: build(opts, request.getfixturevalue("mimi"), folder))


@pytest.fixture(scope="session")
def onnx_fp32(request, tmp_path_factory):
    """The serving export (1-16 frames per call, moshi window, fp32 KV cache) of the real architecture."""
    return _export(request, tmp_path_factory)


@pytest.fixture(scope="session")
def onnx_fp16(request, tmp_path_factory):
    return _export(request, tmp_path_factory, kv_cache_dtype="float16")


def ort_session(folder: Path, threads: int = 2):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])


def ort_step_fn(session):
    names = [i.name for i in session.get_inputs()]

    def run(codes, state):
        return session.run(None, dict(zip(names, [np.ascontiguousarray(codes), *state])))

    return run


def spec_zero_state(spec):
    def zero(batch):
        return [np.zeros((batch, *s.shape), dtype=s.dtype) for s in spec.states]

    return zero


@pytest.fixture(scope="session")
def ort_decode(onnx_fp32):
    """The served ONNX step run directly in ONNX Runtime, `frames_per_call` frames per call:
    `decode(codes [k, T], frames_per_call=1) -> PCM float32 [T * 1920]` (the stream alone, batch 1);
    codes [B, k, T] -> PCM [B, T * 1920] (the B streams batched)."""
    step = ort_step_fn(ort_session(onnx_fp32))
    zero_state = spec_zero_state(export_spec(onnx_fp32))

    def decode(codes: np.ndarray, frames_per_call: int = 1) -> np.ndarray:
        codes = np.asarray(codes)
        batch = codes if codes.ndim == 3 else codes[None]
        state, chunks = zero_state(batch.shape[0]), []
        for first in range(0, batch.shape[2], frames_per_call):
            pcm, *state = step(np.ascontiguousarray(batch[:, :, first : first + frames_per_call], dtype=np.int32), state)
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
    """`repository_for(target)`: a model repository (code2wav + mimi_decoder for `target`, KIND_CPU)
    over the real-architecture export, rendered once per target."""
    from mimi_code2wav.export.render import DecoderServing, render_repository

    rendered = {}

    def render(target: str) -> Path:
        if target not in rendered:
            out = tmp_path_factory.mktemp(f"served-{target}") / "model_repository"
            rendered[target] = render_repository(export_spec(onnx_fp32), onnx_fp32 / "model.onnx", out, target,
                                                 DecoderServing(instance_kind="KIND_CPU"))
        return rendered[target]

    return render


@pytest.fixture(scope="session")
def server_for(repository_for, triton_server_factory):
    """`server_for(target)`: a real tritonserver serving `repository_for(target)`, started once per
    session and target."""
    servers = {}

    def serve(target: str):
        if target not in servers:
            servers[target] = triton_server_factory(repository_for(require_target(target)))
        return servers[target]

    return serve


def fixtures_on_each_target():
    """Module fixtures that run a test module's server tests once per decoder target: assign them in
    the module (`decoder_target, served_repository, code2wav_server = fixtures_on_each_target()`) and
    its `served_repository` and `code2wav_server` (and `grpc_client` on it) are those of
    `decoder_target`, python-ort then onnxruntime."""

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
