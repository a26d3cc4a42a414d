"""server/triton-watchdog.sh, the entrypoint every server runs under (serve, compose, Kubernetes): a hung
server (SIGSTOP) is killed and the script exits 137, a loading one is left alone; the access folder becomes
tritonserver's flags. (A dead Python stub: serve's restarts in test_server_launcher.py, with TLS and keys in
test_security.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_server_launcher import infer_add_one, write_model

from mimi_code2wav.server.supervise import running_server

from helpers import REPO_ROOT, process_exists, wait_until

pytestmark = pytest.mark.server

WATCHDOG = REPO_ROOT / "server" / "triton-watchdog.sh"
# A health check every 0.2 s, a hang after 3 unanswered within 0.5 s; a stub probe every second.
FAST = {"WATCHDOG_INTERVAL_S": "0.2", "WATCHDOG_TIMEOUT_S": "0.5", "WATCHDOG_CHECKS": "3", "WATCHDOG_PROBE_S": "1",
        "WATCHDOG_PROBE_TIMEOUT_S": "10"}
RESTRICT = ("grpc-restricted-protocol", "http-restricted-api")


def watchdog(access_dir: Path, *command: str, **env: str) -> subprocess.CompletedProcess:
    """The script run here on `command`, with `access_dir` as its access folder."""
    return subprocess.run(["sh", str(WATCHDOG), *command], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "WATCHDOG_ACCESS_DIR": str(access_dir), **env})


def test_a_loading_server_is_left_alone_and_a_hung_one_killed_and_the_watchdog_exits_137(tmp_path):
    """The model takes 3 s to load: the endpoints are not up (refused connections) for longer than the
    watchdog's 3 checks of 0.5 s, which must not count as a hang; a server that stops answering does.
    (SIGTERM drains it and the script exits 0: serve's SIGHUP in test_server_launcher.)"""
    log = tmp_path / "server.log"
    repository = write_model(tmp_path / "repo", initialize="import time\ntime.sleep(3)")
    with running_server(repository, log_path=log, watch=True, watch_env=FAST) as server:
        infer_add_one(server.grpc_url)
        triton = server.tritonserver_pid()
        time.sleep(0.8)  # four health checks
        assert server.is_alive() and "triton-watchdog: tritonserver" not in log.read_text(), log.read_text()[-2000:]
        os.kill(triton, signal.SIGSTOP)
        # 3 unanswered checks in a row, each up to 0.5 s after a 0.2 s pause.
        assert wait_until(lambda: not server.is_alive(), 60), "still running 60 s after the hang"
        assert server.exit_code() == 128 + signal.SIGKILL
        assert not process_exists(triton)
    text = log.read_text()
    assert f"triton-watchdog: tritonserver (pid {triton}) answered no health check" in text, text[-2000:]
    assert "3 times in a row: hung; killing it (SIGKILL)" in text


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
