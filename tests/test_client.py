"""The code2wav client: chunking and WAV units; the CLI against a real server (`code2wav_server`)
compared with moshi's streaming decode of the same checkpoint; resume by replay over a fake network."""

from __future__ import annotations

import asyncio
import functools
import re
import struct
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client import ClientError, Code2WavClient, StreamOptions, protocol, run_streams
from mimi_code2wav.client.protocol import SAMPLE_RATE_HZ, SAMPLES_PER_FRAME, chunk_bounds, random_codes, request_failure
from mimi_code2wav.client.wav import INT16_FULL_SCALE, WAVE_FORMAT_IEEE_FLOAT, WAVE_FORMAT_PCM, read_wav, write_wav
from mimi_code2wav.server.triton import free_ports

from helpers import MODEL_REPOSITORY, REPO_ROOT, FakeClock, load_model_module, metric, wait_until
from mimi_fixtures import assert_equal_audio

FRAMES = 40


# ---- units ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("total, chunk, expected", [
    pytest.param(1, 4, [(0, 1)], id="one-frame"),
    pytest.param(9, 4, [(0, 1), (1, 5), (5, 9)], id="exact"),
    pytest.param(7, 4, [(0, 1), (1, 5), (5, 7)], id="remainder"),
    pytest.param(3, 1, [(0, 1), (1, 2), (2, 3)], id="frame-by-frame"),
])
def test_chunk_bounds_first_chunk_is_one_frame(total, chunk, expected):
    assert chunk_bounds(total, chunk) == expected


@pytest.mark.parametrize("mode, send_frame_offset, sent_from", [
    ("delta", True, 2), ("cumulative", True, 0), ("delta", False, 2)])
def test_a_request_holds_its_new_frames_or_the_stream_so_far(mode, send_frame_offset, sent_from):
    codes = frame_codes(5)
    options = StreamOptions(mode=mode, send_frame_offset=send_frame_offset)
    stream = Code2WavClient("a:1", options, connect=FakeNetwork("a:1")).stream()
    stream.decode(codes[:, :2])
    request = stream._plan.request(codes[:, 2:5], end=True)
    assert (request.start, request.end, request.first_new_frame, request.new_frames) == (False, True, 2, 3)
    # codebook-major: all frames of codebook 0 first
    np.testing.assert_array_equal(request.arrays["input_ids"], codes[:, sent_from:].reshape(1, -1))
    scalars = {name: array.tolist() for name, array in request.arrays.items() if name != "input_ids"}
    assert scalars == ({"frame_offset": [[sent_from]]} if send_frame_offset else {})


@pytest.mark.parametrize("codes, message", [
    pytest.param(np.zeros((4, 3), np.int64), "shape [8, frames]", id="codebooks"),
    pytest.param(np.full((protocol.NUM_CODEBOOKS, 3), protocol.CODEBOOK_SIZE), "[0, 2048)", id="range"),
    pytest.param(np.zeros((protocol.NUM_CODEBOOKS, 3), np.float32), "integers", id="dtype"),
])
def test_validate_codes_rejects(codes, message):
    with pytest.raises(ClientError, match=re.escape(message)):
        protocol.validate_codes(codes)


def test_float32_wav_is_ieee_float_and_round_trips_and_int16_clips(tmp_path):
    pcm = np.random.default_rng(0).normal(0, 2, 1001).astype(np.float32)
    write_wav(tmp_path / "f.wav", pcm, SAMPLE_RATE_HZ, "float32")
    blob = (tmp_path / "f.wav").read_bytes()
    assert struct.unpack("<HHI", blob[20:28]) == (WAVE_FORMAT_IEEE_FLOAT, 1, SAMPLE_RATE_HZ)
    assert b"fact" in blob and len(blob) % 2 == 0
    wav = read_wav(tmp_path / "f.wav")
    assert (wav.sample_format, wav.sample_rate_hz) == ("float32", SAMPLE_RATE_HZ)
    np.testing.assert_array_equal(wav.samples[:, 0], pcm)
    write_wav(tmp_path / "i.wav", np.array([-3.0, -1.0, 0.0, 0.5, 1.0, 7.0], np.float32), SAMPLE_RATE_HZ, "int16")
    assert struct.unpack("<H", (tmp_path / "i.wav").read_bytes()[20:22])[0] == WAVE_FORMAT_PCM
    wav = read_wav(tmp_path / "i.wav")
    assert wav.sample_format == "int16" and wav.samples[:, 0].tolist() == [-32767, -32767, 0, 16384, 32767, 32767]


# ---- the client side imports neither torch, the export nor the server side -------------------------

