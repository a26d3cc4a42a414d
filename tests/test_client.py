"""The code2wav client: chunking and WAV units, then the CLI against a real server (`code2wav_server`)
compared with moshi's streaming decode of the same checkpoint."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.stream import ClientError, chunk_bounds, request_arrays, validate_codes
from mimi_code2wav.client.wav import INT16_FULL_SCALE, WAVE_FORMAT_IEEE_FLOAT, WAVE_FORMAT_PCM, read_wav, write_wav
from mimi_code2wav.server.triton import fetch_metrics, free_port, metric_value

from mimi_fixtures import assert_equal_audio

ROOT = Path(__file__).resolve().parent.parent
FRAMES = 40
SAMPLES_PER_FRAME = 1920


# ---- units ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "total, chunk, expected",
    [
        pytest.param(1, 4, [(0, 1)], id="one-frame"),
        pytest.param(9, 4, [(0, 1), (1, 5), (5, 9)], id="exact"),
        pytest.param(7, 4, [(0, 1), (1, 5), (5, 7)], id="remainder"),
        pytest.param(3, 1, [(0, 1), (1, 2), (2, 3)], id="frame-by-frame"),
    ],
)
def test_chunk_bounds_first_chunk_is_one_frame(total, chunk, expected):
    assert chunk_bounds(total, chunk) == expected


def test_request_arrays_delta_and_cumulative():
    codes = np.arange(8 * 6, dtype=np.int64).reshape(8, 6)
    delta = request_arrays(codes, 2, 5, "delta", send_frame_offset=True)
    assert delta["input_ids"].shape == (1, 8 * 3)
    # Codebook-major: all frames of codebook 0 first.
    assert delta["input_ids"][0, :3].tolist() == [2, 3, 4]
    assert delta["frame_offset"].tolist() == [[2]]
    cumulative = request_arrays(codes, 2, 5, "cumulative", send_frame_offset=True)
    assert cumulative["input_ids"].shape == (1, 8 * 5) and cumulative["frame_offset"].tolist() == [[0]]
    assert set(request_arrays(codes, 2, 5, "delta", send_frame_offset=False)) == {"input_ids"}


@pytest.mark.parametrize(
    "codes, message",
    [
        pytest.param(np.zeros((4, 3), np.int64), "shape [8, frames]", id="codebooks"),
        pytest.param(np.full((8, 3), 2048), "[0, 2048)", id="range"),
        pytest.param(np.zeros((8, 3), np.float32), "integers", id="dtype"),
    ],
)
def test_validate_codes_rejects(codes, message):
    with pytest.raises(ClientError, match=re.escape(message)):
        validate_codes(codes)


def test_float32_wav_is_ieee_float_and_round_trips(tmp_path):
    pcm = np.random.default_rng(0).normal(0, 2, 1001).astype(np.float32)
    path = tmp_path / "x.wav"
    write_wav(path, pcm, 24000, "float32")
    blob = path.read_bytes()
    format_tag, channels, rate = struct.unpack("<HHI", blob[20:28])
    assert (format_tag, channels, rate) == (WAVE_FORMAT_IEEE_FLOAT, 1, 24000)
    assert b"fact" in blob and len(blob) % 2 == 0
    wav = read_wav(path)
    assert wav.sample_format == "float32" and wav.sample_rate_hz == 24000
    np.testing.assert_array_equal(wav.samples[:, 0], pcm)


def test_int16_wav_clips(tmp_path):
    path = tmp_path / "x.wav"
    write_wav(path, np.array([-3.0, -1.0, 0.0, 0.5, 1.0, 7.0], np.float32), 24000, "int16")
    assert struct.unpack("<H", path.read_bytes()[20:22])[0] == WAVE_FORMAT_PCM
    wav = read_wav(path)
    assert wav.sample_format == "int16"
    assert wav.samples[:, 0].tolist() == [-32767, -32767, 0, 16384, 32767, 32767]


# ---- the client side imports neither torch, the export nor the server side -------------------------

# Runs `code2wav-client ARGS` with torch, mimi_code2wav.export and mimi_code2wav.server unimportable,
# then prints which of them got loaded anyway (none may).
WITHOUT_TORCH = """
import importlib.abc, runpy, sys

