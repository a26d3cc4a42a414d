"""server/triton-watchdog.sh, the entrypoint every server runs under (serve, compose, Kubernetes),
around the real tritonserver: a hung server (SIGSTOP) or one with a dead Python stub is killed and the
script exits 137; a loading server is left alone; the access folder becomes tritonserver's flags.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from test_server_launcher import infer_add_one, write_model

from mimi_code2wav.server.processes import process_group_alive
from mimi_code2wav.server.triton import TritonServer

from helpers import REPO_ROOT, make_pki, metric, process_exists, stub_pid, wait_until

pytestmark = pytest.mark.server

WATCHDOG = REPO_ROOT / "server" / "triton-watchdog.sh"
# A health check every 0.2 s, a hang after 3 unanswered within 0.5 s; a stub probe every second.
FAST = {"WATCHDOG_INTERVAL_S": "0.2", "WATCHDOG_TIMEOUT_S": "0.5", "WATCHDOG_CHECKS": "3", "WATCHDOG_PROBE_S": "1",
        "WATCHDOG_PROBE_TIMEOUT_S": "10"}
RESTRICT = ("grpc-restricted-protocol", "http-restricted-api")


@contextlib.contextmanager
def watched(repository: Path, log: Path, **kwargs):
    """A ready tritonserver under the entrypoint with its checks and probes on, as compose starts it,
    with fast settings; stopped on the way out, leaving no process."""
    server = TritonServer(repository, log_path=log, watch=True, watch_env=FAST, **kwargs)
    try:
        server.start()
        server.wait_ready()
        yield server
    finally:
        server.stop(grace_s=5)
    assert wait_until(lambda: not process_group_alive(server.pid), 30), "the watchdog left a process behind"


def watchdog(access_dir: Path, *command: str, **env: str) -> subprocess.CompletedProcess:
    """The script run here on `command`, with `access_dir` as its access folder."""
    return subprocess.run(["sh", str(WATCHDOG), *command], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "WATCHDOG_ACCESS_DIR": str(access_dir), **env})


def test_a_loading_server_is_left_alone_and_a_hung_one_killed_and_the_watchdog_exits_137(tmp_path):
    """The model takes 3 s to load: the endpoints are not up (refused connections) for longer than the
    watchdog's 3 checks of 0.5 s, which must not count as a hang; a server that stops answering does.
    (SIGTERM drains it and the script exits 0: serve's SIGHUP in test_server_launcher.)"""
    log = tmp_path / "server.log"
    with watched(write_model(tmp_path / "repo", initialize="import time\ntime.sleep(3)"), log) as server:
        infer_add_one(server.grpc_url)
        triton = server.tritonserver_pid()
        time.sleep(0.8)  # four health checks
        assert server.is_alive() and "triton-watchdog: tritonserver" not in log.read_text(), log.read_text()[-2000:]
        os.kill(triton, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # 3 unanswered checks in a row, each up to 0.5 s after a 0.2 s pause: about 2 s.
        assert wait_until(lambda: not server.is_alive(), 60), "still running 60 s after the hang"
        print(f"hang found and the server killed {time.monotonic() - stopped_at:.1f} s after SIGSTOP")
        assert server.exit_code() == 128 + signal.SIGKILL
        assert not process_exists(triton)
    text = log.read_text()
    assert f"triton-watchdog: tritonserver (pid {triton}) answered no health check" in text, text[-2000:]
    assert "3 times in a row: hung; killing it (SIGKILL)" in text


def test_a_dead_stub_gets_the_server_killed_and_tls_and_keys_come_from_the_access_folder(repository_for, tmp_path):
    """A code2wav stub that died (SIGKILL stands in for its segfault) leaves the server answering ready
    while every request fails: the watchdog's probe finds it and kills the server, for the restart policy
    (the pod's liveness probe asks only /v2/health/live). With the files of WATCHDOG_ACCESS_DIR (as
    compose mounts CODE2WAV_ACCESS_DIR, and the Kubernetes pods the Secret code2wav-access), TLS and both
    keys are on: a client with the CA and the key decodes (the refusals: test_security.py), the probe carries
    the key, and no key shows in the log. (Without an access folder: serve's restarts in test_server_launcher;
    the GPU servers' and pods' command around the watchdog: test_compose.py.)"""
    from mimi_code2wav.client.credentials import Credentials
    from mimi_code2wav.client.sync import run_streams

    log, access = tmp_path / "server.log", make_pki(tmp_path / "access")
    (access / "inference.key").write_text("watched-inference-key\n")
    (access / "admin.key").write_text(" watched-admin-key \n")
    with watched(repository_for("null"), log, access_dir=access) as server:
        url = f"localhost:{server.grpc_port}"
        good = Credentials(tls_ca=str(access / "ca.pem"), key="watched-inference-key")
        assert run_streams(url, [np.zeros((8, 4), np.int64)], credentials=good).results[0].pcm.size == 4 * 1920
        triton = server.tritonserver_pid()
        # Two probes reach the decoder, with the key, and leave the server alone.
        probes = metric(server, "nv_inference_request_success", model="mimi_decoder")  # the watchdog's probes
        assert wait_until(lambda: metric(server, "nv_inference_request_success", model="mimi_decoder") >= probes + 2, 60, poll_s=0.5), "no probe reached the decoder"
        assert server.is_alive(), f"a healthy server was killed:\n{log.read_text()[-2000:]}"
        os.kill(stub_pid(server.pid), signal.SIGKILL)
        killed_at = time.monotonic()
        assert wait_until(lambda: not server.is_alive(), 90), "the dead stub went unnoticed"
        print(f"dead stub found and the server killed {time.monotonic() - killed_at:.1f} s after the stub's death")
        assert server.exit_code() == 128 + signal.SIGKILL
    text = log.read_text()
    assert f"triton-watchdog: tritonserver (pid {triton}) answers, but a Python stub is dead" in text, text[-2000:]
    assert "Stub process 'code2wav_0_0' is not healthy" in text, text[-2000:]
    assert (f"triton-watchdog: access: TLS on gRPC, inference key required, admin key required (from {access})"
            in text), text[:2000]
    assert "watched-inference-key" not in text and "watched-admin-key" not in text


FLAG_CASES = [
    pytest.param({"server.pem", "server.key"}, ["--grpc-use-ssl=true", "--grpc-server-cert={d}/server.pem",
                 "--grpc-server-key={d}/server.key"], "TLS on gRPC, no inference key, admin calls open", id="tls"),
    pytest.param({"server.pem", "server.key", "client-ca.pem"},
                 ["--grpc-use-ssl-mutual=true", "--grpc-server-cert={d}/server.pem", "--grpc-server-key={d}/server.key",
                  "--grpc-root-cert={d}/client-ca.pem"], "mutual TLS on gRPC, no inference key, admin calls open",
                 id="mutual"),
    pytest.param({"inference.key"}, [f"--{flag}=inference,metadata,model-config,model-repository,shared-memory,"
                                     "statistics,trace,logging:code2wav-key=K1" for flag in RESTRICT],
                 "plaintext gRPC, inference key required, admin calls take the inference key", id="inference"),
    pytest.param({"inference.key", "admin.key"},
                 [f"--{flag}=inference,metadata,model-config:code2wav-key=K1" for flag in RESTRICT]
                 + [f"--{flag}=model-repository,shared-memory,statistics,trace,logging:code2wav-admin-key=K2"
                    for flag in RESTRICT],
                 "plaintext gRPC, inference key required, admin key required", id="both-keys"),
    pytest.param({"admin.key"}, [f"--{flag}=model-repository,shared-memory,statistics,trace,logging:"
                                 "code2wav-admin-key=K2" for flag in RESTRICT],
                 "plaintext gRPC, no inference key, admin key required", id="admin"),
]


@pytest.mark.parametrize("files, flags, access", FLAG_CASES)
def test_the_access_folder_becomes_tritonservers_flags(tmp_path, files, flags, access):
    """Each file of the access folder turns on what it names, with Triton's flags: the protocol groups,
    the headers and the keys (the only place they are mapped)."""
    keys = {"inference.key": "K1", "admin.key": "K2"}
    for name in files:
        (tmp_path / name).write_text(f" {keys.get(name, 'pem')} \n")
    done = watchdog(tmp_path, "sh", "-c", 'echo "$@"; exit 3', "sh", WATCHDOG_CHECKS="0", WATCHDOG_PROBE_S="0")
    assert done.returncode == 3, done.stderr  # the command's own exit code comes back
    assert sorted(done.stdout.split()) == sorted(flag.format(d=tmp_path) for flag in flags)
    assert f"triton-watchdog: access: {access} (from {tmp_path})" in done.stderr


@pytest.mark.parametrize("files, error", [
    pytest.param({}, "usage: triton-watchdog.sh COMMAND", id="no-command"),
    pytest.param({"WATCHDOG_CHECKS": "-1"}, "WATCHDOG_CHECKS must be a whole number, got '-1'", id="checks"),
    pytest.param({"WATCHDOG_PROBE_S": "x"}, "WATCHDOG_PROBE_S must be a whole number of seconds, got 'x'", id="probe"),
    pytest.param({"client-ca.pem": "x"}, "mutual TLS (client-ca.pem) needs TLS", id="mutual-without-tls"),
    pytest.param({"server.pem": "x"}, "TLS needs both server.pem and server.key in {d}", id="half-a-certificate"),
    pytest.param({"inference.key": "two words"}, "inference.key must hold one key", id="two-words"),
    pytest.param({"inference.key": "a:b"}, "inference.key must hold one key: not empty, without whitespace, ',', ':' "
                 "or '='", id="separator"),
    pytest.param({"admin.key": ""}, "admin.key must hold one key", id="empty"),
    pytest.param({"inference.key": "same", "admin.key": "same"}, "admin.key must differ from inference.key",
                 id="same-keys"),
])
def test_the_watchdog_refuses_bad_settings_and_what_no_server_can_run(tmp_path, files, error):
    """Settings (WATCHDOG_*) and the access folder's files it cannot run with: exit code 2, saying why,
    quoting no key."""
    for name, text in files.items():
        if not name.startswith("WATCHDOG_"):
            (tmp_path / name).write_text(text + "\n")
    settings = {name: text for name, text in files.items() if name.startswith("WATCHDOG_")}
    done = watchdog(tmp_path, *([] if "usage" in error else ["true"]), **settings)
    assert done.returncode == 2 and error.format(d=tmp_path) in done.stderr, done.stderr
    assert "a:b" not in done.stderr, "a key was quoted"
