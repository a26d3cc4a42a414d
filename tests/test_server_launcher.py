"""The local tritonserver launcher (`server/triton.py`, `code2wav-server serve`) against the real binary.

Each test writes a tiny Python-backend model into tmp_path, so nothing here needs the Mimi export.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.protocol import NUM_CODEBOOKS, SAMPLES_PER_FRAME
from mimi_code2wav.server.processes import ServerError, process_group_alive
from mimi_code2wav.server.supervise import describe_exit, restart_delay_s, running_server
from mimi_code2wav.server.triton import SHM_DIR, TritonServer, free_ports, port_is_free

from helpers import (
    REPO_ROOT,
    infer,
    process_exists,
    serve_cli,
    shm_prefix_of,
    stop_cli,
    stub_pid,
    tritonserver_child,
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


def infer_add_one(grpc_url: str, model: str = "add_one") -> np.ndarray:
    import tritonclient.grpc as grpcclient

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with grpcclient.InferenceServerClient(grpc_url) as client:
        tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(model, [tensor])
    y = result.as_numpy("y")
    np.testing.assert_array_equal(y, x + 1.0)
    return y


def serve_unready(repository: Path, tmp_path: Path, ports: list[int], **popen) -> subprocess.Popen:
    """`code2wav-server serve` of `repository` on `ports` (HTTP, gRPC, metrics), not waited for."""
    flags = [arg for flag, port in zip(("--http-port", "--grpc-port", "--metrics-port"), ports) for arg in (flag, str(port))]
    return subprocess.Popen([sys.executable, "-m", "mimi_code2wav.server", "serve", "--model-repository", str(repository),
                             *flags, "--log-file", str(tmp_path / "server.log")], cwd=REPO_ROOT, **popen)


def test_serves_grpc_then_stops_leaving_nothing(tmp_path):
    repository = write_model(tmp_path / "repo")
    with running_server(repository, log_path=tmp_path / "server.log") as server:
        pid = server.pid
        ports = [server.http_port, server.grpc_port, server.metrics_port]
        assert len(set(ports)) == 3
        assert server.grpc_url == f"127.0.0.1:{server.grpc_port}"
        assert server.metrics_url == f"http://127.0.0.1:{server.metrics_port}/metrics"
        assert server.ready_after_s is not None and server.ready_after_s < 30
        infer_add_one(server.grpc_url)
        regions = server.shm_regions()
        assert regions, "the Python stub's shared-memory region should exist while serving"
        assert all(port_is_free(port) is False for port in ports)
    assert server.process.returncode == 0, "SIGTERM should give a clean shutdown"
    assert not process_exists(pid)
    assert not process_group_alive(pid), "a Python stub outlived the server"
    assert all(port_is_free(port) for port in ports)
    assert not any(region.exists() for region in regions)
    assert server.shm_regions() == []


def test_model_failing_to_load_fails_wait_ready_fast_with_log_tail(tmp_path, capfd):
    repository = write_model(tmp_path / "repo", initialize='raise RuntimeError("initialize failed on purpose")')
    server = TritonServer(repository, log_path=tmp_path / "server.log")
    started = time.monotonic()
    server.start()
    try:
        with pytest.raises(ServerError) as failure:
            server.wait_ready(timeout_s=60)
    finally:
        server.stop()
    assert time.monotonic() - started < 30
    assert "exited with code" in str(failure.value) and "initialize failed on purpose" in str(failure.value)
    assert not process_group_alive(server.pid)
    assert server.shm_regions() == []
    # running_server raises the same at once: a model that fails to load is no reason to start again.
    with pytest.raises(ServerError, match="initialize failed on purpose"):
        with running_server(repository):
            pass
    assert "starting it again" not in capfd.readouterr().err


def test_model_stuck_loading_times_out_and_stop_cleans_up(tmp_path):
    # A stub that never finishes starting keeps the server "loading" and never ready.
    repository = write_model(tmp_path / "repo", initialize="import time; time.sleep(3600)")
    server = TritonServer(repository, log_path=tmp_path / "server.log", exit_timeout_s=1)
    server.start()
    try:
        with pytest.raises(ServerError, match="not ready after 3 s"):
            server.wait_ready(timeout_s=3)
        assert server.is_alive()
    finally:
        server.stop(grace_s=5)
    assert not process_group_alive(server.pid)
    assert server.shm_regions() == []


def test_serve_command_runs_in_foreground_and_stops_on_sigterm(tmp_path):
    with serve_cli(write_model(tmp_path / "repo"), tmp_path / "server.log") as (cli, ports, out):
        http_port, grpc_port, metrics_port = ports
        infer_add_one(f"127.0.0.1:{grpc_port}")
        server_pid = tritonserver_child(cli)
        group = os.getpgid(server_pid)
        prefix = shm_prefix_of(server_pid)
        assert list(SHM_DIR.glob(f"{prefix}*"))
        output = stop_cli(cli, out)
    assert cli.returncode == 0, output
    assert f"gRPC     127.0.0.1:{grpc_port}" in output
    assert re.search(rf"tritonserver ready in [0-9.]+ s \(pid {server_pid}\)", output), output
    assert "access   plaintext gRPC, no inference key, admin calls open" in output, output
    assert "SIGTERM: draining and stopping tritonserver" in output
    assert not process_exists(server_pid)
    assert not process_group_alive(group)
    assert all(port_is_free(port) for port in (http_port, grpc_port, metrics_port))
    assert list(SHM_DIR.glob(f"{prefix}*")) == []


def test_sighup_drains_serve_and_starts_it_again_reading_the_repository_afresh(tmp_path):
    """The operator's restart: SIGHUP drains tritonserver (exit 0), starts a new one at once on the
    same ports, which serves what the repository holds now; the old one leaves nothing behind."""
    repository, log = write_model(tmp_path / "repo"), tmp_path / "server.log"
    with serve_cli(repository, log) as (cli, (http_port, grpc_port, _), out):
        first_pid = tritonserver_child(cli)
        first_group = os.getpgid(first_pid)
        write_model(repository, name="add_two")  # what the next server must load
        cli.send_signal(signal.SIGHUP)
        assert wait_until(lambda: not process_exists(first_pid), 40), f"SIGHUP did not drain the server:\n{out.read_text()}"
        assert wait_until(lambda: tritonserver_child(cli) is not None, 20), f"no new server after SIGHUP:\n{out.read_text()}"
        wait_http_ready(http_port, cli, timeout_s=60, output=out)
        wait_printed(cli, out, ") and restarted in ")
        second_pid = tritonserver_child(cli)
        second_group = os.getpgid(second_pid)
        infer_add_one(f"127.0.0.1:{grpc_port}")
        infer_add_one(f"127.0.0.1:{grpc_port}", model="add_two")
        assert not process_group_alive(first_group), "the drained server left a stub behind"
        output = stop_cli(cli, out)
    assert cli.returncode == 0, output
    assert f"SIGHUP: draining tritonserver (pid {first_pid}) to start it again" in output, output
    assert re.search(rf"tritonserver \(pid {first_pid}\) drained \(exited with code 0\) and restarted in [0-9.]+ s "
                     rf"\(ready in [0-9.]+ s, pid {second_pid}, restart 1\)", output), output
    assert "Non-graceful termination" not in Path(f"{log}.1").read_text()
    assert not process_group_alive(second_group)


def test_serve_restarts_a_tritonserver_that_dies_on_the_same_ports(tmp_path):
    """A crash (SIGKILL of tritonserver alone): reported with its exit, started again on the same
    ports after the first backoff delay, the dead server's log kept as <log>.1 and its stubs gone."""
    repository, log = write_model(tmp_path / "repo"), tmp_path / "server.log"
    with serve_cli(repository, log) as (cli, (http_port, grpc_port, _), out):
        first_pid = tritonserver_child(cli)
        first_group = os.getpgid(first_pid)
        os.kill(first_pid, signal.SIGKILL)
        assert wait_until(lambda: tritonserver_child(cli) not in (None, first_pid), 30), \
            f"no new server after the crash:\n{out.read_text()}"
        wait_http_ready(http_port, cli, timeout_s=60, output=out)
        wait_printed(cli, out, "tritonserver restarted (pid ")
        second_pid = tritonserver_child(cli)
        infer_add_one(f"127.0.0.1:{grpc_port}")
        assert not process_group_alive(first_group), "the dead server left a stub behind"
        output = stop_cli(cli, out)
    assert cli.returncode == 0, output
    assert f"tritonserver (pid {first_pid}) was killed by SIGKILL after" in output, output
    assert "; restart in 0.5 s on the same ports" in output, output
    assert f"tritonserver restarted (pid {second_pid}, restart 1)" in output, output
    assert Path(f"{log}.1").is_file()


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