FORBIDDEN = ("torch", "mimi_code2wav.export", "mimi_code2wav.server")

def forbidden(name):
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if forbidden(name):
            raise ImportError(f"{name} cannot be imported here")

sys.meta_path.insert(0, Refuse())
try:
    import torch  # noqa: F401
    print("torch imported", file=sys.stderr)
except ImportError:
    pass
sys.argv = ["code2wav-client", *sys.argv[1:]]
try:
    runpy.run_module("mimi_code2wav.client", run_name="__main__")
finally:
    print("loaded:", sorted(m for m in sys.modules if forbidden(m)), file=sys.stderr)
"""


def run_without_torch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_client_package_imports_only_itself():
    """No module of client/ names the export or server side (or torch) in an import."""
    import ast

    for path in sorted((ROOT / "client").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            else:
                continue
            for name in names:
                assert not name.startswith(("torch", "mimi_code2wav.export", "mimi_code2wav.server",
                                            "export", "server")), f"{path.name} imports {name}"


def test_decode_help_runs_where_torch_cannot_be_imported():
    done = run_without_torch("decode", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: code2wav-client decode" in done.stdout
    assert "torch imported" not in done.stderr and "loaded: []" in done.stderr


@pytest.mark.server
def test_decode_streams_where_torch_cannot_be_imported(code2wav_server, tmp_path):
    out = tmp_path / "no_torch.wav"
    done = run_without_torch("decode", "--url", code2wav_server.grpc_url, "--random", "--frames", "6", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "loaded: []" in done.stderr
    assert read_wav(out).samples.shape == (6 * 1920, 1)


# ---- the CLI against a real server -----------------------------------------------------------------

def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mimi_code2wav.client", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )


@pytest.fixture(scope="module")
def codes_file(scenario, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("codes") / "a40.npy"
    np.save(path, scenario.streams["A"][:, :FRAMES])
    return path


@pytest.fixture(scope="module")
def reference(moshi_streams) -> np.ndarray:
    return moshi_streams["A"][: FRAMES * SAMPLES_PER_FRAME]


@pytest.fixture(scope="module")
def float_wav(code2wav_server, codes_file, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("wav") / "x.wav"
    done = run_cli("decode", "--url", code2wav_server.grpc_url, "--codes", str(codes_file), "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out, done


@pytest.mark.server
def test_decode_writes_float32_wav_equal_to_moshi(float_wav, reference):
    out, done = float_wav
    wav = read_wav(out)
    assert (wav.sample_format, wav.sample_rate_hz, wav.channels) == ("float32", 24000, 1)
    assert_equal_audio(wav.samples[:, 0], reference, what="CLI float32 WAV vs moshi streaming")
    for line in ("first-chunk latency", "chunk latency p50", "chunk latency p90", "chunk latency p99", "real-time factor"):
        assert line in done.stdout


@pytest.mark.server
def test_decode_int16_wav_is_the_clipped_float_output(code2wav_server, codes_file, float_wav, tmp_path):
    out = tmp_path / "x16.wav"
    done = run_cli("decode", "--url", code2wav_server.grpc_url, "--codes", str(codes_file), "--out", str(out),
                   "--wav-format", "int16")
    assert done.returncode == 0, done.stderr
    wav = read_wav(out)
    assert (wav.sample_format, wav.sample_rate_hz) == ("int16", 24000)
    decoded = read_wav(float_wav[0]).samples[:, 0]
    error = np.abs(wav.samples[:, 0] / INT16_FULL_SCALE - np.clip(decoded, -1, 1))
    assert error.max() <= 1 / INT16_FULL_SCALE


@pytest.mark.server
def test_decode_cumulative_mode_equals_moshi(code2wav_server, codes_file, reference, tmp_path):
    out = tmp_path / "cumulative.wav"
    done = run_cli("decode", "--url", code2wav_server.grpc_url, "--codes", str(codes_file), "--out", str(out),
                   "--mode", "cumulative", "--chunk-frames", "8")
    assert done.returncode == 0, done.stderr
    assert "cumulative with frame_offset" in done.stdout
    assert_equal_audio(read_wav(out).samples[:, 0], reference, what="cumulative mode vs moshi streaming")


def _successful_requests(server) -> float:
    return metric_value(fetch_metrics(server.metrics_url), "nv_inference_request_success", model="code2wav") or 0.0


@pytest.mark.server
def test_decode_two_streams_run_two_sequences(code2wav_server, codes_file, reference, tmp_path):
    before = _successful_requests(code2wav_server)
    done = run_cli("decode", "--url", code2wav_server.grpc_url, "--codes", str(codes_file), "--out",
                   str(tmp_path / "two.wav"), "--streams", "2", "--paced", "--no-offsets")
    assert done.returncode == 0, done.stderr
    requests_per_stream = len(chunk_bounds(FRAMES, 4))
    assert _successful_requests(code2wav_server) - before == 2 * requests_per_stream
    assert f"2 x {FRAMES} frames" in done.stdout and "paced at 80 ms/frame" in done.stdout
    for index in range(2):
        samples = read_wav(tmp_path / f"two_{index}.wav").samples[:, 0]
        assert_equal_audio(samples, reference, what=f"stream {index} of 2 vs moshi streaming")


def test_decode_server_down_is_one_clear_line(codes_file):
    port = free_port()
    done = run_cli("decode", "--url", f"127.0.0.1:{port}", "--codes", str(codes_file), timeout_s=60)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"error: cannot reach Triton (gRPC) at 127.0.0.1:{port}: connection refused; is the server running?"
    )


@pytest.mark.server
def test_decode_model_not_ready_names_the_model(code2wav_server, codes_file):
    done = run_cli("decode", "--url", code2wav_server.grpc_url, "--model", "no_such_model", "--codes", str(codes_file))
    assert done.returncode == 1
    assert f"error: model 'no_such_model' is not ready on Triton at {code2wav_server.grpc_url}" in done.stderr


def test_encode_resamples_and_writes_codes(moshi_checkpoint, tmp_path, capsys):
    from mimi_code2wav.export.__main__ import main

    rate_hz = 16000
    audio = 0.3 * np.sin(2 * np.pi * 220 * np.arange(rate_hz // 2) / rate_hz)  # 0.5 s
    wav_path, codes_path = tmp_path / "in.wav", tmp_path / "codes.npy"
    write_wav(wav_path, audio.astype(np.float32), rate_hz, "int16")
    assert main(["encode", "--weights", str(moshi_checkpoint[0]), str(wav_path), "--out", str(codes_path)]) == 0
    assert "resampling 16000 Hz -> 24000 Hz by linear interpolation" in capsys.readouterr().err
    codes = np.load(codes_path)
    assert codes.shape == (8, 7) and codes.dtype == np.int64  # 0.5 s -> 6.25 frames, rounded up
    assert codes.min() >= 0 and codes.max() < 2048


# ---- make verify ----------------------------------------------------------------------------------

@pytest.mark.server
def test_verify_passes_against_moshi_for_the_served_checkpoint(code2wav_server, moshi_checkpoint, capsys):
    from mimi_code2wav.server.__main__ import main

    code = main(["verify", "--url", code2wav_server.grpc_url, "--weights", str(moshi_checkpoint[0]), "--streams", "2", "--frames", "12"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "reference: moshi streaming decode of" in out and "SNR" in out
    assert out.strip().splitlines()[-1].startswith("PASS")


@pytest.mark.server
def test_verify_fails_for_other_weights(code2wav_server, capsys):
    from mimi_code2wav.server.__main__ import main

    code = main(["verify", "--url", code2wav_server.grpc_url, "--random-init", "--seed", "3", "--streams", "1", "--frames", "4"])
    out = capsys.readouterr().out
    assert code == 1
    assert "step module" in out and out.strip().splitlines()[-1].startswith("FAIL")
