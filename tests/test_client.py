"""The code2wav client: chunking and WAV units, then the CLI against a real server (`code2wav_server`)
compared with moshi's streaming decode of the same checkpoint."""

from __future__ import annotations

import asyncio
import functools
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client import ClientError, Code2WavClient, StreamOptions, run_streams
from mimi_code2wav.client.plan import HistoryBuffer
from mimi_code2wav.client.protocol import (
    CODEBOOK_SIZE,
    NUM_CODEBOOKS,
    SAMPLE_RATE_HZ,
    SAMPLES_PER_FRAME,
    STREAM_KEY_HEADER,
    chunk_bounds,
    random_codes,
    request_arrays,
    request_failure,
    validate_codes,
)
from mimi_code2wav.client.wav import INT16_FULL_SCALE, WAVE_FORMAT_IEEE_FLOAT, WAVE_FORMAT_PCM, read_wav, write_wav
from mimi_code2wav.server.triton import fetch_metrics, free_ports, metric_value

from helpers import MODEL_REPOSITORY, REPO_ROOT, load_model_module
from mimi_fixtures import assert_equal_audio

FRAMES = 40


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
        pytest.param(np.full((NUM_CODEBOOKS, 3), CODEBOOK_SIZE), "[0, 2048)", id="range"),
        pytest.param(np.zeros((NUM_CODEBOOKS, 3), np.float32), "integers", id="dtype"),
    ],
)
def test_validate_codes_rejects(codes, message):
    with pytest.raises(ClientError, match=re.escape(message)):
        validate_codes(codes)


def test_float32_wav_is_ieee_float_and_round_trips(tmp_path):
    pcm = np.random.default_rng(0).normal(0, 2, 1001).astype(np.float32)
    path = tmp_path / "x.wav"
    write_wav(path, pcm, SAMPLE_RATE_HZ, "float32")
    blob = path.read_bytes()
    format_tag, channels, rate = struct.unpack("<HHI", blob[20:28])
    assert (format_tag, channels, rate) == (WAVE_FORMAT_IEEE_FLOAT, 1, SAMPLE_RATE_HZ)
    assert b"fact" in blob and len(blob) % 2 == 0
    wav = read_wav(path)
    assert wav.sample_format == "float32" and wav.sample_rate_hz == SAMPLE_RATE_HZ
    np.testing.assert_array_equal(wav.samples[:, 0], pcm)


def test_int16_wav_clips(tmp_path):
    path = tmp_path / "x.wav"
    write_wav(path, np.array([-3.0, -1.0, 0.0, 0.5, 1.0, 7.0], np.float32), SAMPLE_RATE_HZ, "int16")
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
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def test_client_package_imports_only_itself():
    """No module of client/ names the export or server side (or torch) in an import."""
    import ast

    for path in sorted((REPO_ROOT / "client").glob("*.py")):
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
    assert read_wav(out).samples.shape == (6 * SAMPLES_PER_FRAME, 1)


# ---- the CLI against a real server -----------------------------------------------------------------

def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mimi_code2wav.client", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s
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
    assert (wav.sample_format, wav.sample_rate_hz, wav.channels) == ("float32", SAMPLE_RATE_HZ, 1)
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
    assert (wav.sample_format, wav.sample_rate_hz) == ("int16", SAMPLE_RATE_HZ)
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


@pytest.mark.server
def test_decode_with_resume_sends_each_stream_on_its_own_and_equals_moshi(code2wav_server, codes_file, reference,
                                                                          tmp_path):
    before = _successful_requests(code2wav_server)
    done = run_cli("decode", "--url", code2wav_server.grpc_url, "--codes", str(codes_file), "--out",
                   str(tmp_path / "resumable.wav"), "--streams", "2", "--resume", "--stream-key", "cli")
    assert done.returncode == 0, done.stderr
    assert "resumed" not in done.stderr
    assert re.search(rf"\n  resume +0 resume\(s\); 250 frames of history, header code2wav-stream, servers "
                     rf"{re.escape(code2wav_server.grpc_url)}\n", done.stdout), done.stdout
    assert _successful_requests(code2wav_server) - before == 2 * len(chunk_bounds(FRAMES, 4))
    for index in range(2):
        samples = read_wav(tmp_path / f"resumable_{index}.wav").samples[:, 0]
        assert_equal_audio(samples, reference, what=f"resumable stream {index} of 2 vs moshi streaming")


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
    port = free_ports(1)[0]
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
    assert codes.shape == (NUM_CODEBOOKS, 7) and codes.dtype == np.int64  # 0.5 s -> 6.25 frames, rounded up
    assert codes.min() >= 0 and codes.max() < CODEBOOK_SIZE


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


