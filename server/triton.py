"""The `tritonserver` of the `nvidia-pytriton` wheel (2.51.0, only the Python backend), run without
docker: `TritonServer` starts one in its own process group and stops only what it started, its shared
memory included."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from .ort_backend import install_file, install_onnxruntime_backend, needs_onnxruntime
from .processes import ServerError, group_pids, log_tail, process_group_alive
from .security import ENTRYPOINT

SHM_DIR = Path("/dev/shm")
LOCALHOST = "127.0.0.1"
# --exit-timeout-secs: abandoned streams idle out (docs/design.md §5.2) inside Kubernetes' 30 s grace.
DEFAULT_EXIT_TIMEOUT_S = 25


def prepare_triton() -> tuple[Path, Path, dict[str, str]]:
    """The wheel's tritonserver, a backend directory whose `python/` holds the wheel's Python backend and
    this interpreter's stub side by side (as the backend requires), and the environment they run in."""
    try:
        import pytriton
    except ImportError as exc:
        raise ServerError("nvidia-pytriton is not installed in this environment: install the 'serve' extra "
                          "(pip install -e '.[serve]')") from exc
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    binary, python_backend = root / "bin" / "tritonserver", root / "backends" / "python"
    libs = root.parent.parent / "nvidia_pytriton.libs"
    backend_files = {python_backend / "libtriton_python.so": 0o755, python_backend / "triton_python_backend_utils.py": 0o644,
                     root / "python_backend_stubs" / version / "triton_python_backend_stub": 0o755}
    if missing := [str(path) for path in (binary, libs, *backend_files) if not path.exists()]:
        raise ServerError("the pytriton wheel lacks: " + "; ".join(missing))
    # A checkout's build folder, else (an installed package) the user's cache folder.
    checkout = Path(__file__).resolve().parent.parent
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mimi-code2wav"
    backend_root = checkout / "build" if (checkout / "pyproject.toml").is_file() else cache
    backend_dir = backend_root / "triton-backends" / f"py{version.replace('.', '')}"
    (backend_dir / "python").mkdir(parents=True, exist_ok=True)
    for source, mode in backend_files.items():
        install_file(source, backend_dir / "python" / source.name, mode)

    env = dict(os.environ)
    # The stub embeds Python in isolated mode and finds this environment through `python3` on PATH.
    bin_dir = Path(sys.prefix) / "bin"
    bin_dir = bin_dir if (bin_dir / "python3").exists() else Path(sys.executable).parent
    env["PATH"] = os.pathsep.join(p for p in (str(bin_dir), env.get("PATH", "")) if p)
    libdir = sysconfig.get_config_var("LIBDIR") or ""  # this interpreter's libpython
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    env.pop("PYTHONHOME", None)  # the stub must use this environment, whatever the caller's shell says
    # Freed buffers of 128 KiB and more go back to the system (glibc's own threshold rises until none do).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 17))
    return binary, backend_dir, env