# `code2wav-client ARGS` where torch, the export and the server side cannot be imported (None in sys.modules).
WITHOUT_TORCH = """
import runpy, sys
sys.modules.update(dict.fromkeys(("torch", "mimi_code2wav.export", "mimi_code2wav.server")))
sys.argv = ["code2wav-client", *sys.argv[1:]]
runpy.run_module("mimi_code2wav.client", run_name="__main__")
"""


def run_cli(*args: str, timeout_s: float = 120, runner=("-m", "mimi_code2wav.client")) -> subprocess.CompletedProcess:
    """`code2wav-client ARGS`; `runner=("-c", WITHOUT_TORCH)`: where torch cannot be imported."""
    return subprocess.run([sys.executable, *runner, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.mark.parametrize("package, forbidden", [
    pytest.param("client", ("torch", "export", "server"), id="client"),
    # vllm_plugin/ runs in the pipeline's environment, which has no export or server side (docs/design.md §6).
    pytest.param("vllm_plugin", (), id="vllm_plugin"),
])
def test_the_package_imports_only_the_client_side_of_this_project(package, forbidden):
    """No module names the export or server side (client/: nor torch) in an import."""
    import ast

    forbidden = (*forbidden, "mimi_code2wav.export", "mimi_code2wav.server")
    for path in sorted((REPO_ROOT / package).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            else:
                continue
            assert not any(name.startswith(forbidden) for name in names), f"{path.name} imports {names}"


# ---- the CLI against a real server -----------------------------------------------------------------

def decode_cli(server, codes_file: Path, out: Path, *args: str, **run) -> subprocess.CompletedProcess:
    """`decode` of `codes_file` on `server` into `out`, which must succeed."""
    done = run_cli("decode", "--url", server.grpc_url, "--codes", str(codes_file), "--out", str(out), *args, **run)
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def codes_file(scenario, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("codes") / "a40.npy"
    np.save(path, scenario.streams["A"][:, :FRAMES])
    return path


@pytest.fixture(scope="module")
def reference(moshi_streams) -> np.ndarray:
    return moshi_streams["A"][: FRAMES * SAMPLES_PER_FRAME]


@pytest.mark.server
def test_decode_writes_a_float32_wav_equal_to_moshi_and_an_int16_one_of_the_clipped_output(code2wav_server, codes_file,
                                                                                          reference, tmp_path):
    done = decode_cli(code2wav_server, codes_file, tmp_path / "x.wav", runner=("-c", WITHOUT_TORCH))
    wav = read_wav(tmp_path / "x.wav")
    assert (wav.sample_format, wav.sample_rate_hz, wav.channels) == ("float32", SAMPLE_RATE_HZ, 1)
    assert_equal_audio(wav.samples[:, 0], reference, what="CLI float32 WAV vs moshi streaming")
    for line in ("first-chunk latency", "chunk latency p50", "chunk latency p90", "chunk latency p99", "real-time factor"):
        assert line in done.stdout
    decode_cli(code2wav_server, codes_file, tmp_path / "x16.wav", "--wav-format", "int16")
    wav16 = read_wav(tmp_path / "x16.wav")
    assert (wav16.sample_format, wav16.sample_rate_hz) == ("int16", SAMPLE_RATE_HZ)
    error = np.abs(wav16.samples[:, 0] / INT16_FULL_SCALE - np.clip(wav.samples[:, 0], -1, 1))
    assert error.max() <= 1 / INT16_FULL_SCALE


@pytest.mark.server
@pytest.mark.parametrize("args, streams, chunk_frames, says", [
    pytest.param(["--mode", "cumulative", "--chunk-frames", "8"], 1, 8, [r"cumulative with frame_offset"],
                 id="cumulative"),
    pytest.param(["--streams", "2", "--paced", "--no-offsets"], 2, 4, [rf"2 x {FRAMES} frames", "paced at 80 ms/frame"],
                 id="two-paced-sequences-without-offsets"),
    # each stream on its own connection, its key in the resume line
    pytest.param(["--streams", "2", "--resume", "--stream-key", "cli"], 2, 4,
                 [r"\n  resume +0 resume\(s\); 250 frames of history, header code2wav-stream, servers {url}\n"],
                 id="two-resumable-streams"),
])
def test_decode_sends_one_request_per_chunk_of_each_stream_and_equals_moshi(code2wav_server, codes_file, reference,
                                                                            tmp_path, args, streams, chunk_frames, says):
    before = metric(code2wav_server, "nv_inference_request_success", model="code2wav")
    done = decode_cli(code2wav_server, codes_file, tmp_path / "x.wav", *args)
    for pattern in says:
        assert re.search(pattern.replace("{url}", re.escape(code2wav_server.grpc_url)), done.stdout), done.stdout
    assert "resumed" not in done.stderr
    requests = streams * len(chunk_bounds(FRAMES, chunk_frames))  # counted once answered: waited for
    assert wait_until(lambda: metric(code2wav_server, "nv_inference_request_success", model="code2wav") - before == requests, 10)
    for name in ["x.wav"] if streams == 1 else [f"x_{index}.wav" for index in range(streams)]:
        assert_equal_audio(read_wav(tmp_path / name).samples[:, 0], reference, what=f"{name} ({' '.join(args)}) vs moshi")


@pytest.mark.parametrize("server, model, says", [
    pytest.param(None, "code2wav", "cannot reach Triton (gRPC) at {url}: connection refused; is the server running?",
                 id="server-down"),
    pytest.param("code2wav_server", "no_such_model", "model 'no_such_model' is not ready on Triton at {url} (not in the "
                 "model repository); see the server log", id="model-not-ready", marks=pytest.mark.server),
])
def test_decode_says_what_is_wrong_in_one_line(request, codes_file, server, model, says):
    url = request.getfixturevalue(server).grpc_url if server else f"127.0.0.1:{free_ports(1)[0]}"
    done = run_cli("decode", "--url", url, "--model", model, "--codes", str(codes_file), timeout_s=60)
    assert done.returncode == 1 and done.stderr.strip() == "error: " + says.format(url=url)


def test_encode_resamples_and_writes_codes(moshi_checkpoint, tmp_path, capsys):
    from mimi_code2wav.export.__main__ import main

    rate_hz = 16000
    audio = 0.3 * np.sin(2 * np.pi * 220 * np.arange(rate_hz // 2) / rate_hz)  # 0.5 s
    wav_path, codes_path = tmp_path / "in.wav", tmp_path / "codes.npy"
    write_wav(wav_path, audio.astype(np.float32), rate_hz, "int16")
    assert main(["encode", "--weights", str(moshi_checkpoint[0]), str(wav_path), "--out", str(codes_path)]) == 0
    assert "resampling 16000 Hz -> 24000 Hz by linear interpolation" in capsys.readouterr().err
    codes = np.load(codes_path)
    assert codes.shape == (protocol.NUM_CODEBOOKS, 7) and codes.dtype == np.int64  # 0.5 s -> 6.25 frames, rounded up
    assert codes.min() >= 0 and codes.max() < protocol.CODEBOOK_SIZE


# ---- make verify ----------------------------------------------------------------------------------

@pytest.mark.server
def test_verify_fails_for_weights_other_than_the_served_ones(code2wav_server, capsys):
    """(It passes for the served checkpoint: test_readme.py runs `make verify`.)"""
    from mimi_code2wav.server.__main__ import main

    code = main(["verify", "--url", code2wav_server.grpc_url, "--random-init", "--seed", "3", "--streams", "1",
                 "--frames", "4"])
    out = capsys.readouterr().out
    assert code == 1 and "step module" in out and out.strip().splitlines()[-1].startswith("FAIL"), out


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
CONNECTION_REFUSED = "failed to connect to all addresses; ipv4:127.0.0.1:1: Connection refused"


def FakeTritonError(status, message):
    """What tritonclient raises for a failed gRPC request."""
    from tritonclient.utils import InferenceServerException

    return InferenceServerException(msg=message, status=status)


def inference_result(pcm: np.ndarray):
    """What tritonclient's InferResult shows of an answer: `model_outputs`, no `sr`."""
    return types.SimpleNamespace(as_numpy={"model_outputs": pcm}.get)


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
    """The one event loop (a daemon thread's) of every FakeServer's table, as code2wav's run on its model's."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="fake-server-loop", daemon=True).start()
    return loop


class FakeServer:
    """code2wav's core with a decoder whose PCM of a frame is its codebook-0 code, repeated."""

    def __init__(self, url: str, dedupe_mode: str = "delta"):  # dedupe_mode: requests without frame_offset
        self.url, self.dedupe_mode = url, dedupe_mode
        self.restart()
        self.received = []  # (sequence_id, PlannedRequest) of every request that reached it
        self.lose_answer_of = set()  # indices into `received` whose answer is lost after decoding

    def restart(self):
        """A (re)started server: alive, holding no stream."""
        settings = code2wav_settings.Code2WavSettings(decoder_max_frames_per_step=16, dedupe_mode=self.dedupe_mode)
        self.alive, self.table = True, core.StreamTable(settings)

    @staticmethod
    async def _decode(correlation_id, codes, flags):
        return np.repeat(codes[0, 0].astype(np.float32), SAMPLES_PER_FRAME)

    def infer(self, stream, request):
        if not self.alive:
            raise request_failure(FakeTritonError("StatusCode.UNAVAILABLE", CONNECTION_REFUSED))
        self.received.append((stream.sequence_id, request))
        flags = ((code2wav_settings.FLAG_SEQUENCE_START if request.start else 0)
                 | (code2wav_settings.FLAG_SEQUENCE_END if request.end else 0))
        arrays = request.arrays
        server_request = code2wav_plan.StreamRequest(stream.sequence_id, flags, arrays["input_ids"],
                                                     arrays.get("frame_offset"), arrays.get("history_frames"))
        try:
            pcm = asyncio.run_coroutine_threadsafe(self.table.process(server_request, self._decode),
                                                   server_loop()).result()
        except model_errors.ModelError as exc:
            raise request_failure(FakeTritonError(GRPC_STATUS[exc.code], model_errors.tagged_message("code2wav", exc))) from None
        if len(self.received) - 1 in self.lose_answer_of:  # decoded, then the connection broke
            raise request_failure(FakeTritonError("StatusCode.UNAVAILABLE", "Socket closed"))
        return inference_result(pcm.reshape(-1))


class FakeNetwork:
    """connect(url) for Code2WavStream: connections to FakeServers."""

    def __init__(self, *urls: str, dedupe_mode: str = "delta"):
        self.servers = {url: FakeServer(url, dedupe_mode) for url in urls}

    def __call__(self, url):
        return types.SimpleNamespace(url=url, infer=self.servers[url].infer, close=lambda: None)

    def received(self, url: str) -> list:
        """The PlannedRequests that reached `url`."""
        return [request for _, request in self.servers[url].received]


class FakeTime(FakeClock):
    """A FakeClock that sleep() moves on, recording each sleep in `slept_s`."""

    def __init__(self):
        super().__init__(100.0)
        self.slept_s = []

    def sleep(self, seconds):
        self.slept_s.append(seconds)
        self.now += seconds


def decode_in_chunks(stream, frames: int, before_chunk=lambda first: None) -> None:
    """Decode frame_codes(frames) in chunks of 4, before_chunk(first) before each: every frame heard once."""
    codes, bounds, pcm = frame_codes(frames), chunk_bounds(frames, 4), []
    for index, (first, stop) in enumerate(bounds):
        before_chunk(first)
        pcm.append(stream.decode(codes[:, first:stop], end=index == len(bounds) - 1))
        assert pcm[-1].shape == ((stop - first) * SAMPLES_PER_FRAME,)
    assert frames_heard(np.concatenate(pcm)) == list(range(frames))


def kill_at(network, frame: int):
    """before_chunk: server a:1 dies before the chunk that starts at `frame`."""
    def before_chunk(first):
        if first == frame:
            network.servers["a:1"].alive = False
    return before_chunk


@pytest.mark.parametrize("status, message, resumable, text", [
    pytest.param("StatusCode.UNAVAILABLE", "failed to connect to all addresses", True,
                 "UNAVAILABLE: failed to connect to all addresses", id="unreachable"),
    pytest.param("StatusCode.UNKNOWN", "Stream removed", True, None, id="stream-removed"),
    pytest.param("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", True,
                 "DEADLINE_EXCEEDED: no answer in time (Deadline Exceeded)", id="deadline"),
    pytest.param("StatusCode.INVALID_ARGUMENT", "inference request for sequence 7 to model 'code2wav' must "
                 "specify the START flag on the first request of the sequence", True, None, id="triton-forgot"),
    pytest.param("StatusCode.NOT_FOUND", "Request for unknown model: 'code2wav' has no available versions", True,
                 None, id="models-unloaded-in-a-drain"),
    pytest.param("StatusCode.UNAVAILABLE", "This protocol is restricted, expecting header 'code2wav-key'", False,
                 None, id="key-refused"),
    pytest.param("StatusCode.INVALID_ARGUMENT", "[code2wav.changed_frame] frame 3 differs", False,
                 "INVALID_ARGUMENT: [code2wav.changed_frame] frame 3 differs", id="changed-frame"),
    pytest.param("StatusCode.INVALID_ARGUMENT", "[code2wav.no_such_kind] a kind this client does not know", False,
                 None, id="unknown-kind"),
])
def test_request_failure_says_which_failures_a_resume_can_fix(status, message, resumable, text):
    failure = request_failure(FakeTritonError(status, message))
    assert failure.resumable is resumable
    if text is not None:
        assert str(failure) == text


# Wordings that the client once matched on, and plain ones: none may change how a kind is handled.
REWORDINGS = ("", "frame_offset 9 leaves a gap", "history is decoded once; send the START flag",
              "the server is shutting down", "has no available versions", "socket closed", "x" * 300)


@pytest.mark.parametrize("kind", sorted(set(protocol.ERROR_ACTIONS) | set(code2wav_settings.ERROR_KINDS)))
def test_the_client_knows_every_kind_the_server_answers_with_and_decides_by_kind_not_wording(kind):
    assert kind in protocol.ERROR_ACTIONS and kind in code2wav_settings.ERROR_KINDS
    action = protocol.ERROR_ACTIONS[kind]
    for status in ("StatusCode.INVALID_ARGUMENT", "StatusCode.UNAVAILABLE", "StatusCode.INTERNAL"):
        failures = [request_failure(FakeTritonError(status, f"[code2wav.{kind}] {text}")) for text in REWORDINGS]
        assert {(failure.kind, failure.resumable) for failure in failures} == {(kind, action != protocol.FAIL)}


def test_resume_requests_replay_the_last_R_frames_then_the_unanswered_ones_in_pieces():
    codes = frame_codes(30)

    def stream(stop: int, **options):
        planned = Code2WavClient("a:1", StreamOptions(**options), connect=FakeNetwork("a:1")).stream()
        planned.decode(codes[:, :1])
        planned.decode(codes[:, 1:stop])
        return planned._plan

    (request,) = stream(10, resume_history_frames=4).resume_requests(codes[:, 10:13], end=False)
    assert (request.start, request.end, request.history_frames) == (True, False, 4)
    assert (request.first_new_frame, request.new_frames) == (10, 3)
    assert request.arrays["frame_offset"].tolist() == [[6]] and request.arrays["history_frames"].tolist() == [[4]]
    np.testing.assert_array_equal(request.arrays["input_ids"], codes[:, 6:13].reshape(1, -1))  # codebook-major
    assert all(array.dtype == np.int64 for array in request.arrays.values())
    # Fewer frames than R so far: the whole stream is the history. R = 0: a new sequence from the next frame on.
    for history_frames, end, frame_offset, replayed in ((250, True, 0, 3), (0, False, 3, 0)):
        (request,) = stream(3, resume_history_frames=history_frames).resume_requests(codes[:, 3:5], end=end)
        assert (request.arrays["frame_offset"].tolist(), request.history_frames, request.end) == (
            [[frame_offset]], replayed, end)
    # A long history goes in pieces, each continuing the last: history [9, 20) in pieces of 4, 4, then 3
    # with the two new frames; START on the first, END on the last.
    requests = stream(20, resume_history_frames=11, resume_piece_frames=4).resume_requests(codes[:, 20:22], end=True)
    assert [(r.start, r.end, r.arrays["frame_offset"].item(), r.history_frames, r.new_frames) for r in requests] == [
        (True, False, 9, 4, 0), (False, False, 13, 4, 0), (False, True, 17, 3, 2)]
    assert [r.first_new_frame for r in requests] == [13, 17, 20]
    np.testing.assert_array_equal(np.concatenate([r.arrays["input_ids"].reshape(8, -1) for r in requests], axis=1),
                                  codes[:, 9:22])


def test_a_lost_server_is_resumed_on_the_next_url_with_every_frame_once():
    network, time_ = FakeNetwork("a:1", "b:2"), FakeTime()
    stream = Code2WavClient(["a:1", "b:2"], StreamOptions(resume_history_frames=8), connect=network,
                            clock=time_, sleep=time_.sleep).stream(sequence_id=77)

    def kill_a(first):
        time_.now += 0.25
        kill_at(network, 21)(first)

    decode_in_chunks(stream, 40, kill_a)
    (resume,) = stream.resumes
    assert (resume.frame, resume.url, resume.attempts, resume.history_frames) == (21, "b:2", 1, 8)
    assert resume.stall_s == pytest.approx(0.25) and resume.error == f"UNAVAILABLE: {CONNECTION_REFUSED}"
    assert "resumed at frame 21 on b:2 after 0.25 s (1 attempt, 8 frames of history replayed): UNAVAILABLE" in resume.describe()
    # B saw the START with the history and then the rest, all on the stream's sequence (its key by default).
    b_requests = network.received("b:2")
    assert b_requests[0].start and b_requests[0].arrays["frame_offset"].tolist() == [[13]]
    assert b_requests[0].arrays["history_frames"].tolist() == [[8]]
    assert not any(request.start for request in b_requests[1:]) and b_requests[-1].end
    assert stream.stream_key == "77" and [sid for sid, _ in network.servers["b:2"].received] == [77] * len(b_requests)
    assert time_.slept_s == [0.0]


def test_an_answer_lost_after_decoding_is_sent_again_as_new_frames():
    """The server decoded the request but its answer never came; the resume reaches the same server
    (one URL: a proxy), which still holds the sequence: the START resets it (barge-in) with history."""
    network = FakeNetwork("proxy:1")
    network.servers["proxy:1"].lose_answer_of = {3}
    stream = Code2WavClient("proxy:1", StreamOptions(resume_history_frames=6), connect=network).stream()
    decode_in_chunks(stream, 30)
    (resume,) = stream.resumes
    assert (resume.frame, resume.error, resume.url) == (9, "UNAVAILABLE: Socket closed", "proxy:1")
    resumed = network.received("proxy:1")[4]
    assert resumed.arrays["frame_offset"].tolist() == [[3]] and resumed.history_frames == 6
    np.testing.assert_array_equal(resumed.arrays["input_ids"], frame_codes(30)[:, 3:13].reshape(1, -1))
    assert network.servers["proxy:1"].table.live_streams == 0  # the stream ended with its last request


def test_a_restarted_server_that_forgot_the_stream_or_a_failed_first_request_is_resumed():
    network = FakeNetwork("a:1", "b:2")
    stream = Code2WavClient("a:1", StreamOptions(resume_history_frames=250), connect=network).stream(sequence_id=5)
    decode_in_chunks(stream, 20, lambda first: network.servers["a:1"].restart() if first == 9 else None)
    (resume,) = stream.resumes
    assert (resume.frame, resume.history_frames) == (9, 9)
    assert resume.error.startswith("INVALID_ARGUMENT: [code2wav.unknown_stream] stream 5 is not open")
    # The first request failing: resumed at frame 0, with no history.
    network.servers["a:1"].alive = False
    stream = Code2WavClient(["a:1", "b:2"], connect=network, sleep=lambda s: None).stream()
    decode_in_chunks(stream, 9)
    (resume,) = stream.resumes
    assert (resume.frame, resume.history_frames, resume.url) == (0, 0, "b:2")


@pytest.mark.parametrize("mode, send_frame_offset", [("cumulative", True), ("cumulative", False), ("delta", False)])
def test_cumulative_and_offsetless_streams_resume_from_the_new_base(mode, send_frame_offset):
    # Cumulative requests without frame_offset need a server that reads them so (dedupe_mode=cumulative).
    network = FakeNetwork("a:1", "b:2", dedupe_mode="cumulative" if mode == "cumulative" and not send_frame_offset
                          else "delta")
    options = StreamOptions(mode=mode, send_frame_offset=send_frame_offset, resume_history_frames=5)
    decode_in_chunks(Code2WavClient(["a:1", "b:2"], options, connect=network).stream(), 30, kill_at(network, 13))
    after = network.received("b:2")
    assert after[0].arrays["frame_offset"].tolist() == [[8]]
    if mode == "cumulative":  # later requests resend the frames from the resumed sequence's first on
        np.testing.assert_array_equal(after[-1].arrays["input_ids"], frame_codes(30)[:, 8:30].reshape(1, -1))
        assert ("frame_offset" in after[-1].arrays) is send_frame_offset


@pytest.mark.parametrize("options, fault, message, slept_s", [
    # at once on the next URL, then waits doubling from 0.1 s; a sixth attempt would start 3.1 s after the failure
    pytest.param(StreamOptions(resume_timeout_s=3.0), ("a:1", "b:2"), "stream 4 (sequence 4) could not resume at frame 2 "
                 f"within 3 s (5 attempts on a:1, b:2): it failed with UNAVAILABLE: {CONNECTION_REFUSED}",
                 [0.0, 0.1, 0.2, 0.4, 0.8], id="resuming-gives-up-after-the-resume-timeout"),
    pytest.param(StreamOptions(resume=False), ("a:1",),
                 f"stream 4 (sequence 4), frames [2, 4) on a:1: UNAVAILABLE: {CONNECTION_REFUSED}", [],
                 id="without-resume-a-lost-server-fails-the-stream-at-once"),
    pytest.param(StreamOptions(mode="cumulative"), "changed",
                 "stream 4 (sequence 4), frames [2, 4) on a:1: INVALID_ARGUMENT: [code2wav.changed_frame] frame 1 "
                 "differs from the frame stream 4 already decoded at that index; decoded frames cannot change (START "
                 "a new sequence instead)", [], id="a-failure-a-resume-cannot-fix-is-raised-at-once"),
])
def test_a_stream_that_cannot_go_on_fails_saying_why(options, fault, message, slept_s):
    network, codes, time_ = FakeNetwork("a:1", "b:2"), frame_codes(4), FakeTime()
    client = Code2WavClient(["a:1", "b:2"], options, connect=network, clock=time_, sleep=time_.sleep)
    stream = client.stream(sequence_id=4)
    stream.decode(codes[:, :2])
    if fault == "changed":
        stream._plan._kept[2, 1] += 1  # the client's copy of frame 1 no longer matches what it sent
    for url in () if fault == "changed" else fault:  # servers gone
        network.servers[url].alive = False
    with pytest.raises(ClientError) as info:
        stream.decode(codes[:, 2:4])
    assert str(info.value) == message and time_.slept_s == pytest.approx(slept_s)
    assert stream.resumes == [] and stream.next_frame == 2 and network.servers["b:2"].received == []


def test_every_request_of_either_client_carries_its_streams_key_and_the_options(monkeypatch):
    """Both clients over tritonclient (its channel faked): every request carries the stream's key, sequence
    id, model and deadline; a lost connection resumes on the next URL with history; a failing kind raises."""
    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as aio_grpc

    from mimi_code2wav.client.aio import Code2WavClient as AsyncClient

    calls = []

    class Channel:
        def __init__(self, url, channel_args=None, creds=None):
            assert creds is None, "plaintext unless credentials are given"
            self.url = url

        def infer(self, model_name, inputs, **kwargs):
            calls.append((self.url, model_name, [tensor.name() for tensor in inputs], kwargs))
            if kwargs["headers"][protocol.STREAM_KEY_HEADER] == "refused":
                raise FakeTritonError("StatusCode.INVALID_ARGUMENT", "[code2wav.shape] refused")
            if self.url == "a:1" and len(calls) == 2:
                raise FakeTritonError("StatusCode.UNAVAILABLE", "Socket closed")
            frames = 1 if len(calls) == 1 else 2  # frame 0, then frames 1-2 (after 1 frame of history)
            return inference_result(np.zeros((1, frames * SAMPLES_PER_FRAME), np.float32))

        def close(self):
            pass

    class AsyncChannel(Channel):
        async def infer(self, model_name, inputs, **kwargs):
            return Channel.infer(self, model_name, inputs, **kwargs)

    monkeypatch.setattr(grpcclient, "InferenceServerClient", Channel)
    monkeypatch.setattr(aio_grpc, "InferenceServerClient", AsyncChannel)
    codes, loop = frame_codes(3), asyncio.new_event_loop()
    for client_type, run in ((Code2WavClient, lambda result: result), (AsyncClient, loop.run_until_complete)):
        calls.clear()
        client = client_type(["a:1", "b:2"], StreamOptions(response_timeout_s=7.0))
        stream = client.stream(sequence_id=123, stream_key="call-42")
        run(stream.decode(codes[:, :1]))
        run(stream.decode(codes[:, 1:3], end=True))
        assert [url for url, *_ in calls] == ["a:1", "a:1", "b:2"] and stream.resumes[0].url == "b:2"
        for _, model_name, _, kwargs in calls:
            assert kwargs["headers"] == {protocol.STREAM_KEY_HEADER: "call-42"} and model_name == "code2wav"
            assert kwargs["sequence_id"] == 123 and kwargs["client_timeout"] == 7.0
        assert calls[2][2] == ["input_ids", "frame_offset", "history_frames"] and calls[2][3]["sequence_start"]
        with pytest.raises(ClientError, match=r"INVALID_ARGUMENT: \[code2wav.shape\] refused"):
            run(client.stream(sequence_id=7, stream_key="refused").decode(codes[:, :1]))
        assert calls[-1][3]["headers"] == {"code2wav-stream": "refused"} == {protocol.STREAM_KEY_HEADER: "refused"}
    loop.close()


def test_run_streams_decodes_each_stream_with_its_key_and_reports_resumes():
    network, codes, seen = FakeNetwork("a:1", "b:2"), [frame_codes(20, seed) for seed in range(3)], []

    def progress(done, total):
        seen.append((done, total))
        if done >= 24:
            network.servers["a:1"].alive = False

    report = run_streams(["a:1", "b:2"], codes, StreamOptions(chunk_frames=4), sequence_ids=[11, 12, 13],
                         stream_keys=["k0", "k1", "k2"], progress=progress, connect=network)
    assert [(result.stream_key, result.sequence_id) for result in report.results] == [("k0", 11), ("k1", 12), ("k2", 13)]
    for result in report.results:
        assert frames_heard(result.pcm) == list(range(20))
        assert result.chunk_frames == [b - a for a, b in chunk_bounds(20, 4)]
        assert len(result.chunk_latencies_s) == len(result.chunk_frames)
    assert report.summary()["resumes"] == sum(len(result.resumes) for result in report.results) >= 1
    assert seen[-1] == (60, 60)
    with pytest.raises(ClientError, match="stream keys must be distinct, one per stream"):
        run_streams(["a:1"], codes[:2], stream_keys=["k", "k"], connect=network)


def test_catch_up_streams_send_every_frame_produced_while_a_request_was_out():
    """Paced with catch-up: after a slow answer (0.25 s) one request carries every frame produced meanwhile."""
    network = FakeNetwork("a:1")
    answer = network.servers["a:1"].infer

    def slow_infer(stream, request):
        time.sleep(0.25)  # the server's answer time, at least this long however fast the machine
        return answer(stream, request)

    network.servers["a:1"].infer = slow_infer
    (result,) = run_streams("a:1", [frame_codes(12)], StreamOptions(paced=True, catch_up=True), connect=network).results
    assert frames_heard(result.pcm) == list(range(12))
    assert result.chunk_frames[0] == 1 and sum(result.chunk_frames) == 12
    assert max(result.chunk_frames[1:]) >= 3 and len(result.chunk_frames) <= 6, result.chunk_frames
    with pytest.raises(ClientError, match="catch_up paces requests: it needs paced=True"):
        StreamOptions(catch_up=True).validate()


def cli_with_fake_run(monkeypatch, fake_run, checked: list | None = None):
    """The CLI module with `run_streams` replaced and a ready server (whose checked URLs go to `checked`)."""
    from mimi_code2wav.client import __main__ as cli

    checked = [] if checked is None else checked
    monkeypatch.setattr(cli, "Code2WavClient", lambda url, options, credentials=None: types.SimpleNamespace(
        check_ready=lambda: checked.append(url)))
    monkeypatch.setattr(cli, "run_streams", fake_run)
    return cli


def test_a_stream_that_gives_up_keeps_what_it_received_and_the_cli_writes_it(monkeypatch, capsys, tmp_path):
    """The server gone for good after four answers: StreamsFailed holds each stream's PCM so far, and
    `decode --out` writes those WAVs and says where each stream stopped."""
    network = FakeNetwork("a:1")
    server, answer = network.servers["a:1"], network.servers["a:1"].infer

    def answer_four(stream, request):
        if len(server.received) == 4:
            server.alive = False
        return answer(stream, request)

    server.infer = answer_four
    cli = cli_with_fake_run(monkeypatch, functools.partial(run_streams, connect=network))
    code = cli.main(["decode", "--url", "a:1", "--resume-timeout", "0.3", "--random", "--frames", "20", "--streams",
                     "2", "--no-progress", "--out", str(tmp_path / "call.wav")])
    err = capsys.readouterr().err
    assert code == 1 and "could not resume" in err
    stopped = []
    for index in range(2):
        pcm = read_wav(tmp_path / f"call_{index}.wav").samples[:, 0]
        stopped.append(pcm.size // SAMPLES_PER_FRAME)
        assert frames_heard(pcm) == random_codes(20, seed=0)[0, : stopped[-1]].tolist()  # the fake's PCM: code 0
        assert (f"stream {index} stopped at frame {stopped[-1]} of 20: wrote the {stopped[-1] * 0.08:.2f} s received "
                f"to {tmp_path / f'call_{index}.wav'}") in err
    assert sum(stopped) >= 4 and max(stopped) < 20, stopped  # four requests answered, of one frame or more


def test_decode_command_reports_each_resume_on_stderr(monkeypatch, capsys):
    from mimi_code2wav.client.plan import Resume
    from mimi_code2wav.client.report import RunReport, StreamResult

    given, checked = {}, []

    def fake_run(servers, streams_codes, options, stream_keys=None, progress=None, credentials=None):
        given.update(servers=servers, keys=stream_keys, options=options)
        frames = streams_codes[0].shape[1]
        results = [StreamResult(7 + i, frames, np.zeros(frames * SAMPLES_PER_FRAME, np.float32), [1, 2],
                                [0.01, 0.02], 0.0, 1.0, stream_key=key) for i, key in enumerate(stream_keys)]
        results[1].resumes.append(Resume(frame=2, stall_s=0.5, error="UNAVAILABLE: Socket closed", attempts=2,
                                         url="b:2", history_frames=2))
        return RunReport(results, options, 1.0)

    code = cli_with_fake_run(monkeypatch, fake_run, checked).main([
        "decode", "--url", "a:1", "--failover-url", "b:2", "--random", "--frames", "3", "--streams", "2",
        "--stream-key", "call", "--resume-history-frames", "25", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0
    assert checked == ["a:1"] and given["servers"] == ["a:1", "b:2"] and given["keys"] == ["call-0", "call-1"]
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