# ---- resume by replay: the client's logic against code2wav's core, over a fake transport ----------

# code2wav's core under a name of its own, to play the server behind the fake connections; the names
# of its sibling files from the files that define them.
CODE2WAV_DIR = MODEL_REPOSITORY / "code2wav" / "1"
core = load_model_module(CODE2WAV_DIR / "code2wav_core.py", "code2wav_core_behind_the_client")
code2wav_settings = load_model_module(CODE2WAV_DIR / "code2wav_settings.py")
code2wav_plan = load_model_module(CODE2WAV_DIR / "code2wav_plan.py")
model_errors = load_model_module(MODEL_REPOSITORY / "common" / "model_errors.py")
GRPC_STATUS = {"INVALID_ARG": "StatusCode.INVALID_ARGUMENT", "UNAVAILABLE": "StatusCode.UNAVAILABLE",
               "INTERNAL": "StatusCode.INTERNAL"}


def FakeTritonError(status, message):
    """What tritonclient raises for a failed gRPC request."""
    from tritonclient.utils import InferenceServerException

    return InferenceServerException(msg=message, status=status)


def lost(text="failed to connect to all addresses; ipv4:127.0.0.1:1: Connection refused"):
    return request_failure(FakeTritonError("StatusCode.UNAVAILABLE", text))


def frame_codes(frames: int, seed: int = 0) -> np.ndarray:
    """Codes [k, frames] whose codebook 0 holds the frame index, so PCM says which frame it came from."""
    codes = random_codes(frames, seed)
    codes[0] = np.arange(frames)
    return codes


def frames_heard(pcm: np.ndarray) -> list[int]:
    """The frame index each frame-long block of fake PCM came from."""
    blocks = np.asarray(pcm).reshape(-1, SAMPLES_PER_FRAME)
    assert (blocks == blocks[:, :1]).all()
    return blocks[:, 0].astype(int).tolist()


@functools.cache
def server_loop() -> asyncio.AbstractEventLoop:
    """The one event loop every FakeServer's table runs on (in a daemon thread), as code2wav's
    tables run on its model's loop: the client's threads hand requests to it, and the table's
    asyncio primitives (the replay scheduler's condition) never see two loops."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="fake-server-loop", daemon=True).start()
    return loop


class FakeServer:
    """code2wav's core with a decoder whose PCM of a frame is its codebook-0 code, repeated."""

    def __init__(self, url: str, dedupe_mode: str = "delta"):
        self.url = url
        self.alive = True
        self.dedupe_mode = dedupe_mode  # how the server reads requests without frame_offset
        self.table = self._fresh_table()
        self.received = []  # (sequence_id, PlannedRequest) of every request that reached it
        self.lose_answer_of = set()  # indices into `received` whose answer is lost after decoding

    def _fresh_table(self):
        settings = code2wav_settings.Code2WavSettings(decoder_max_frames_per_step=16, dedupe_mode=self.dedupe_mode)
        return core.StreamTable(settings)

    def restart(self):
        """A restarted server: alive, holding no stream."""
        self.alive, self.table = True, self._fresh_table()

    @staticmethod
    async def _decode(correlation_id, codes, flags):
        return np.repeat(codes[0, 0].astype(np.float32), SAMPLES_PER_FRAME)

    def infer(self, sequence_id, request, timeout_s):
        if not self.alive:
            raise lost()
        self.received.append((sequence_id, request))
        flags = ((code2wav_settings.FLAG_SEQUENCE_START if request.start else 0)
                 | (code2wav_settings.FLAG_SEQUENCE_END if request.end else 0))
        arrays = request.arrays
        server_request = code2wav_plan.StreamRequest(sequence_id, flags, arrays["input_ids"],
                                                     arrays.get("frame_offset"), arrays.get("history_frames"))
        try:
            pcm = asyncio.run_coroutine_threadsafe(self.table.process(server_request, self._decode),
                                                   server_loop()).result()
        except model_errors.ModelError as exc:
            raise request_failure(FakeTritonError(GRPC_STATUS[exc.code], str(exc))) from None
        if len(self.received) - 1 in self.lose_answer_of:  # decoded, then the connection broke
            raise request_failure(FakeTritonError("StatusCode.UNAVAILABLE", "Socket closed"))
        return pcm.reshape(-1)