def test_serve_command_with_missing_weights_explains(tmp_path):
    """Without --model-repository, serve builds the repository from the weights; weights that do not
    exist stop it before any server starts, with one line naming them."""
    missing = tmp_path / "no-such-checkpoint.safetensors"
    result = subprocess.run(
        [sys.executable, "-m", "mimi_code2wav.server", "serve", "--weights", str(missing), "--build-dir", str(tmp_path / "build"),
         "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert f"error: {missing}: no such file or folder" in result.stderr
    assert not (tmp_path / "build" / "model_repository").exists()


def test_serving_the_native_decoder_without_its_backend_refuses_in_one_line(tmp_path):
    """A repository with a native onnxruntime model needs Triton's ONNX Runtime backend beside the
    pip server's Python backend: where ORT_BACKEND holds none, serve stops before starting any
    server, saying what is missing, where it looked and that the NGC image carries it."""
    model = tmp_path / "repo" / "mimi_decoder"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('name: "mimi_decoder"\nbackend: "onnxruntime"\nmax_batch_size: 8\n')
    empty = tmp_path / "no-backend"
    empty.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "mimi_code2wav.server", "serve", "--model-repository", str(tmp_path / "repo"),
         "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--log-file", str(tmp_path / "server.log")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "ORT_BACKEND": str(empty)},
    )
    assert result.returncode == 1, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert (f"the onnxruntime decoder needs Triton's ONNX Runtime backend, and {empty}/libtriton_onnxruntime.so "
            "does not exist: set ORT_BACKEND=") in line
    assert "nvcr.io/nvidia/tritonserver:24.10-py3, which carries it" in line
    assert not (tmp_path / "server.log").exists() or "Started" not in (tmp_path / "server.log").read_text()


