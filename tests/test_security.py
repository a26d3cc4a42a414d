"""TLS and the keys (docs/design.md §5.3) on real tritonservers, with certificates made here by openssl: one
python-ort server with TLS and both keys, one null server with mutual TLS and a key (module scope). Every refusal
leaves the server serving and a stream in progress exact; no secret shows in a log, an error or serve's output.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.aio import Code2WavClient as AsyncClient
from mimi_code2wav.client.credentials import GRPC_RESTRICTED_PREFIX, KEY_ENV, Credentials
from mimi_code2wav.client.protocol import SAMPLES_PER_FRAME, ClientError, StreamOptions
from mimi_code2wav.client.sync import Code2WavClient, run_streams
from mimi_code2wav.client.wav import read_wav
from mimi_code2wav.server.security import ADMIN_KEY_ENV

from helpers import (
    REPO_ROOT,
    make_pki,
    perf_analyzer_problem,
    serve_cli,
    stop_cli,
    stub_pid,
    tritonserver_under,
    wait_printed,
)
from mimi_fixtures import assert_equal_audio

pytestmark = pytest.mark.server

INFERENCE_KEY = "inference-0f6a4c2d9b7e41d3"
ADMIN_KEY = "admin-7c1e5b3a9d2f48e6"


def no_secret(text: str | bytes) -> bool:
    return not any((key.encode() if isinstance(text, bytes) else key) in text for key in (INFERENCE_KEY, ADMIN_KEY))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    folder = make_pki(tmp_path_factory.mktemp("pki"))
    (folder / "inference.key").write_text(INFERENCE_KEY + "\n")
    (folder / "admin.key").write_text(ADMIN_KEY + "\n")
    (folder / "wrong.key").write_text("not-the-key\n")
    return folder


def access_folder(folder: Path, pki: Path, *names: str) -> Path:
    """An access folder (the entrypoint's TLS and keys) of the pki's files `names`."""
    folder.mkdir()
    for name in names:
        shutil.copy(pki / {"client-ca.pem": "ca.pem"}.get(name, name), folder / name)
    return folder


@pytest.fixture(scope="module")
def secure_server(pki, served_repository, triton_server_factory, tmp_path_factory):
    """python-ort over TLS, with an inference key and an admin key."""
    access = access_folder(tmp_path_factory.mktemp("secure") / "access", pki, "server.pem", "server.key",
                           "inference.key", "admin.key")
    return triton_server_factory(served_repository, access_dir=access)


@pytest.fixture(scope="module")
def mutual_server(pki, repository_for, triton_server_factory, tmp_path_factory):
    """The null decoder over mutual TLS, with an inference key."""
    access = access_folder(tmp_path_factory.mktemp("mutual") / "access", pki, "server.pem", "server.key",
                           "client-ca.pem", "inference.key")
    return triton_server_factory(repository_for("null"), access_dir=access)


def _good(pki: Path, **overrides) -> Credentials:
    return Credentials(**{"tls_ca": str(pki / "ca.pem"), "key": INFERENCE_KEY, **overrides})


def _refusal(url: str, credentials: Credentials) -> str:
    with pytest.raises(ClientError) as refused:
        Code2WavClient(url, credentials=credentials).check_ready(timeout_s=5)
    message = str(refused.value)
    assert "\n" not in message and no_secret(message), message
    return message


def test_every_bad_credential_is_refused_with_its_own_message_and_a_live_stream_stays_exact(
        secure_server, pki, scenario, moshi_streams):
    """Half a stream, each wrong credential refused at check_ready saying which, the rest: equal to moshi."""
    url = secure_server.grpc_url
    codes, reference = scenario.streams["A"], moshi_streams["A"]
    half = codes.shape[1] // 2
    cases = {  # case: (credentials, what its refusal says)
        "plaintext": (Credentials(), "it expects TLS"),
        "another CA": (_good(pki, tls_ca=str(pki / "rogue-ca.pem")),
                       f"certificate is not trusted: it is not signed by the CA in {pki / 'rogue-ca.pem'}"),
        "system CAs": (_good(pki, tls_ca=None, tls=True), "not signed by the system's CAs (give --tls-ca)"),
        "no key": (_good(pki, key=None), f"Triton at {url} requires the inference key (header code2wav-key), and none "
                   f"was given: give it with --key-file or ${KEY_ENV}"),
        "wrong key": (_good(pki, key="not-the-key"),
                      f"Triton at {url} refused the inference key given (header code2wav-key): wrong key"),
    }
    with Code2WavClient(url, credentials=_good(pki)).stream() as stream:
        first = stream.decode(codes[:, :half])
        refusals = {case: _refusal(url, credentials) for case, (credentials, _) in cases.items()}
        second = stream.decode(codes[:, half:], end=True)
    Code2WavClient(url, credentials=_good(pki)).check_ready(timeout_s=5)  # good credentials still pass
    assert not stream.resumes, [r.describe() for r in stream.resumes]
    for case, (_, says) in cases.items():
        print(f"{case}: {refusals[case]}")
        # A key's refusal is the whole message; TLS's name gRPC's reason too.
        assert refusals[case] == says if case.endswith("key") else says in refusals[case], (case, refusals[case])
    assert_equal_audio(np.concatenate([first, second]), reference, what="a TLS stream around the refusals vs moshi")


def test_a_tls_client_of_a_plaintext_server_is_told_so(code2wav_server, pki):
    message = _refusal(code2wav_server.grpc_url, Credentials(tls_ca=str(pki / "ca.pem")))
    assert "the server does not speak TLS on this port" in message, message


def test_a_request_with_a_wrong_key_fails_at_once_and_is_not_resumed(secure_server, pki, scenario):
    """Triton refuses a restricted call with UNAVAILABLE, as from a lost server: the stream fails, not resumes."""
    options = StreamOptions(resume_timeout_s=30.0)
    began = time.monotonic()
    with pytest.raises(ClientError, match="requires the inference key, and the key was missing or wrong"):
        with Code2WavClient(secure_server.grpc_url, options, credentials=_good(pki, key="not-the-key")).stream() as stream:
            stream.decode(scenario.streams["A"][:, :2])
    assert time.monotonic() - began < 20, "the refused stream was retried as a resume"


def test_with_tls_and_the_key_asyncio_streams_equal_moshi(secure_server, pki, scenario, moshi_streams):
    names = list(scenario.streams)

    async def conversation(client: AsyncClient, codes: np.ndarray) -> np.ndarray:
        async with client.stream() as stream:
            return np.concatenate([await stream.decode(codes[:, i : i + 5]) for i in range(0, codes.shape[1], 5)])

    async def run() -> list[np.ndarray]:
        async with AsyncClient(secure_server.grpc_url, credentials=_good(pki)) as client:
            await client.check_ready()
            return await asyncio.gather(*(conversation(client, scenario.streams[n]) for n in names))

    for name, pcm in zip(names, asyncio.run(run())):
        assert_equal_audio(pcm, moshi_streams[name], what=f"{name}: asyncio over TLS with the key vs moshi")


def test_admin_calls_need_the_admin_key_and_health_needs_none(secure_server, pki):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    inference = {GRPC_RESTRICTED_PREFIX + "code2wav-key": INFERENCE_KEY}
    admin = {GRPC_RESTRICTED_PREFIX + "code2wav-admin-key": ADMIN_KEY}
    with grpcclient.InferenceServerClient(secure_server.grpc_url, ssl=True, root_certificates=str(pki / "ca.pem")) as client:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("code2wav")
        for call in (lambda h: client.get_model_repository_index(headers=h),
                     lambda h: client.get_inference_statistics("code2wav", headers=h),
                     lambda h: client.get_log_settings(headers=h),
                     lambda h: client.get_system_shared_memory_status(headers=h)):
            for headers in (None, inference):
                with pytest.raises(InferenceServerException, match="restricted, expecting header "
                                   "'triton-grpc-protocol-code2wav-admin-key'"):
                    call(headers)
            assert call(admin) is not None
        with pytest.raises(InferenceServerException, match="expecting header 'triton-grpc-protocol-code2wav-key'"):
            client.get_model_metadata("code2wav", headers=admin)
        assert client.get_model_metadata("code2wav", headers=inference).name == "code2wav"
    http = f"http://{secure_server.http_url}"
    assert secure_server.http_url.startswith("127.0.0.1:")
    assert urllib.request.urlopen(f"{http}/v2/health/ready", timeout=5).status == 200
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{http}/v2/models/code2wav", timeout=5)
    assert refused.value.code == 403 and "expecting header 'code2wav-key'" in refused.value.read().decode()
    request = urllib.request.Request(f"{http}/v2/models/code2wav", headers={"code2wav-key": INFERENCE_KEY})
    assert urllib.request.urlopen(request, timeout=5).status == 200


def test_mutual_tls_requires_a_client_certificate_of_its_ca(mutual_server, pki):
    url = mutual_server.grpc_url
    for rogue in ({}, {"tls_cert": str(pki / "rogue-client.pem"), "tls_key": str(pki / "rogue-client.key")}):
        assert ("it requires a client certificate (mutual TLS: --tls-cert and --tls-key) from a CA it trusts"
                in _refusal(url, _good(pki, **rogue)))
    client_cert = {"tls_cert": str(pki / "client.pem"), "tls_key": str(pki / "client.key")}
    Code2WavClient(url, credentials=_good(pki, **client_cert)).check_ready(timeout_s=5)
    report = run_streams(url, [np.zeros((8, 6), np.int64)], credentials=_good(pki, **client_cert))
    assert report.results[0].pcm.shape == (6 * SAMPLES_PER_FRAME,)


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mimi_code2wav.client", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_the_cli_takes_tls_and_the_key_from_a_file_or_the_environment(secure_server, pki, scenario, moshi_streams,
                                                                     tmp_path):
    codes = tmp_path / "a.npy"
    np.save(codes, scenario.streams["A"])
    tls = ["--url", secure_server.grpc_url, "--tls-ca", str(pki / "ca.pem")]
    for where, key, env in (("a file", ["--key-file", str(pki / "inference.key")], {}),
                            ("the environment", [], {KEY_ENV: INFERENCE_KEY})):
        done = _cli("decode", *tls, *key, "--codes", str(codes), "--out", str(tmp_path / "out.wav"), env=env)
        assert done.returncode == 0, done.stderr
        assert_equal_audio(read_wav(tmp_path / "out.wav").samples[:, 0], moshi_streams["A"], what=f"CLI, key from {where}")
    refused = _cli("decode", *tls, "--key-file", str(pki / "wrong.key"), "--random", "--frames", "3", env={KEY_ENV: ""})
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        f"error: Triton at {secure_server.grpc_url} refused the inference key given (header code2wav-key): wrong key"]
    missing = _cli("decode", *tls, "--key-file", str(tmp_path / "absent.key"), "--random", "--frames", "3")
    assert missing.returncode == 1 and f"cannot read the key file {tmp_path / 'absent.key'}" in missing.stderr


def test_the_duplex_benchmark_measures_a_server_with_tls_and_the_key(secure_server, pki, tmp_path, capsys):
    """With the CA and the key it measures every point; without the key it stops with the refusal, no secret."""
    from benchmarks.__main__ import main

    url = f"localhost:{secure_server.grpc_port}"
    common = ["duplex", "--url", url, "--conversations", "2", "--policies", "per-frame", "--seconds", "0.8",
              "--budget-ms", "10000", "--compare-at", "2", "--tls-ca", str(pki / "ca.pem")]
    assert main([*common, "--key-file", str(pki / "inference.key"), "--out-dir", str(tmp_path / "ok")]) == 0
    results = json.loads((tmp_path / "ok" / "duplex.json").read_text())
    assert [(p["conversations"], p["failed"]) for p in results["points"]] == [(2, None)]
    assert no_secret(json.dumps(results))
    capsys.readouterr()
    assert main([*common, "--out-dir", str(tmp_path / "refused")]) == 1
    err = capsys.readouterr().err
    assert "requires the inference key (header code2wav-key)" in err and no_secret(err), err


def test_perf_analyzer_runs_over_tls_with_both_keys(secure_server, pki, tmp_path):
    """client/perf.sh with TLS_CA, KEY_FILE and ADMIN_KEY_FILE (perf_analyzer reads statistics, an admin call);
    without the admin key it is refused, naming the header."""
    if problem := perf_analyzer_problem():
        pytest.skip(problem)
    env = {**os.environ, "URL": f"localhost:{secure_server.grpc_port}", "STREAMS": "2", "FRAMES": "9",
           "BUILD_DIR": str(tmp_path / "perf"), "CSV": str(tmp_path / "perf.csv"), "PYTHON": sys.executable,
           "TLS_CA": str(pki / "ca.pem"), "KEY_FILE": str(pki / "inference.key")}

    def perf(**extra) -> subprocess.CompletedProcess:
        return subprocess.run([str(REPO_ROOT / "client" / "perf.sh"), "--concurrency-range", "2", "--request-count", "12"],
                              env={**env, **extra}, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)

    done = perf(ADMIN_KEY_FILE=str(pki / "admin.key"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "mimi_decoder" in done.stdout and (tmp_path / "perf.csv").is_file()
    refused = perf()
    assert refused.returncode != 0
    assert "expecting header 'triton-grpc-protocol-code2wav-admin-key'" in refused.stdout + refused.stderr
    assert no_secret(done.stdout + done.stderr)


def test_serve_with_tls_and_keys_restarts_a_dead_stub_and_a_tls_stream_resumes(pki, repository_for, tmp_path):
    """`serve` with TLS and both keys (from the environment): the banner names no secret; the stub probe carries
    the key, so a dead stub is found and the server restarted; a resumable TLS stream resumes, losing no frame."""
    log = tmp_path / "server.log"
    env = {**os.environ, KEY_ENV: INFERENCE_KEY, ADMIN_KEY_ENV: ADMIN_KEY}
    args = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")]
    with serve_cli(repository_for("null"), log, *args, env=env) as (cli, (_, grpc_port, _), out):
        assert "access   TLS on gRPC, inference key required, admin key required" in out.read_text()
        url = f"localhost:{grpc_port}"
        stream = Code2WavClient(url, StreamOptions(resume_timeout_s=60.0), credentials=_good(pki)).stream()
        before = stream.decode(np.zeros((8, 10), np.int64))
        for restart in range(1, 4):  # tritonserver 2.51 itself may abort on a dead stub before the probe finds it
            os.kill(stub_pid(tritonserver_under(cli.pid), "code2wav"), signal.SIGKILL)
            wait_printed(cli, out, f"restart {restart})", timeout_s=120)  # once ready
            if "answers, but a Python stub is dead" in Path(f"{log}.{restart}").read_text():
                break
        after = stream.decode(np.zeros((8, 10), np.int64), end=True)
        output = stop_cli(cli, out)
    assert cli.returncode == 0, output
    assert "answers, but a Python stub is dead" in Path(f"{log}.{restart}").read_text(), output
    assert before.size + after.size == 20 * SAMPLES_PER_FRAME and len(stream.resumes) == 1, stream.resumes
    for text in (output, *(path.read_text() for path in tmp_path.glob("server.log*"))):
        assert no_secret(text), text[-2000:]


def test_no_secret_in_the_servers_logs_or_repositories(secure_server, mutual_server):
    """Runs last in this module: the logs hold every refusal above; every file served is read as bytes."""
    for server in (secure_server, mutual_server):
        assert no_secret(Path(server.log_path).read_text()), server.log_path
        for path in Path(server.model_repository).rglob("*"):
            assert not path.is_file() or no_secret(path.read_bytes()), path