class FakeNetwork:
    """connect(url, key) for Code2WavStream: connections to FakeServers, recording stream keys."""

    def __init__(self, *urls: str, dedupe_mode: str = "delta"):
        self.servers = {url: FakeServer(url, dedupe_mode) for url in urls}
        self.connections = []  # (url, stream key) per connection opened

    def __call__(self, url, stream_key):
        self.connections.append((url, stream_key))
        server = self.servers[url]

        class Connection:
            def infer(self, sequence_id, request, timeout_s):
                return server.infer(sequence_id, request, timeout_s)

            def close(self):
                pass

        connection = Connection()
        connection.url = url
        return connection


class FakeTime:
    def __init__(self):
        self.now_s, self.slept_s = 100.0, []

    def clock(self):
        return self.now_s

    def sleep(self, seconds):
        self.slept_s.append(seconds)
        self.now_s += seconds


def decode_in_chunks(stream, codes, bounds, before_chunk=None):
    """Decode `codes` chunk by chunk (END on the last); before_chunk(index) runs before each."""
    pcm = []
    for index, (first, stop) in enumerate(bounds):
        if before_chunk is not None:
            before_chunk(index)
        pcm.append(stream.decode(codes[:, first:stop], end=index == len(bounds) - 1))
        assert pcm[-1].shape == ((stop - first) * SAMPLES_PER_FRAME,)
    return np.concatenate(pcm)


@pytest.mark.parametrize(
    "status, message, resumable, text",
    [
        pytest.param("StatusCode.UNAVAILABLE", "failed to connect to all addresses", True,
                     "UNAVAILABLE: failed to connect to all addresses", id="unreachable"),
        pytest.param("StatusCode.UNAVAILABLE", "Socket closed", True, "UNAVAILABLE: Socket closed", id="reset"),
        pytest.param("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", True,
                     "DEADLINE_EXCEEDED: no answer in time (Deadline Exceeded)", id="deadline"),
        pytest.param("StatusCode.UNAVAILABLE", "the server is shutting down (Server not ready)", True, None,
                     id="shutting-down"),
        pytest.param("StatusCode.INVALID_ARGUMENT", "stream 7 is not open: send the first request of the sequence "
                     "with the START flag (...)", True, None, id="code2wav-forgot-the-stream"),
        pytest.param("StatusCode.INVALID_ARGUMENT", "inference request for sequence 7 to model 'code2wav' must "
                     "specify the START flag on the first request of the sequence", True, None, id="triton-forgot"),
        pytest.param("StatusCode.UNAVAILABLE", "resource exhausted: this code2wav instance already holds 4 live "
                     "streams", True, None, id="stream-cap"),
        pytest.param("StatusCode.UNKNOWN", "Stream removed", True, None, id="stream-removed"),
        pytest.param("StatusCode.NOT_FOUND", "Request for unknown model: 'code2wav' has no available versions", True,
                     None, id="models-unloaded-in-a-drain"),
        pytest.param("StatusCode.INTERNAL", "decoder 'mimi_decoder' failed on step 1 of 1 for stream 7: boom; the "
                     "stream was ended, send its next request with the START flag to begin again", True, None,
                     id="decoder-fault-ended-the-stream"),
        pytest.param("StatusCode.INVALID_ARGUMENT", "frame_offset 420 leaves a gap: stream 7 has decoded 126 frames, "
                     "so frame_offset must be at most 126", True, None, id="stale-copy-of-the-stream"),
        pytest.param("StatusCode.INVALID_ARGUMENT", "history_frames=16 on a continuing stream needs frame_offset=142, "
                     "the stream's next frame (got 286): history is decoded once, after the frames stream 7 holds",
                     True, None, id="resume-piece-meets-a-stale-copy"),
        pytest.param("StatusCode.INVALID_ARGUMENT", "frame 3 differs from the frame stream 7 already decoded", False,
                     "INVALID_ARGUMENT: frame 3 differs from the frame stream 7 already decoded", id="changed-frame"),
        pytest.param("StatusCode.INVALID_ARGUMENT", "unexpected inference input 'history_frames' for model 'code2wav'", False, None,
                     id="old-server"),
    ],
)
def test_request_failure_says_which_failures_a_resume_can_fix(status, message, resumable, text):
    failure = request_failure(FakeTritonError(status, message))
    assert failure.resumable is resumable
    if text is not None:
        assert str(failure) == text


