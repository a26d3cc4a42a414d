"""The local tritonserver launcher (`server/triton.py`, `code2wav-server serve`) against the real binary: most
tests write a tiny Python-backend model into tmp_path; serve's restarts run the null repository."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.protocol import NUM_CODEBOOKS, SAMPLES_PER_FRAME
from mimi_code2wav.server.processes import ServerError, process_group_alive
from mimi_code2wav.server.supervise import describe_exit, restart_delay_s, running_server
from mimi_code2wav.server.triton import SHM_DIR, TritonServer, free_ports

from helpers import (
    REPO_ROOT,
    copy_repository,
    infer,
    port_is_free,
    process_exists,
    serve_cli,
    serve_command,
    serve_unready,
    shm_prefix_of,
    stop_cli,
    stub_pid,
    tritonserver_under,
    wait_http_ready,
    wait_printed,
    wait_until,
)

pytestmark = pytest.mark.server

ADD_ONE_CONFIG = """\
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""

ADD_ONE_MODEL = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
{initialize}

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", x + 1.0)]))
        return responses
"""


def write_model(repository: Path, name: str = "add_one", initialize: str = "pass") -> Path:
    model_dir = repository / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(ADD_ONE_CONFIG.format(name=name))
    body = textwrap.indent(textwrap.dedent(initialize), " " * 8)
    (model_dir / "1" / "model.py").write_text(ADD_ONE_MODEL.format(initialize=body))
    return repository


def infer_add_one(grpc_url: str, model: str = "add_one") -> None:
    import tritonclient.grpc as grpcclient

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with grpcclient.InferenceServerClient(grpc_url) as client:
        tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer(model, [tensor]).as_numpy("y"), x + 1.0)


def wait_tritonserver(launcher: subprocess.Popen) -> int:  # the tritonserver `launcher` started, once it has
    assert wait_until(lambda: tritonserver_under(launcher.pid) is not None, 90), "tritonserver never started"
    return tritonserver_under(launcher.pid)


def assert_nothing_left(server_pids: list[int], groups: list[int], ports: list[int], shm_prefixes: list[str]) -> None:
    assert not any(map(process_exists, server_pids)), "a tritonserver outlived its launcher"
    assert not any(map(process_group_alive, groups)), "a Python stub outlived its server"
    assert all(port_is_free(port) for port in ports)
    assert not any(list(SHM_DIR.glob(f"{prefix}*")) for prefix in shm_prefixes)


def test_serves_grpc_then_stops_leaving_nothing(tmp_path):
    repository = write_model(tmp_path / "repo")
    with running_server(repository, log_path=tmp_path / "server.log") as server:
        ports = [server.http_port, server.grpc_port, server.metrics_port]
        assert len(set(ports)) == 3
        assert server.ready_after_s is not None and server.ready_after_s < 60
        infer_add_one(server.grpc_url)
        regions = server.shm_regions()
        assert regions, "the Python stub's shared-memory region should exist while serving"
        assert not any(port_is_free(port) for port in ports)
    assert server.process.returncode == 0, "SIGTERM should give a clean shutdown"
    assert_nothing_left([server.pid], [server.pid], ports, [server.shm_prefix])
    assert not any(region.exists() for region in regions)


@pytest.mark.parametrize("initialize, timeout_s, error", [
    pytest.param('raise RuntimeError("initialize failed on purpose")', 60,
                 r"(?s)exited with code .*initialize failed on purpose", id="failing"),
    # A stub that never finishes starting keeps the server "loading" and never ready.
    pytest.param("import time; time.sleep(3600)", 3, "not ready after 3 s", id="stuck"),
])
def test_a_model_that_does_not_load_fails_wait_ready_with_the_log_tail(tmp_path, capfd, initialize, timeout_s, error):
    """A failing model fails wait_ready long before its timeout, a stuck one times out with the server alive;
    stop() leaves nothing either way."""
    repository = write_model(tmp_path / "repo", initialize=initialize)
    server = TritonServer(repository, log_path=tmp_path / "server.log", exit_timeout_s=1)
    started = time.monotonic()
    server.start()
    try:
        with pytest.raises(ServerError, match=error):
            server.wait_ready(timeout_s=timeout_s)
        assert server.is_alive() == (timeout_s == 3)
    finally:
        server.stop(grace_s=5)
    assert time.monotonic() - started < 45
    assert not process_group_alive(server.pid)
    assert server.shm_regions() == []
    if timeout_s == 60:
        # running_server raises the same at once: a model that fails to load is no reason to start again.
        with pytest.raises(ServerError, match="initialize failed on purpose"):
            with running_server(repository):
                pass
        assert "starting it again" not in capfd.readouterr().err


def test_serve_restarts_tritonserver_after_sighup_a_crash_and_dead_stubs_and_sigterm_leaves_nothing(
        repository_for, tmp_path):
    """`code2wav-server serve`, one fault after another, each followed by a new tritonserver on the same ports,
    decoding, the old one's log kept as <log>.<n>, its stubs gone: SIGHUP drains (exit 0) and restarts at once,
    reading the repository afresh; a crash (SIGKILL), then a dead stub of code2wav, then of the decoder (which
    leave tritonserver ready while every request fails: the entrypoint's probe kills it) restart after the
    backoff. SIGTERM then drains and stops it all, exit 0, leaving no process, port or shared memory."""
    import tritonclient.grpc as grpcclient

    repository, log = copy_repository(repository_for("null"), tmp_path / "repo"), tmp_path / "server.log"
    faults = [("SIGHUP", None), ("crash", None), ("stub", "code2wav"), ("stub", "mimi_decoder")]
    found, restart = {}, 0  # found: model -> the restart after the watchdog found its dead stub
    with serve_cli(repository, log) as (cli, ports, out):
        pids, groups, prefixes = [tritonserver_under(cli.pid)], [], []
        for fault, model in faults:
            for _ in range(3 if fault == "stub" else 1):  # tritonserver 2.51 may abort on a dead stub first
                restart += 1
                groups.append(os.getpgid(pids[-1]))
                prefixes.append(shm_prefix_of(pids[-1]))
                assert list(SHM_DIR.glob(f"{prefixes[-1]}*"))
                if fault == "SIGHUP":
                    write_model(repository, name="add_two")  # what the next server must load
                    cli.send_signal(signal.SIGHUP)
                else:
                    os.kill(pids[-1] if fault == "crash" else stub_pid(pids[-1], model), signal.SIGKILL)
                wait_printed(cli, out, f"restart {restart})", timeout_s=120)
                pids.append(tritonserver_under(cli.pid))
                with grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}") as client:
                    pcm = infer(client, 50 + restart, np.zeros((NUM_CODEBOOKS, 5), np.int64), 0, start=True, end=True)
                assert pcm.size == 5 * SAMPLES_PER_FRAME
                assert not process_group_alive(groups[-1]), f"the server before restart {restart} left a stub behind"
                if fault != "stub" or "answers, but a Python stub is dead" in Path(f"{log}.{restart}").read_text():
                    found[model] = restart
                    break
        infer_add_one(f"127.0.0.1:{ports[1]}", model="add_two")
        groups.append(os.getpgid(pids[-1]))
        prefixes.append(shm_prefix_of(pids[-1]))
        output = stop_cli(cli, out)
    assert cli.returncode == 0, output
    assert f"gRPC     127.0.0.1:{ports[1]}" in output
    assert re.search(rf"tritonserver ready in [0-9.]+ s \(pid {pids[0]}\)", output), output
    assert "access   plaintext gRPC, no inference key, admin calls open" in output, output
    assert f"SIGHUP: draining tritonserver (pid {pids[0]}) to start it again" in output, output
    assert f"tritonserver (pid {pids[0]}) drained (exited with code 0)" in output, output
    assert "Non-graceful termination" not in Path(f"{log}.1").read_text()
    for n in range(1, restart + 1):
        assert f"tritonserver restarted (pid {pids[n]}, restart {n}), ready in " in output, output
    # Each death soon after the last restart doubles the delay (a crash: SIGKILL; a dead stub: the watchdog's
    # SIGKILL, or tritonserver's own SIGABRT).
    for n in range(2, restart + 1):
        assert re.search(rf"tritonserver \(pid {pids[n - 1]}\) was killed by SIG{'KILL' if n == 2 else '(KILL|ABRT)'} "
                         rf"after .*; restart in {0.5 * 2 ** (n - 2):.1f} s on the same ports", output), output
    assert set(found) == {None, "code2wav", "mimi_decoder"}, output
    for model, n in found.items():
        assert model is None or re.search(rf"triton-watchdog: tritonserver \(pid {pids[n - 1]}\) answers, but a "
                                          rf"Python stub is dead \(.*Stub process '{model}_0_0' is not healthy\..* "
                                          rf"from {model}\): killing it \(SIGKILL\)", Path(f"{log}.{n}").read_text()), output
    assert "SIGTERM: draining and stopping tritonserver" in output
    assert_nothing_left(pids, groups, ports, prefixes)


@pytest.mark.parametrize("previous_s, lived_s, delay_s", [
    pytest.param(0.0, 1.0, 0.5, id="first-death"),
    pytest.param(0.5, 59.0, 1.0, id="died-again-soon"),
    pytest.param(16.0, 5.0, 32.0, id="keeps-dying"),
    pytest.param(32.0, 5.0, 60.0, id="at-most-a-minute"),
    pytest.param(60.0, 60.0, 0.5, id="was-up-a-minute"),
])
def test_restart_backoff(previous_s, lived_s, delay_s):
    assert restart_delay_s(previous_s, lived_s) == delay_s


@pytest.mark.parametrize("code, says", [(1, "exited with code 1"), (-9, "was killed by SIGKILL"),
                                        (137, "was killed by SIGKILL"), (128 + 99, "was killed by signal 99")])
def test_describe_exit(code, says):
    assert describe_exit(code) == says


@pytest.mark.parametrize("args, env, says", [
    pytest.param(["--weights", "{tmp}/no-such-checkpoint.safetensors"], {},
                 ["error: {tmp}/no-such-checkpoint.safetensors: no such file or folder"], id="missing-weights"),
    pytest.param(["--model-repository", "{tmp}/repo"], {"ORT_BACKEND": "{tmp}/no-backend"},
                 ["error: the onnxruntime decoder needs Triton's ONNX Runtime backend, and {tmp}/no-backend/"
                  "libtriton_onnxruntime.so does not exist: set ORT_BACKEND=",
                  "nvcr.io/nvidia/tritonserver:24.10-py3, which carries it"], id="no-native-backend"),
])
def test_serve_refuses_in_one_line_before_starting_a_server(tmp_path, args, env, says):
    """Weights that do not exist stop serve, naming them; a native onnxruntime model without Triton's ONNX
    Runtime backend in ORT_BACKEND stops it, saying what is missing, where it looked and that NGC's image has it."""
    model = tmp_path / "repo" / "mimi_decoder"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('name: "mimi_decoder"\nbackend: "onnxruntime"\nmax_batch_size: 8\n')
    (tmp_path / "no-backend").mkdir()
    result = subprocess.run(
        serve_command(None, tmp_path / "server.log", [0, 0, 0], *(arg.format(tmp=tmp_path) for arg in args),
                      "--build-dir", str(tmp_path / "build")),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, **{name: value.format(tmp=tmp_path) for name, value in env.items()}})
    assert result.returncode == 1, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(says[0].format(tmp=tmp_path)) and line.endswith(says[-1].format(tmp=tmp_path)), line
    assert not (tmp_path / "build" / "model_repository").exists()
    assert not (tmp_path / "server.log").exists() or "Started" not in (tmp_path / "server.log").read_text()


