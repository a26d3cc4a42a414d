"""server/triton-watchdog.sh, the entrypoint every server runs under (serve, compose, Kubernetes),
around the real tritonserver.

A server that stops answering its health checks (SIGSTOP stands in for a hang) is killed and the
script exits 137, for the container's restart policy; a server still loading is left alone; SIGTERM
reaches tritonserver, which drains and exits 0, and so does the script.
"""

from __future__ import annotations

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

from helpers import REPO_ROOT, make_pki, process_exists, stub_pid, wait_until

pytestmark = pytest.mark.server

WATCHDOG = REPO_ROOT / "server" / "triton-watchdog.sh"
INTERVAL_S, TIMEOUT_S, CHECKS = 0.2, 0.5, 3
PROBE_S, PROBE_TIMEOUT_S = 1, 10
RESTRICT = ("grpc-restricted-protocol", "http-restricted-api")


class WatchedServer(TritonServer):
    """tritonserver under the entrypoint with its checks and probes on, as compose starts it, with fast
    settings; with `pod_args_file`, through the Kubernetes pod's command, which appends that file's
    flags as it appends /models/tritonserver.args."""

    def __init__(self, *args, pod_args_file: Path | None = None, **kwargs):
        super().__init__(*args, watch=True, watch_env={
            "WATCHDOG_INTERVAL_S": str(INTERVAL_S), "WATCHDOG_TIMEOUT_S": str(TIMEOUT_S), "WATCHDOG_CHECKS": str(CHECKS),
            "WATCHDOG_PROBE_S": str(PROBE_S), "WATCHDOG_PROBE_TIMEOUT_S": str(PROBE_TIMEOUT_S)}, **kwargs)
        self.pod_args_file = pod_args_file

    def _entrypoint(self, command: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        watched, env = super()._entrypoint(command, env)
        if self.pod_args_file is None:
            return watched, env
        start = [arg.replace("$$", "$") for arg in kubernetes_triton()["command"]]
        assert start[:3] == ["/opt/nvidia/nvidia_entrypoint.sh", "sh", "-c"]  # NGC's entrypoint runs its command
        return [*start[1:3], start[3].replace("/models/tritonserver.args", str(self.pod_args_file)), *start[4:],
                *watched], env


def kubernetes_triton() -> dict:
    """The triton container of deploy/kubernetes/code2wav-triton.yaml's pods."""
    import yaml

    manifests = yaml.safe_load_all((REPO_ROOT / "deploy" / "kubernetes" / "code2wav-triton.yaml").read_text())
    (pod,) = [m["spec"]["template"]["spec"] for m in manifests if m and m.get("kind") == "Deployment"]
    (triton,) = [c for c in pod["containers"] if c["name"] == "triton"]
    return triton


def test_a_hung_server_is_killed_and_the_watchdog_exits_137(tmp_path):
    log = tmp_path / "server.log"
    server = WatchedServer(write_model(tmp_path / "repo"), log_path=log)
    try:
        server.start_ready()
        infer_add_one(server.grpc_url)
        triton = server.tritonserver_pid()
        time.sleep(4 * INTERVAL_S)
        assert server.is_alive(), f"a healthy server was killed:\n{log.read_text()[-2000:]}"
        os.kill(triton, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # CHECKS unanswered checks in a row, each up to TIMEOUT_S after an INTERVAL_S pause.
        bound_s = CHECKS * (INTERVAL_S + TIMEOUT_S) + 5.0
        assert wait_until(lambda: not server.is_alive(), bound_s), f"still running {bound_s:.0f} s after the hang"
        found_after_s = time.monotonic() - stopped_at
        assert server.exit_code() == 128 + signal.SIGKILL
        assert not process_exists(triton)
        text = log.read_text()
        assert f"triton-watchdog: tritonserver (pid {triton}) answered no health check" in text, text[-2000:]
        assert "3 times in a row: hung; killing it (SIGKILL)" in text
        print(f"hang found and the server killed {found_after_s:.1f} s after SIGSTOP")
    finally:
        server.stop(grace_s=5)
    assert not process_group_alive(server.pid), "the watchdog left a process behind"


def test_a_dead_stub_gets_the_server_killed_and_the_watchdog_exits_137(repository_for, tmp_path):
    """A code2wav stub that died (SIGKILL stands in for its segfault): the server still answers ready,
    every request fails; the watchdog's probe finds it and kills the server, for the restart policy."""
    log = tmp_path / "server.log"
    server = WatchedServer(repository_for("null"), log_path=log)
    try:
        server.start_ready()
        time.sleep(3 * PROBE_S)
        assert server.is_alive(), f"a healthy server was killed:\n{log.read_text()[-2000:]}"
        triton = server.tritonserver_pid()
        os.kill(stub_pid(server.pid), signal.SIGKILL)
        killed_at = time.monotonic()
        assert wait_until(lambda: not server.is_alive(), 2 * (PROBE_S + PROBE_TIMEOUT_S)), "the dead stub went unnoticed"
        found_after_s = time.monotonic() - killed_at
        assert server.exit_code() == 128 + signal.SIGKILL
        text = log.read_text()
        assert f"triton-watchdog: tritonserver (pid {triton}) answers, but a Python stub is dead" in text, text[-2000:]
        assert "Stub process 'code2wav_0_0' is not healthy" in text, text[-2000:]
        print(f"dead stub found and the server killed {found_after_s:.1f} s after the stub's death")
    finally:
        server.stop(grace_s=5)
    assert wait_until(lambda: not process_group_alive(server.pid), 5.0), "the watchdog left a process behind"


@pytest.mark.parametrize("start", ["compose", "kubernetes"])
def test_tls_and_keys_come_from_the_access_folder_and_the_stub_probe_carries_the_key(repository_for, tmp_path, start):
    """The files of WATCHDOG_ACCESS_DIR (as compose mounts CODE2WAV_ACCESS_DIR, and the Kubernetes pods
    the Secret code2wav-access) turn on TLS and both keys; a client with the CA and the key decodes, one
    without the key is refused; the stub probe sends the key, so a dead stub is still found, and the
    server killed (the pod's liveness probe asks only /v2/health/live); no key shows in the log."""
    from mimi_code2wav.client.credentials import Credentials
    from mimi_code2wav.client.protocol import ClientError
    from mimi_code2wav.client.sync import Code2WavClient, run_streams

    access = make_pki(tmp_path / "access")
    (access / "inference.key").write_text("watched-inference-key\n")
    (access / "admin.key").write_text(" watched-admin-key \n")
    log = tmp_path / "server.log"
    pod_args_file = None
    if start == "kubernetes":
        assert kubernetes_triton()["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
        pod_args_file = tmp_path / "tritonserver.args"
        pod_args_file.write_text("--log-info=true\n")
    server = WatchedServer(repository_for("null"), log_path=log, access_dir=access, pod_args_file=pod_args_file)
    try:
        server.start_ready()
        url = f"localhost:{server.grpc_port}"
        good = Credentials(tls_ca=str(access / "ca.pem"), key="watched-inference-key")
        assert run_streams(url, [np.zeros((8, 4), np.int64)], credentials=good).results[0].pcm.size == 4 * 1920
        with pytest.raises(ClientError, match="requires the inference key"):
            Code2WavClient(url, credentials=Credentials(tls_ca=str(access / "ca.pem"))).check_ready(timeout_s=5)
        with pytest.raises(ClientError, match="it expects TLS"):
            Code2WavClient(url).check_ready(timeout_s=5)
        if start == "kubernetes":  # the pod's command appended the rendered flags
            assert "--log-info=true" in Path(f"/proc/{server.tritonserver_pid()}/cmdline").read_text().split("\0")
        time.sleep(3 * PROBE_S)
        assert server.is_alive(), f"the probe without its key? a healthy server was killed:\n{log.read_text()[-2000:]}"
        os.kill(stub_pid(server.pid), signal.SIGKILL)
        assert wait_until(lambda: not server.is_alive(), 2 * (PROBE_S + PROBE_TIMEOUT_S)), "the dead stub went unnoticed"
        text = log.read_text()
        assert (f"triton-watchdog: access: TLS on gRPC, inference key required, admin key required (from {access})"
                in text), text[:2000]
        assert "answers, but a Python stub is dead" in text, text[-2000:]
        assert "watched-inference-key" not in text and "watched-admin-key" not in text
    finally:
        server.stop(grace_s=5)


def test_the_access_folder_refuses_half_a_certificate_and_a_bad_key(tmp_path):
    (tmp_path / "server.pem").write_text("x")
    done = subprocess.run(["sh", str(WATCHDOG), "true"], capture_output=True, text=True, timeout=10,
                          env={**os.environ, "WATCHDOG_ACCESS_DIR": str(tmp_path)})
    assert done.returncode == 2 and f"TLS needs both server.pem and server.key in {tmp_path}" in done.stderr
    (tmp_path / "server.pem").unlink()
    (tmp_path / "inference.key").write_text("two words\n")
    done = subprocess.run(["sh", str(WATCHDOG), "true"], capture_output=True, text=True, timeout=10,
                          env={**os.environ, "WATCHDOG_ACCESS_DIR": str(tmp_path)})
    assert done.returncode == 2 and "must hold one key" in done.stderr, done.stderr
    (tmp_path / "inference.key").write_text("a:b\n")
    done = subprocess.run(["sh", str(WATCHDOG), "true"], capture_output=True, text=True, timeout=10,
                          env={**os.environ, "WATCHDOG_ACCESS_DIR": str(tmp_path)})
    assert done.returncode == 2 and "inference.key must hold one key: not empty, without whitespace, ',', ':' or '='" in done.stderr
    assert "a:b" not in done.stderr


def test_a_loading_server_is_left_alone_and_sigterm_drains_it(tmp_path):
    # The model takes 3 s to load: the endpoints are not up (refused connections) for longer than the
    # watchdog's CHECKS x TIMEOUT_S, which must not count as a hang.
    log = tmp_path / "server.log"
    server = WatchedServer(write_model(tmp_path / "repo", initialize="import time\ntime.sleep(3)"), log_path=log)
    try:
        server.start_ready()
        infer_add_one(server.grpc_url)
        triton = server.tritonserver_pid()
        os.kill(server.pid, signal.SIGTERM)
        assert server.wait(30) == 0, f"the watchdog should exit with tritonserver's code:\n{log.read_text()[-2000:]}"
        assert not process_exists(triton)
        assert "triton-watchdog: tritonserver" not in log.read_text()
        assert "Non-graceful termination" not in log.read_text()
    finally:
        server.stop(grace_s=5)
    assert wait_until(lambda: not process_group_alive(server.pid), 5.0), "the watchdog left a process behind"


def test_the_watchdog_refuses_a_missing_command_and_bad_settings():
    result = subprocess.run(["sh", str(WATCHDOG)], capture_output=True, text=True, timeout=10)
    assert result.returncode == 2 and "usage: triton-watchdog.sh COMMAND" in result.stderr
    result = subprocess.run(["sh", str(WATCHDOG), "true"], capture_output=True, text=True, timeout=10,
                            env={**os.environ, "WATCHDOG_CHECKS": "-1"})
    assert result.returncode == 2 and "WATCHDOG_CHECKS must be a whole number, got '-1'" in result.stderr
    # The command's own exit code comes back.
    assert subprocess.run(["sh", str(WATCHDOG), "sh", "-c", "exit 3"], timeout=10).returncode == 3


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
    done = subprocess.run(["sh", str(WATCHDOG), "echo"], capture_output=True, text=True, timeout=10,
                          env={**os.environ, "WATCHDOG_ACCESS_DIR": str(tmp_path), "WATCHDOG_CHECKS": "0",
                               "WATCHDOG_PROBE_S": "0"})
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == sorted(flag.format(d=tmp_path) for flag in flags)
    assert f"triton-watchdog: access: {access} (from {tmp_path})" in done.stderr


@pytest.mark.parametrize("files, error", [
    pytest.param({"client-ca.pem": "x"}, "mutual TLS (client-ca.pem) needs TLS", id="mutual-without-tls"),
    pytest.param({"inference.key": "same", "admin.key": "same"}, "admin.key must differ from inference.key",
                 id="same-keys"),
])
def test_the_access_folder_refuses_what_no_server_can_run(tmp_path, files, error):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = subprocess.run(["sh", str(WATCHDOG), "true"], capture_output=True, text=True, timeout=10,
                          env={**os.environ, "WATCHDOG_ACCESS_DIR": str(tmp_path)})
    assert done.returncode == 2 and error in done.stderr, done.stderr