def test_history_buffer_keeps_the_last_frames_and_the_frames_asked_for():
    buffer = HistoryBuffer(history_frames=4)
    codes = frame_codes(12)
    buffer.append(codes[:, :3])
    assert (buffer.first_frame, buffer.next_frame) == (0, 3)
    buffer.append(codes[:, 3:10])
    assert (buffer.first_frame, buffer.next_frame) == (6, 10)
    np.testing.assert_array_equal(buffer.frames(7), codes[:, 7:10])
    buffer.append(codes[:, 10:11], keep_from=6)  # cumulative requests resend from frame 6
    assert buffer.first_frame == 6
    with pytest.raises(ValueError, match=re.escape("frame 5 is not kept (kept: [6, 11))")):
        buffer.frames(5)
    empty = HistoryBuffer(history_frames=0)
    empty.append(codes[:, :5])
    assert (empty.first_frame, empty.next_frame) == (5, 5) and empty.frames(5).shape == (8, 0)


def test_resume_request_replays_the_last_R_frames_then_the_unanswered_ones():
    network = FakeNetwork("a:1")
    codes = frame_codes(14)
    stream = Code2WavClient("a:1", StreamOptions(resume_history_frames=4), connect=network).stream(sequence_id=9)
    stream.decode(codes[:, :1])
    stream.decode(codes[:, 1:10])
    (request,) = stream._plan.resume_requests(codes[:, 10:13], end=False)
    assert request.start and not request.end and request.history_frames == 4
    assert (request.first_new_frame, request.new_frames) == (10, 3)
    assert request.arrays["frame_offset"].tolist() == [[6]] and request.arrays["history_frames"].tolist() == [[4]]
    np.testing.assert_array_equal(request.arrays["input_ids"], codes[:, 6:13].reshape(1, -1))  # codebook-major
    assert all(array.dtype == np.int64 for array in request.arrays.values())
    # Fewer frames than R so far: the whole stream is the history.
    short = Code2WavClient("a:1", StreamOptions(resume_history_frames=250), connect=network).stream(sequence_id=10)
    short.decode(codes[:, :3])
    (request,) = short._plan.resume_requests(codes[:, 3:5], end=True)
    assert request.arrays["frame_offset"].tolist() == [[0]] and request.history_frames == 3 and request.end
    # R = 0: a new sequence from the next frame on, no history.
    bare = Code2WavClient("a:1", StreamOptions(resume_history_frames=0), connect=network).stream(sequence_id=11)
    bare.decode(codes[:, :3])
    (request,) = bare._plan.resume_requests(codes[:, 3:5], end=False)
    assert request.arrays["frame_offset"].tolist() == [[3]] and request.history_frames == 0
    # Plain requests are deltas with frame_offset and never carry history_frames.
    plain = stream._plan.request(codes[:, 10:12], end=True)
    assert set(plain.arrays) == {"input_ids", "frame_offset"} and plain.arrays["frame_offset"].tolist() == [[10]]


def test_a_long_history_is_resumed_in_pieces_each_continuing_the_last():
    network = FakeNetwork("a:1")
    codes = frame_codes(30)
    stream = Code2WavClient("a:1", StreamOptions(resume_history_frames=11, resume_piece_frames=4), connect=network).stream(sequence_id=12)
    stream.decode(codes[:, :20])
    requests = stream._plan.resume_requests(codes[:, 20:22], end=True)
    # History [9, 20): pieces of 4, 4, then 3 with the two new frames; START on the first, END on the last.
    assert [(r.start, r.end, r.arrays["frame_offset"].item(), r.history_frames, r.new_frames) for r in requests] == [
        (True, False, 9, 4, 0), (False, False, 13, 4, 0), (False, True, 17, 3, 2)]
    assert [r.first_new_frame for r in requests] == [13, 17, 20]
    np.testing.assert_array_equal(np.concatenate([r.arrays["input_ids"].reshape(8, -1) for r in requests], axis=1),
                                  codes[:, 9:22])


