"""The vLLM-Omni plugin against a real tritonserver. vLLM-Omni 0.30.0 runs in its own environment
(VLLM_OMNI_PYTHON, `make vllm-omni-venv`), where tests/vllm_omni_stage.py loads `TritonPersonaPlexCode2Wav`
as vLLM-Omni's registry does and drives it with the generation runner's arguments. Every request's PCM is
compared with moshi's streaming decode (stage 0 is not covered: it needs PersonaPlex's weights and a GPU)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.protocol import SAMPLE_RATE_HZ, SAMPLES_PER_FRAME, random_codes
from mimi_code2wav.export.reference import moshi_stream_decode
from mimi_code2wav.server.supervise import running_server

from helpers import REPO_ROOT, frames_of, make_pki, metric, wait_until
from mimi_fixtures import assert_equal_audio

pytestmark = [pytest.mark.server, pytest.mark.slow]

DRIVER = Path(__file__).with_name("vllm_omni_stage.py")
DEFAULT_PYTHON = REPO_ROOT / "build" / "vllm-omni-venv" / "bin" / "python"
# How long a server-side effect (an END landing, a killed server exiting) may take on a busy machine.
SETTLE_S = 60.0


def vllm_omni_python() -> Path:
    """The vLLM-Omni environment's interpreter, or a skip saying how to make it (a failure in CI)."""
    python = Path(os.environ.get("VLLM_OMNI_PYTHON") or DEFAULT_PYTHON)
    if python.is_file():
        return python
    reason = f"no vLLM-Omni environment at {python}: `make vllm-omni-venv` creates it"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(reason + "; CI runs the plugin's tests")
    pytest.skip(reason)