def _stubs_of(shm_prefix: str) -> list[int]:  # the live Python stubs of the server of `shm_prefix`
    found = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub .*{shm_prefix}"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


@pytest.mark.parametrize("moment", ["serving", "loading"])
def test_nothing_is_left_when_the_launcher_is_killed(tmp_path, moment):
    """SIGKILL leaves the launcher no chance to stop the server: the parent-death signal ends tritonserver, and
    its stubs follow, serving or still loading. (This test is a subreaper: where init reaps no orphans, a dead
    tritonserver stays a zombie, which its stubs take for a live parent.)"""
    import ctypes

    initialize = "import time; time.sleep(3600)" if moment == "loading" else "pass"
    repository = write_model(tmp_path / "repo", initialize=initialize)
    server_pid = prefix = None
    ports = free_ports(3)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_child_subreaper = 36
    libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    cli = serve_unready(repository, tmp_path, ports, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        server_pid = wait_tritonserver(cli)
        (entrypoint,) = map(int, subprocess.run(["pgrep", "-P", str(cli.pid)], capture_output=True,
                                                text=True).stdout.split())
        prefix = shm_prefix_of(server_pid)
        assert wait_until(lambda: _stubs_of(prefix), 90), "the Python stub never started"
        if moment == "serving":
            wait_http_ready(ports[0], cli, timeout_s=90)
        cli.kill()
        cli.wait()
        # The entrypoint is this process's child now: wait for it (tritonserver's exit timeout at most).
        os.waitpid(entrypoint, 0)
        assert wait_until(lambda: not _stubs_of(prefix), 60), "a Python stub outlived its server"
        assert not process_exists(server_pid), "tritonserver outlived its killed launcher"
    finally:
        libc.prctl(pr_set_child_subreaper, 0, 0, 0, 0)
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        if server_pid is not None and process_exists(server_pid):
            os.kill(server_pid, signal.SIGKILL)  # never leave an orphan behind a failed test
            with contextlib.suppress(ChildProcessError):
                os.waitpid(server_pid, 0)
        for stub in _stubs_of(prefix) if prefix else []:
            os.kill(stub, signal.SIGKILL)


@pytest.mark.parametrize("launcher", [
    pytest.param("make", marks=pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")),
    "starting"])
def test_signals_again_and_again_give_one_clean_stop(tmp_path, launcher):
    """Stop signals to the launcher's process group, several while the first stop runs (a terminal's Ctrl-C reaches
    make and serve both; or SIGHUP, SIGTERM and SIGINT while the model still loads): one clean stop, no traceback,
    exit code 0 (make reports no error of its recipe), nothing left behind."""
    ports = free_ports(3)
    if launcher == "make":
        repository = write_model(tmp_path / "repo")
        cli = subprocess.Popen(
            ["make", "--no-print-directory", "serve", f"MODEL_REPOSITORY={repository}", f"HTTP_PORT={ports[0]}",
             f"GRPC_PORT={ports[1]}", f"METRICS_PORT={ports[2]}"], cwd=REPO_ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # its own process group, as a terminal's job
        signals = (signal.SIGINT, signal.SIGTERM, None, signal.SIGINT)
    else:
        repository = write_model(tmp_path / "repo", initialize="import time\ntime.sleep(3)")
        cli = serve_unready(repository, tmp_path, ports, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
        # A SIGHUP first: while the server starts it is only counted (its drain would come once it serves).
        signals = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGINT)
    server_pid = prefix = None
    try:
        if launcher == "make":
            wait_http_ready(ports[0], cli, timeout_s=90)
            infer_add_one(f"127.0.0.1:{ports[1]}")
        server_pid = wait_tritonserver(cli)
        group, prefix = os.getpgid(server_pid), shm_prefix_of(server_pid)
        # Back to back, so that the next lands while the first is being handled; None: a pause first.
        for signum in signals:
            if signum is None:
                time.sleep(0.2)
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cli.pid, signum)
        output, _ = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()
    assert "Traceback" not in output, output
    # make passes a SIGTERM on to its child too, so either signal may be the one the launcher sees first.
    assert len(re.findall(r"^SIG(INT|TERM): draining and stopping tritonserver$", output, re.M)) == 1, output
    assert re.search(r"tritonserver stopped in [0-9.]+ s", output), output
    # The launcher exited 0: make (itself ended by the signal) reports no error of its recipe.
    assert cli.returncode == 0 if launcher == "starting" else not re.search(r"\] Error \d", output), output
    assert_nothing_left([server_pid], [group], ports, [prefix])