def test_a_lost_server_is_resumed_on_the_next_url_with_every_frame_once():
    network = FakeNetwork("a:1", "b:2")
    codes = frame_codes(40)
    bounds = chunk_bounds(40, 4)
    time_ = FakeTime()
    stream = Code2WavClient(["a:1", "b:2"], StreamOptions(resume_history_frames=8), connect=network, clock=time_.clock, sleep=time_.sleep).stream(sequence_id=77)

    def kill_a(index):
        time_.now_s += 0.25
        if bounds[index][0] == 21:
            network.servers["a:1"].alive = False

    pcm = decode_in_chunks(stream, codes, bounds, kill_a)
    assert frames_heard(pcm) == list(range(40))
    (resume,) = stream.resumes
    assert (resume.frame, resume.url, resume.attempts, resume.history_frames) == (21, "b:2", 1, 8)
    assert resume.stall_s == pytest.approx(0.25)
    assert resume.error == "UNAVAILABLE: failed to connect to all addresses; ipv4:127.0.0.1:1: Connection refused"
    assert "resumed at frame 21 on b:2 after 0.25 s (1 attempt, 8 frames of history replayed): UNAVAILABLE" in resume.describe()
    # B saw the START with the history and then the rest, all with the stream key of the stream.
    b_requests = [request for _, request in network.servers["b:2"].received]
    assert b_requests[0].start and b_requests[0].arrays["frame_offset"].tolist() == [[13]]
    assert b_requests[0].arrays["history_frames"].tolist() == [[8]]
    assert not any(request.start for request in b_requests[1:]) and b_requests[-1].end
    assert {key for _, key in network.connections} == {"77"}
    assert [sid for sid, _ in network.servers["b:2"].received] == [77] * len(b_requests)
    assert time_.slept_s == [0.0]


def test_an_answer_lost_after_decoding_is_sent_again_as_new_frames():
    """The server decoded the request but its answer never came; the resume reaches the same server
    (one URL: a proxy), which still holds the sequence: the START resets it (barge-in) with history."""
    network = FakeNetwork("proxy:1")
    server = network.servers["proxy:1"]
    server.lose_answer_of = {3}
    codes = frame_codes(30)
    stream = Code2WavClient("proxy:1", StreamOptions(resume_history_frames=6), connect=network).stream()
    pcm = decode_in_chunks(stream, codes, chunk_bounds(30, 4))
    assert frames_heard(pcm) == list(range(30))
    (resume,) = stream.resumes
    assert resume.frame == 9 and resume.error == "UNAVAILABLE: Socket closed" and resume.url == "proxy:1"
    resumed = server.received[4][1]
    assert resumed.arrays["frame_offset"].tolist() == [[3]] and resumed.history_frames == 6
    np.testing.assert_array_equal(resumed.arrays["input_ids"], codes[:, 3:13].reshape(1, -1))
    assert server.table.stats().live_streams == 0  # the stream ended with its last request


def test_a_restarted_server_that_forgot_the_stream_is_resumed():
    network = FakeNetwork("a:1")
    server = network.servers["a:1"]
    codes = frame_codes(20)
    bounds = chunk_bounds(20, 4)
    stream = Code2WavClient("a:1", StreamOptions(resume_history_frames=250), connect=network).stream(sequence_id=5)
    pcm = decode_in_chunks(stream, codes, bounds, lambda index: server.restart() if index == 3 else None)
    assert frames_heard(pcm) == list(range(20))
    (resume,) = stream.resumes
    assert resume.frame == 9 and resume.history_frames == 9
    assert resume.error.startswith("INVALID_ARGUMENT: stream 5 is not open: send the first request of the sequence "
                                   "with the START flag")


def test_a_failed_first_request_is_resumed_at_frame_zero():
    network = FakeNetwork("a:1", "b:2")
    network.servers["a:1"].alive = False
    codes = frame_codes(9)
    stream = Code2WavClient(["a:1", "b:2"], connect=network, sleep=lambda s: None).stream()
    pcm = decode_in_chunks(stream, codes, chunk_bounds(9, 4))
    assert frames_heard(pcm) == list(range(9))
    (resume,) = stream.resumes
    assert (resume.frame, resume.history_frames, resume.url) == (0, 0, "b:2")


def test_resuming_gives_up_after_the_resume_timeout_saying_why():
    network = FakeNetwork("a:1", "b:2")
    codes = frame_codes(12)
    time_ = FakeTime()
    stream = Code2WavClient(["a:1", "b:2"], StreamOptions(resume_timeout_s=3.0), connect=network, clock=time_.clock, sleep=time_.sleep).stream(sequence_id=42)
    stream.decode(codes[:, :5])
    for server in network.servers.values():
        server.alive = False
    with pytest.raises(ClientError) as info:
        stream.decode(codes[:, 5:9])
    # At once on the next URL, then waits doubling from 0.1 s; a sixth attempt would start 3.1 s after the failure.
    assert time_.slept_s == pytest.approx([0.0, 0.1, 0.2, 0.4, 0.8])
    assert str(info.value) == (
        "stream 42 (sequence 42) could not resume at frame 5 within 3 s (5 attempts on a:1, b:2): it failed with "
        "UNAVAILABLE: failed to connect to all addresses; ipv4:127.0.0.1:1: Connection refused")
    assert stream.resumes == [] and stream.next_frame == 5