class Stage:
    """The driver process: one command, one answer (see tests/vllm_omni_stage.py)."""

    def __init__(self, python: Path, log: Path):
        self._log = open(log, "w")
        self.log_path = log
        self.process = subprocess.Popen([str(python), str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._log, text=True, cwd=REPO_ROOT)
        assert json.loads(self._read(300)) == {"ready": True}

    def _read(self, timeout_s: float) -> str:
        import selectors

        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        assert selector.select(timeout_s), f"the vLLM-Omni stage did not answer in {timeout_s} s; log {self.log_path}"
        line = self.process.stdout.readline()
        assert line, f"the vLLM-Omni stage exited: {self.log_path.read_text()[-3000:]}"
        return line

    def __call__(self, op: str, ok: bool = False, **command) -> dict:
        """The answer to a command (`ok`: which must succeed); a forward's PCM decoded."""
        self.process.stdin.write(json.dumps({"op": op, **command}) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self._read(300.0))
        assert not ok or "error" not in answer, answer
        if "pcm" in answer:
            answer["pcm"] = [np.frombuffer(base64.b64decode(pcm), np.float32) for pcm in answer["pcm"]]
        return answer

    def forward(self, *requests: tuple, ok: bool = False) -> dict:
        """requests: (request id, codes [8, F] or None, dummy)."""
        return self("forward", ok, requests=[{"id": rid, "codes": None if codes is None else np.asarray(codes).tolist(),
                                              "dummy": dummy} for rid, codes, dummy in requests])

    def pcm(self, request_id: str, codes: np.ndarray) -> np.ndarray:
        """The PCM of one request's step, which must succeed."""
        return self.forward((request_id, codes, False), ok=True)["pcm"][0]

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    driver = Stage(vllm_omni_python(), tmp_path_factory.mktemp("vllm-omni") / "stage.log")
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def code2wav_server(repository_for, triton_server_factory):
    """A python-ort server of this module's own: its live-stream gauge counts only the plugin's streams."""
    return triton_server_factory(repository_for("python-ort"))


@pytest.fixture
def model(stage, code2wav_server):
    """The stage's model on the module's server (tests before may have pointed it elsewhere)."""
    return stage("model", ok=True, config={"url": code2wav_server.grpc_url})


def moshi_decode(moshi_checkpoint, codes) -> np.ndarray:
    return moshi_stream_decode(moshi_checkpoint[1], np.asarray(codes)[None])[0]


def finish(stage, server, request_ids: list[str]) -> None:
    """on_requests_finished ENDs the streams, without waiting: the server's live-stream gauge goes back by one each."""
    live = metric(server, "code2wav_live_streams")
    assert stage("finish", ids=request_ids) == {}
    assert wait_until(lambda: metric(server, "code2wav_live_streams") == live - len(request_ids), SETTLE_S), metric(server, "code2wav_live_streams")


def test_the_registry_loads_the_subclass_which_loads_no_mimi(model, code2wav_server):
    assert model["class"] == "mimi_code2wav.vllm_plugin.code2wav.TritonPersonaPlexCode2Wav"
    assert model["bases"][1] == "PersonaPlexCode2Wav"
    assert model["weights"] == [] and model["settings"]["url"] == code2wav_server.grpc_url


def test_the_runners_call_shapes_give_each_request_its_audio(stage, model, code2wav_server, moshi_checkpoint):
    """Two requests interleaved in the runner's batches, of different frame counts, a warm-up and an empty
    request beside them, and a step with no input at all: every request's PCM equals moshi's."""
    a, b = random_codes(16, seed=101), random_codes(9, seed=102)
    baseline = metric(code2wav_server, "code2wav_live_streams")
    steps = [
        [("req-a", a[:, :1], False), ("req-b", b[:, :1], False)],
        [("req-a", a[:, 1:6], False), ("warmup", np.zeros((8, 1), np.int64), True), ("req-b", b[:, 1:6], False)],
        [("req-b", b[:, 6:9], False), ("req-a", a[:, 6:16], False), ("req-c", None, False)],
    ]
    heard = {"req-a": [], "req-b": []}
    for requests in steps:
        answer = stage.forward(*requests, ok=True)
        assert answer["sr"] == [SAMPLE_RATE_HZ] * len(requests) and set(answer["sr_dtypes"]) == {"torch.int32"}
        assert set(answer["dtypes"]) == {"torch.float32"}
        for (request_id, codes, dummy), pcm in zip(requests, answer["pcm"]):
            expected = 0 if dummy or codes is None else codes.shape[1] * SAMPLES_PER_FRAME
            assert pcm.size == expected, (request_id, pcm.size, expected)
            if request_id in heard:
                heard[request_id].append(pcm)
    assert metric(code2wav_server, "code2wav_live_streams") == baseline + 2
    empty = stage.forward()  # a step with no input at all: one empty output
    assert [pcm.size for pcm in empty["pcm"]] == [0] and empty["sr"] == [SAMPLE_RATE_HZ]
    finish(stage, code2wav_server, ["req-a", "req-b"])
    for request_id, codes in (("req-a", a), ("req-b", b)):
        assert_equal_audio(np.concatenate(heard[request_id]), moshi_decode(moshi_checkpoint, codes),
                           what=f"{request_id} through the plugin vs moshi")


def test_silence_deltas_come_back_whole(stage, model, code2wav_server, moshi_checkpoint):
    """1, 5, 5, 5, 3 frames of one repeated code, as stage 0 sends silence (docs/design.md §2.1): all equal moshi."""
    silence = np.repeat(random_codes(1, seed=103), 19, axis=1)
    bounds = [(0, 1), (1, 6), (6, 11), (11, 16), (16, 19)]
    chunks = [stage.pcm("silence", silence[:, first:stop]) for first, stop in bounds]
    finish(stage, code2wav_server, ["silence"])
    assert [chunk.size // SAMPLES_PER_FRAME for chunk in chunks] == [1, 5, 5, 5, 3]
    assert_equal_audio(np.concatenate(chunks), moshi_decode(moshi_checkpoint, silence), what="silence vs moshi")


def test_a_server_killed_mid_conversation_loses_no_frame(stage, repository_for, code2wav_server, moshi_checkpoint,
                                                         tmp_path):
    """Servers A then B; A is killed between steps. The conversation resumes on B with its whole history:
    every frame once, equal to moshi's uninterrupted decode."""
    codes = random_codes(40, seed=104)
    baseline = metric(code2wav_server, "code2wav_live_streams")
    with running_server(repository_for("python-ort"), log_path=tmp_path / "server-a.log") as server_a:
        urls = f"{server_a.grpc_url},{code2wav_server.grpc_url}"
        stage("model", ok=True, config={"url": urls, "response_timeout_s": 5.0})
        chunks = [stage.pcm("conversation", codes[:, first:stop]) for first, stop in [(0, 1), (1, 6), (6, 11), (11, 16)]]
        assert metric(server_a, "code2wav_live_streams") == 1
        os.killpg(server_a.pid, signal.SIGKILL)
        assert wait_until(lambda: not server_a.is_alive(), SETTLE_S)
        chunks += [stage.pcm("conversation", codes[:, first : first + 5]) for first in (16, 21, 26, 31, 36)]
        assert metric(code2wav_server, "code2wav_live_streams") == baseline + 1
        finish(stage, code2wav_server, ["conversation"])
    pcm = np.concatenate(chunks)
    assert pcm.size == 40 * SAMPLES_PER_FRAME, "a frame's audio is missing or repeated"
    reference = moshi_decode(moshi_checkpoint, codes)
    assert_equal_audio(frames_of(pcm, 0, 16), frames_of(reference, 0, 16), what="before the kill vs moshi")
    assert_equal_audio(frames_of(pcm, 16), frames_of(reference, 16), what="resumed with the whole history vs moshi")


def test_a_request_the_service_cannot_decode_fails_the_step_naming_it(stage):
    """No server: after resume_timeout_s `forward` raises naming the request and the cause, never answering
    silence. An unknown config key fails the model, naming the keys it knows."""
    from mimi_code2wav.server.triton import free_ports

    dead = f"127.0.0.1:{free_ports(1)[0]}"
    stage("model", ok=True, config={"url": dead, "resume_timeout_s": 1.0, "response_timeout_s": 1.0})
    answer = stage.forward(("lost", random_codes(1, seed=105), False))
    assert "pcm" not in answer
    assert answer["error"].startswith(f"RuntimeError: the code2wav service at {dead} could not decode: request lost: ")
    assert "could not resume" in answer["error"] and "within 1 s" in answer["error"]
    bad = stage("model", config={"url": dead, "response_timeout": 1.0})
    assert bad["error"] == ("ValueError: additional_config.code2wav: unknown key(s) response_timeout (known: url, model, "
                            "response_timeout_s, resume_timeout_s, resume_history_frames, tls, tls_ca, tls_cert, "
                            "tls_key, key_file)")


def test_the_stage_reaches_a_server_over_tls_with_the_key(stage, repository_for, moshi_checkpoint, tmp_path):
    """tls_ca and key_file: the stage decodes over TLS with the key, equal to moshi; a wrong key fails the
    step, saying so, without naming the key."""
    pki = make_pki(tmp_path)
    (pki / "key").write_text("stage-key-51d0b2\n")
    (pki / "wrong").write_text("not-the-key\n")
    access = tmp_path / "access"
    access.mkdir()
    for source, name in (("server.pem", "server.pem"), ("server.key", "server.key"), ("key", "inference.key")):
        shutil.copy(pki / source, access / name)
    codes = random_codes(11, seed=106)
    with running_server(repository_for("python-ort"), log_path=tmp_path / "tls.log", access_dir=access) as server:
        config = {"url": f"localhost:{server.grpc_port}", "tls_ca": str(pki / "ca.pem"), "key_file": str(pki / "key")}
        stage("model", ok=True, config=config)
        pcm = [stage.pcm("tls", codes[:, :1]), stage.pcm("tls", codes[:, 1:])]
        stage("finish", ids=["tls"])
        stage("model", ok=True, config={**config, "key_file": str(pki / "wrong")})
        refused = stage.forward(("refused", codes[:, :1], False))
    assert_equal_audio(np.concatenate(pcm), moshi_decode(moshi_checkpoint, codes), what="the stage over TLS vs moshi")
    assert "requires the inference key, and the key was missing or wrong" in refused["error"], refused
    assert "stage-key-51d0b2" not in refused["error"] and "not-the-key" not in refused["error"]


def test_the_overlay_command_writes_what_vllm_omni_loads(stage, tmp_path):
    """The README's command, in vLLM-Omni's environment: its overlay names the installed base config, and
    vLLM-Omni's own loader reads stage 0 as shipped, stage 1 with this plugin and the service's address."""
    out = tmp_path / "personaplex-triton.yaml"
    done = subprocess.run([str(vllm_omni_python()), "-m", "mimi_code2wav.vllm_plugin", "overlay", "--url",
                           "triton-host:8001", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    base = text.split("base_config: ", 1)[1].splitlines()[0]
    assert Path(base).is_file() and base.endswith("vllm_omni/deploy/personaplex.yaml")
    settings = {"url": "triton-host:8001", "response_timeout_s": 10, "resume_timeout_s": 30}
    assert stage("overlay", ok=True, path=str(out)) == {"stages": [0, 1], "model_arch": "TritonPersonaPlexCode2Wav",
                                                        "stage0_max_num_seqs": 10,  # as in the base config
                                                        "additional_config": {"code2wav": settings}}
    # The template in deploy/ is the same text, with a placeholder base path.
    template = (REPO_ROOT / "deploy" / "vllm-omni" / "personaplex-triton.yaml").read_text()
    assert template == text.replace(base, "/path/to/site-packages/vllm_omni/deploy/personaplex.yaml").replace(
        "triton-host:8001", "127.0.0.1:8001")