def _stubs_of(shm_prefix: str) -> list[int]:
    """Python stubs of the server that named its shared memory `shm_prefix`, still running."""
    stubs = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "triton_python_backend_stub" in cmdline and shm_prefix in cmdline:
                stubs.append(int(entry.name))
    return stubs


@pytest.mark.parametrize("moment", ["serving", "loading"])
def test_nothing_is_left_when_the_launcher_is_killed(tmp_path, moment):
    """SIGKILL leaves the launcher no chance to stop the server: the kernel's parent-death signal ends
    tritonserver, and its Python stubs follow once it is gone, whether the model was serving or still
    loading. (This test reaps the orphaned tritonserver as a subreaper: where the host's init does
    not reap orphans, a dead tritonserver stays a zombie, which its stubs take for a live parent.)"""
    import ctypes

    initialize = "import time; time.sleep(3600)" if moment == "loading" else "pass"
    repository = write_model(tmp_path / "repo", initialize=initialize)
    server_pid = prefix = None
    http_port, grpc_port, metrics_port = free_ports(3)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_child_subreaper = 36
    libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    cli = serve_unready(repository, tmp_path, [http_port, grpc_port, metrics_port], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server_pid is None:
            server_pid = tritonserver_under(cli.pid)
            time.sleep(0.1)
        assert server_pid is not None, "tritonserver never started"
        (entrypoint,) = map(int, subprocess.run(["pgrep", "-P", str(cli.pid)], capture_output=True,
                                                text=True).stdout.split())
        while time.monotonic() < deadline and prefix is None:
            prefix = shm_prefix_of(server_pid)
            prefix = prefix if _stubs_of(prefix) else None
            time.sleep(0.1)
        assert prefix is not None, "the Python stub never started"
        if moment == "serving":
            wait_http_ready(http_port, cli, timeout_s=90)
        cli.kill()
        cli.wait()
        # The entrypoint, which waits for tritonserver, is this process's child now: wait for it to
        # exit (tritonserver's exit timeout at most).
        os.waitpid(entrypoint, 0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _stubs_of(prefix):
            time.sleep(0.1)
        assert _stubs_of(prefix) == [], "a Python stub outlived its server"
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


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_serve_stops_cleanly_when_its_process_group_is_signalled_twice(tmp_path):
    """A terminal's Ctrl-C reaches make and the launcher both, and a second one (or a process-group
    SIGTERM right after) may land while the first stop runs: one clean stop, no traceback, the
    launcher exits 0 (make reports no error of its recipe), nothing left behind."""
    repository = write_model(tmp_path / "repo")
    http_port, grpc_port, metrics_port = free_ports(3)
    make = subprocess.Popen(
        ["make", "--no-print-directory", "serve", f"MODEL_REPOSITORY={repository}", f"HTTP_PORT={http_port}",
         f"GRPC_PORT={grpc_port}", f"METRICS_PORT={metrics_port}"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    server_pid = None
    try:
        wait_http_ready(http_port, make, timeout_s=90)
        infer_add_one(f"127.0.0.1:{grpc_port}")
        server_pid = tritonserver_under(make.pid)
        assert server_pid is not None
        group = os.getpgid(server_pid)
        prefix = shm_prefix_of(server_pid)
        # Back to back, so that the second lands while the first is being handled; then one more later.
        os.killpg(make.pid, signal.SIGINT)
        os.killpg(make.pid, signal.SIGTERM)
        time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(make.pid, signal.SIGINT)
        output, _ = make.communicate(timeout=90)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
    assert "Traceback" not in output, output
    # make passes a SIGTERM on to its child too, so either signal may be the one the launcher sees first.
    assert len(re.findall(r"^SIG(INT|TERM): draining and stopping tritonserver$", output, re.M)) == 1, output
    assert re.search(r"tritonserver stopped in [0-9.]+ s", output), output
    assert not re.search(r"\] Error \d", output), output  # make saw the launcher exit non-zero
    assert not process_exists(server_pid) and not process_group_alive(group)
    assert all(port_is_free(port) for port in (http_port, grpc_port, metrics_port))
    assert list(SHM_DIR.glob(f"{prefix}*")) == []


def test_signals_during_start_up_give_one_clean_stop(tmp_path):
    """SIGHUP, then SIGTERM and SIGINT again and again while the server is still loading: exit code 0,
    no traceback, no server left (its model sleeps in initialize, so the signals land mid-start)."""
    repository = write_model(tmp_path / "repo", initialize="import time\ntime.sleep(3)")
    http_port, grpc_port, metrics_port = free_ports(3)
    cli = serve_unready(repository, tmp_path, [http_port, grpc_port, metrics_port], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    server_pid = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and server_pid is None and cli.poll() is None:
            server_pid = tritonserver_under(cli.pid)
            time.sleep(0.05)
        assert server_pid is not None, "tritonserver never started"
        group = os.getpgid(server_pid)
        # A SIGHUP first: while the server starts it is only counted (its drain would come once it serves).
        for signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cli.pid, signum)
        output, _ = cli.communicate(timeout=90)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()
    assert cli.returncode == 0, output
    assert "Traceback" not in output, output
    assert output.count("stopping tritonserver") == 1, output
    assert not process_exists(server_pid) and not process_group_alive(group)
    assert all(port_is_free(port) for port in (http_port, grpc_port, metrics_port))


@pytest.mark.parametrize("model", ["code2wav", "mimi_decoder"])
def test_serve_restarts_a_server_whose_python_stub_died(repository_for, tmp_path, model):
    """A Python stub that died (SIGKILL stands in for its segfault) leaves tritonserver ready while
    every request fails; the entrypoint's stub probe finds it and kills the server, serve starts it
    again, and a fresh conversation decodes."""
    import tritonclient.grpc as grpcclient

    log = tmp_path / "server.log"
    with serve_cli(repository_for("null"), log) as (cli, (http_port, grpc_port, _), out):
        first_pid = tritonserver_child(cli)
        os.kill(stub_pid(first_pid, model), signal.SIGKILL)
        wait_printed(cli, out, "tritonserver restarted (pid ", timeout_s=60)
        wait_http_ready(http_port, cli, timeout_s=60, output=out)
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
            pcm = infer(client, 51, np.zeros((NUM_CODEBOOKS, 5), np.int64), 0, start=True, end=True, new_frames=5)
        assert pcm.size == 5 * SAMPLES_PER_FRAME
        output = stop_cli(cli, out)
    assert cli.returncode == 0, output
    assert re.search(rf"tritonserver \(pid {first_pid}\) was killed by SIGKILL after", output), output
    assert re.search(rf"triton-watchdog: tritonserver \(pid {first_pid}\) answers, but a Python stub is dead "
                     rf"\(.*Stub process '{model}_0_0' is not healthy\..* from {model}\): killing it \(SIGKILL\)",
                     Path(f"{log}.1").read_text()), output
    assert f"tritonserver (pid {first_pid}) was killed by SIGKILL after" in output, output