def test_a_failure_that_a_resume_cannot_fix_is_raised_at_once():
    network = FakeNetwork("a:1", "b:2")
    codes = frame_codes(8)
    cumulative = Code2WavClient(["a:1", "b:2"], StreamOptions(mode="cumulative"), connect=network).stream(sequence_id=4)
    cumulative.decode(codes[:, :2])
    cumulative._plan._kept._codes[2, 1] += 1  # the client's copy of frame 1 no longer matches what it sent
    with pytest.raises(ClientError) as info:
        cumulative.decode(codes[:, 2:4])
    assert str(info.value) == (
        "stream 4 (sequence 4), frames [2, 4) on a:1: INVALID_ARGUMENT: frame 1 differs from the frame stream 4 "
        "already decoded at that index; decoded frames cannot change (START a new sequence instead)")
    assert cumulative.resumes == [] and len(network.servers["b:2"].received) == 0


@pytest.mark.parametrize("mode, send_frame_offset", [("cumulative", True), ("cumulative", False), ("delta", False)])
def test_cumulative_and_offsetless_streams_resume_from_the_new_base(mode, send_frame_offset):
    # Cumulative requests without frame_offset need a server that reads them so (dedupe_mode=cumulative).
    network = FakeNetwork("a:1", "b:2", dedupe_mode="cumulative" if mode == "cumulative" and not send_frame_offset
                          else "delta")
    codes = frame_codes(30)
    bounds = chunk_bounds(30, 4)
    stream = Code2WavClient(["a:1", "b:2"], StreamOptions(mode=mode, send_frame_offset=send_frame_offset,
                                                           resume_history_frames=5), connect=network).stream()

    def kill_a(index):
        if bounds[index][0] == 13:
            network.servers["a:1"].alive = False

    pcm = decode_in_chunks(stream, codes, bounds, kill_a)
    assert frames_heard(pcm) == list(range(30))
    after = [request for _, request in network.servers["b:2"].received]
    assert after[0].arrays["frame_offset"].tolist() == [[8]]
    if mode == "cumulative":  # later requests resend the frames from the resumed sequence's first on
        np.testing.assert_array_equal(after[-1].arrays["input_ids"], codes[:, 8:30].reshape(1, -1))
        assert ("frame_offset" in after[-1].arrays) is send_frame_offset


def test_every_request_carries_the_stream_key_header(monkeypatch):
    import tritonclient.grpc as grpcclient

    calls = []

    class Client:
        def __init__(self, url, channel_args=None, creds=None):
            assert creds is None, "plaintext unless credentials are given"
            self.url, self.channel_args = url, dict(channel_args)

        def infer(self, model_name, inputs, **kwargs):
            calls.append((self.url, model_name, [tensor.name() for tensor in inputs], kwargs))
            if self.url == "a:1" and len(calls) == 2:
                raise FakeTritonError("StatusCode.UNAVAILABLE", "Socket closed")
            frames = 1 if len(calls) == 1 else 2  # frame 0, then frames 1-2 (after 1 frame of history)

            class Result:
                def as_numpy(self, name):
                    return np.zeros((1, frames * SAMPLES_PER_FRAME), np.float32) if name == "model_outputs" else None

            return Result()

        def close(self):
            pass

    monkeypatch.setattr(grpcclient, "InferenceServerClient", Client)
    stream = Code2WavClient(["a:1", "b:2"], StreamOptions(response_timeout_s=7.0)).stream(sequence_id=123, stream_key="call-42")
    codes = frame_codes(3)
    stream.decode(codes[:, :1])
    stream.decode(codes[:, 1:3], end=True)
    assert [url for url, *_ in calls] == ["a:1", "a:1", "b:2"]
    for _, model_name, _, kwargs in calls:
        assert kwargs["headers"] == {STREAM_KEY_HEADER: "call-42"} and STREAM_KEY_HEADER == "code2wav-stream"
        assert kwargs["sequence_id"] == 123 and kwargs["client_timeout"] == 7.0 and model_name == "code2wav"
    assert calls[2][2] == ["input_ids", "frame_offset", "history_frames"] and calls[2][3]["sequence_start"]
    assert stream.resumes[0].url == "b:2"