def free_ports(count: int, host: str = LOCALHOST) -> list[int]:
    """`count` distinct free ports (held open together while picking, so they differ)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def fetch_metrics(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Scrape a Prometheus text endpoint into {'name{labels}': value} (histogram series included)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        lines = response.read().decode().splitlines()
    samples = {}
    for key, _, value in (line.rpartition(" ") for line in lines if line and not line.startswith("#")):
        with contextlib.suppress(ValueError):
            samples[key] = float(value)
    return samples


def metric_value(samples: dict[str, float], name: str, **labels: str) -> float | None:
    """Sum of the samples of metric `name` whose labels include `labels`; None when there is none."""
    values = [value for key, value in samples.items() if key.partition("{")[0] == name
              and all(f'{label}="{expected}"' in key.partition("{")[2] for label, expected in labels.items())]
    return sum(values) if values else None


@dataclasses.dataclass(eq=False)
class TritonServer:
    """One tritonserver leading its own process group, logging to `log_path` (None: a temporary file); ports None
    or 0 are picked at `start()`. With `access_dir` or `watch` (`watch_env`: WATCHDOG_* settings) it runs under
    the entrypoint script, `pid` then being its. `dataclasses.replace(server)`: a new one, same settings and ports."""

    model_repository: Path
    _: dataclasses.KW_ONLY
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    host: str = LOCALHOST
    log_path: Path | None = None
    log_verbose: int = 0
    exit_timeout_s: int = DEFAULT_EXIT_TIMEOUT_S
    access_dir: Path | None = None
    watch: bool = False
    watch_env: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.model_repository = Path(self.model_repository).resolve()
        self.log_path = Path(self.log_path) if self.log_path is not None else None
        self.access_dir = Path(self.access_dir).resolve() if self.access_dir is not None else None
        # Triton's HTTP endpoint has no TLS: with TLS on gRPC, HTTP and metrics stay on loopback.
        self.http_host = LOCALHOST if self.access_dir and (self.access_dir / "server.pem").exists() else self.host
        # Every region a Python stub creates is named <prefix><uuid>: stop() removes exactly this server's.
        self.shm_prefix = f"triton_python_backend_shm_region_{uuid.uuid4().hex[:12]}_"
        self.process: subprocess.Popen | None = None
        self._tritonserver_pid: int | None = None
        self.started_at = self.ready_after_s = None

    grpc_url = property(lambda self: f"{self.host}:{self.grpc_port}")  # "host:port", as tritonclient takes it
    http_url = property(lambda self: f"{self.http_host}:{self.http_port}")
    metrics_url = property(lambda self: f"http://{self.http_host}:{self.metrics_port}/metrics")
    pid = property(lambda self: self.process.pid if self.process is not None else None)
    entrypoint = property(lambda self: self.access_dir is not None or self.watch)

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        """The exit code once the process has exited (negative: killed by that signal), else None."""
        return self.process.poll() if self.process is not None else None

    def tritonserver_pid(self) -> int | None:
        """tritonserver's own pid: `pid`, or the one in the entrypoint's process group (None until it started)."""
        if self.process is None or not self.entrypoint:
            return self.pid
        for pid in group_pids(self.pid) if self._tritonserver_pid is None else ():
            with contextlib.suppress(OSError):  # exited, or not ours to read
                if Path(f"/proc/{pid}/exe").resolve(strict=True).name == "tritonserver":
                    self._tritonserver_pid = pid
        return self._tritonserver_pid

    def start(self) -> None:
        """Launch the process; returns at once (see `wait_ready`)."""
        if self.process is not None:
            raise ServerError("this TritonServer was already started")
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} is not a directory")
        binary, backend_dir, env = prepare_triton()
        if needs_onnxruntime(self.model_repository):
            install_onnxruntime_backend(backend_dir)
        picked = iter(free_ports(3, self.host))
        self.http_port, self.grpc_port, self.metrics_port = (
            port or next(picked) for port in (self.http_port, self.grpc_port, self.metrics_port))
        if self.log_path is None:
            with tempfile.NamedTemporaryFile(prefix=f"tritonserver-{self.http_port}-", suffix=".log", delete=False) as log:
                self.log_path = Path(log.name)
        # The command holds any keys: never print it.
        command = [
            str(binary), f"--model-repository={self.model_repository}", f"--backend-directory={backend_dir}",
            "--disable-auto-complete-config", f"--http-address={self.http_host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}", f"--metrics-address={self.http_host}",
            f"--metrics-port={self.metrics_port}", "--allow-gpu-metrics=false", f"--log-verbose={self.log_verbose}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}"]
        if self.entrypoint:
            env.update({"WATCHDOG_HTTP": f"http://{self.http_url}", "WATCHDOG_ACCESS_DIR": str(self.access_dir or ""),
                        **({} if self.watch else {"WATCHDOG_CHECKS": "0", "WATCHDOG_PROBE_S": "0"}), **self.watch_env})
            command = ["sh", str(ENTRYPOINT), *command]
        # Where util-linux's setpriv is (Debian, NGC), Linux SIGTERMs the server when this process dies: a launcher
        # killed without stop() takes it along. Not a preexec_fn: Python code in a threaded process's fork can crash.
        if setpriv := shutil.which("setpriv", path=f"{os.environ.get('PATH', '')}{os.pathsep}/usr/bin{os.pathsep}/bin"):
            command = [setpriv, "--pdeathsig", "TERM", "--", *command]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.started_at = time.monotonic()
            # Its own process group: Ctrl-C in a terminal does not reach it, and stop() ends it with its stubs.
            self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def port_taken(self) -> str | None:
        """The address the log says was already in use ("a port" where it names none), else None."""
        tail = log_tail(self.log_path, lines=200)
        if found := re.search(r"Socket '([^']+)' already in use", tail):
            return found.group(1)
        return "a port" if "already in use" in tail or "Address in use" in tail else None

    def wait_ready(self, timeout_s: float = 60.0, poll_s: float = 0.05) -> float:
        """Seconds from `start()` until `/v2/health/ready`, then the metrics (they listen later), answer 200;
        ServerError with the log tail if it exits first or is not ready in `timeout_s`. Never stops the server."""
        if self.process is None:
            raise ServerError("wait_ready() before start()")
        deadline = time.monotonic() + timeout_s
        while (seen := _http_ready(f"http://{self.http_url}/v2/health/ready") or _http_ready(self.metrics_url)):
            code = self.process.poll()
            if code is None and time.monotonic() < deadline:
                time.sleep(poll_s)
                continue
            if code is None:
                what = f"was not ready after {timeout_s:.0f} s: {seen}"
            else:
                taken = self.port_taken()
                what = f"exited with code {code} before it was ready" + (
                    f": address {taken} is already in use (choose other ports)" if taken else "")
            raise ServerError(f"tritonserver {what} (log {self.log_path}):\n{log_tail(self.log_path)}")
        self.ready_after_s = time.monotonic() - self.started_at
        return self.ready_after_s

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM, SIGKILL its group after `grace_s` (default: the exit timeout plus 10 s to unload), the stubs
        left 5 s later; its shared memory removed. Idempotent; the exit code (None: never started)."""
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)  # not yet reaped: a zombie at worst
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(self.exit_timeout_s + 10.0 if grace_s is None else grace_s)
        for _ in range(2 if process is not None else 0):
            if process.poll() is not None:  # the rest of the group notices its leader is gone and exits
                deadline = time.monotonic() + 5.0
                while process_group_alive(process.pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
            if process_group_alive(process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for region in self.shm_regions():
            region.unlink(missing_ok=True)
        return self.exit_code()

    def shm_regions(self) -> list[Path]:
        """Shared-memory regions that this server's Python stubs created and that still exist."""
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))


def _http_ready(url: str) -> str | None:
    """None when GET `url` answers 200, else what it answered ("HTTP 503", the connection error)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except OSError as error:  # HTTPError, URLError and ConnectionError among them
        return f"HTTP {error.code}" if isinstance(error, urllib.error.HTTPError) else str(error)