def test_run_streams_decodes_each_stream_with_its_key_and_reports_resumes():
    network = FakeNetwork("a:1", "b:2")
    codes = [frame_codes(20, seed) for seed in range(3)]
    seen = []

    def progress(done, total):
        seen.append((done, total))
        if done >= 24:
            network.servers["a:1"].alive = False

    report = run_streams(["a:1", "b:2"], codes, StreamOptions(chunk_frames=4), sequence_ids=[11, 12, 13],
                           stream_keys=["k0", "k1", "k2"], progress=progress, connect=network)
    assert [result.stream_key for result in report.results] == ["k0", "k1", "k2"]
    assert [result.sequence_id for result in report.results] == [11, 12, 13]
    for result in report.results:
        assert frames_heard(result.pcm) == list(range(20))
        assert result.chunk_frames == [b - a for a, b in chunk_bounds(20, 4)]
        assert len(result.chunk_latencies_s) == len(result.chunk_frames)
    assert report.summary()["resumes"] == sum(len(result.resumes) for result in report.results) >= 1
    assert seen[-1] == (60, 60)
    with pytest.raises(ClientError, match="stream keys must be distinct, one per stream"):
        run_streams(["a:1"], codes[:2], stream_keys=["k", "k"], connect=network)


def test_without_resume_a_lost_server_fails_the_stream_at_once():
    network = FakeNetwork("a:1", "b:2")
    codes = frame_codes(6)
    stream = Code2WavClient(["a:1", "b:2"], StreamOptions(resume=False), connect=network).stream(sequence_id=8)
    stream.decode(codes[:, :2])
    network.servers["a:1"].alive = False
    with pytest.raises(ClientError, match=r"stream 8 \(sequence 8\), frames \[2, 4\) on a:1: UNAVAILABLE: failed to connect"):
        stream.decode(codes[:, 2:4])
    assert not stream.resumes and network.servers["b:2"].received == []


def test_catch_up_streams_send_every_frame_produced_while_a_request_was_out():
    """Paced with catch-up: the first request waits for its frame; a slow answer (here 0.25 s, about
    3 frame periods) is followed by one request carrying every frame produced meanwhile, not one
    request per frame; every frame is heard once, in order."""
    network = FakeNetwork("a:1")
    server = network.servers["a:1"]
    answer = server.infer

    def slow_infer(sequence_id, request, timeout_s):
        time.sleep(0.25)
        return answer(sequence_id, request, timeout_s)

    server.infer = slow_infer
    report = run_streams("a:1", [frame_codes(12)], StreamOptions(paced=True, catch_up=True), connect=network)
    (result,) = report.results
    assert frames_heard(result.pcm) == list(range(12))
    assert result.chunk_frames[0] == 1 and sum(result.chunk_frames) == 12
    assert max(result.chunk_frames[1:]) >= 3 and len(result.chunk_frames) <= 6, result.chunk_frames
    with pytest.raises(ClientError, match="catch_up paces requests: it needs paced=True"):
        StreamOptions(catch_up=True).validate()


class ReadyClient:
    """Code2WavClient's stand-in for CLI tests: a server that is ready."""

    def __init__(self, url, options, credentials=None):
        pass

    def check_ready(self):
        pass


def test_a_stream_that_gives_up_keeps_what_it_received_and_the_cli_writes_it(monkeypatch, capsys, tmp_path):
    """Every server gone for good: the run stops with StreamsFailed holding each stream's PCM up to
    where it stopped, and `decode --out` writes those WAVs and says where each stream stopped."""
    from mimi_code2wav.client import __main__ as cli
    from mimi_code2wav.client import decode as decode_module
    from mimi_code2wav.client.sync import StreamsFailed
    from mimi_code2wav.client.wav import read_wav

    network = FakeNetwork("a:1")
    codes = [frame_codes(20, seed) for seed in range(2)]

    def progress(done, total):
        if done >= 8:
            network.servers["a:1"].alive = False

    options = StreamOptions(chunk_frames=4, resume_timeout_s=0.3)
    with pytest.raises(StreamsFailed, match="could not resume") as failure:
        run_streams(["a:1"], codes, options, progress=progress, connect=network)
    stopped = [pcm.size // SAMPLES_PER_FRAME for pcm in failure.value.received]
    # progress counts the frames of both streams: the server died once 8 of them had come back
    assert sum(stopped) >= 8 and all(frames < 20 for frames in stopped), stopped
    for pcm, frames in zip(failure.value.received, stopped):
        assert frames_heard(pcm) == list(range(frames))

    def failing_run(servers, streams_codes, options, stream_keys=None, progress=None, credentials=None):
        raise StreamsFailed("stream 1 could not resume", [np.ones(3 * SAMPLES_PER_FRAME, np.float32) * 0.5,
                                                           np.zeros(0, np.float32)])

    monkeypatch.setattr(decode_module, "Code2WavClient", ReadyClient)
    monkeypatch.setattr(decode_module, "run_streams", failing_run)
    out_path = tmp_path / "call.wav"
    code = cli.main(["decode", "--url", "a:1", "--resume", "--random", "--frames", "10", "--streams", "2",
                     "--no-progress", "--out", str(out_path)])
    err = capsys.readouterr().err
    assert code == 1 and "could not resume" in err
    assert f"stream 0 stopped at frame 3 of 10: wrote the 0.24 s received to {tmp_path / 'call_0.wav'}" in err
    assert f"stream 1 stopped at frame 0 of 10: wrote the 0.00 s received to {tmp_path / 'call_1.wav'}" in err
    assert read_wav(tmp_path / "call_0.wav").samples.shape == (3 * SAMPLES_PER_FRAME, 1)


def test_decode_command_reports_each_resume_on_stderr(monkeypatch, capsys, tmp_path):
    from mimi_code2wav.client import __main__ as cli
    from mimi_code2wav.client import decode as decode_module
    from mimi_code2wav.client.plan import Resume
    from mimi_code2wav.client.report import RunReport, StreamResult

    given = {}

    class CheckedClient(ReadyClient):
        def __init__(self, url, options, credentials=None):
            given["checked"] = url

    def fake_run(servers, streams_codes, options, stream_keys=None, progress=None, credentials=None):
        given.update(servers=servers, keys=stream_keys, options=options)
        frames = streams_codes[0].shape[1]
        results = [StreamResult(7 + i, frames, np.zeros(frames * SAMPLES_PER_FRAME, np.float32), [1, 2],
                                [0.01, 0.02], 0.0, 1.0, stream_key=key) for i, key in enumerate(stream_keys)]
        results[1].resumes.append(Resume(frame=2, stall_s=0.5, error="UNAVAILABLE: Socket closed", attempts=2,
                                         url="b:2", history_frames=2))
        return RunReport(results, options, 1.0)

    monkeypatch.setattr(decode_module, "Code2WavClient", CheckedClient)
    monkeypatch.setattr(decode_module, "run_streams", fake_run)
    code = cli.main(["decode", "--url", "a:1", "--failover-url", "b:2", "--random", "--frames", "3", "--streams", "2",
                     "--stream-key", "call", "--resume-history-frames", "25", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0
    assert given["checked"] == "a:1" and given["servers"] == ["a:1", "b:2"] and given["keys"] == ["call-0", "call-1"]
    assert given["options"].resume_history_frames == 25 and given["options"].resume_timeout_s == 30.0
    assert err.strip() == ("stream 1 (key call-1): resumed at frame 2 on b:2 after 0.50 s (2 attempts, 2 frames of "
                           "history replayed): UNAVAILABLE: Socket closed")
    assert re.search(r"\n  resume +1 resume\(s\); 25 frames of history, header code2wav-stream, servers a:1, b:2\n", out)


@pytest.mark.parametrize("args, message", [
    (["--resume-history-frames", "-1"], "--resume-history-frames must be >= 0, got -1"),
    (["--resume-timeout", "0"], "--resume-timeout must be > 0 s, got 0"),
])
def test_decode_rejects_bad_resume_options(args, message, capsys):
    from mimi_code2wav.client.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["decode", "--random", "--frames", "2", *args])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_percentiles_are_the_one_latency_summary():
    from mimi_code2wav.client.report import percentiles

    assert percentiles(np.arange(101.0)) == {"p50": 50.0, "p99": 99.0, "max": 100.0}
    assert percentiles([4.0, 1.0], (50, 90, 99))["max"] == 4.0
    assert percentiles([], empty=None) == {"p50": None, "p99": None, "max": None}
