"""Find and run the `tritonserver` that the `nvidia-pytriton` wheel ships (2.51.0, only the Python
backend), without docker. Running it needs what the wheel does not arrange: this interpreter's stub next
to `libtriton_python.so` (`prepare_backend_directory`), PATH and LD_LIBRARY_PATH set for the stub
(`triton_environment`), and for a native `onnxruntime` model `ort_backend`. `TritonServer` starts one
server in its own process group and stops only what it started, its shared memory included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Callable, Sequence

from .ort_backend import install_onnxruntime_backend, needs_onnxruntime
from .processes import ServerError, group_pids, http_ready, log_tail, stop_process_group, with_parent_death_signal
from .security import ENTRYPOINT

SHM_DIR = Path("/dev/shm")
# Every region a Python stub creates is named <prefix><uuid>; each server gets its own prefix so that
# stop() removes exactly the regions of the server it stopped.
SHM_PREFIX_BASE = "triton_python_backend_shm_region_"
STUB_NAME = "triton_python_backend_stub"
LOCALHOST = "127.0.0.1"
# How long a stopping tritonserver waits for its live streams (--exit-timeout-secs): long enough for
# streams its clients abandoned to idle out (code2wav 10 s, the decoder 12 s, docs/design.md §5.2),
# short enough to exit inside Kubernetes' default 30 s grace period.
DEFAULT_EXIT_TIMEOUT_S = 25
# glibc's mmap threshold for tritonserver and its stubs: freed buffers this large go back to the system.
MMAP_THRESHOLD_BYTES = 1 << 17


@dataclasses.dataclass(frozen=True)
class TritonInstall:
    """Paths inside the installed `nvidia-pytriton` wheel."""

    binary: Path  # <pytriton>/tritonserver/bin/tritonserver
    backends: Path  # <pytriton>/tritonserver/backends (holds python/ without a stub)
    stubs: Path  # <pytriton>/tritonserver/python_backend_stubs/<major.minor>/triton_python_backend_stub
    libs: Path  # .../site-packages/nvidia_pytriton.libs

    @property
    def stub(self) -> Path:
        return self.stubs / f"{sys.version_info.major}.{sys.version_info.minor}" / STUB_NAME


def find_triton_install() -> TritonInstall:
    """Locate the tritonserver binary, backends, stubs and bundled libraries of the pytriton wheel."""
    try:
        import pytriton
    except ImportError as exc:
        raise ServerError("nvidia-pytriton is not installed in this environment: install the 'serve' extra "
                          "(pip install -e '.[serve]')") from exc
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    install = TritonInstall(binary=root / "bin" / "tritonserver", backends=root / "backends",
                            stubs=root / "python_backend_stubs", libs=root.parent.parent / "nvidia_pytriton.libs")
    needed = {
        "tritonserver binary": install.binary,
        "Python backend library": install.backends / "python" / "libtriton_python.so",
        "Python backend utilities": install.backends / "python" / "triton_python_backend_utils.py",
        f"Python {sys.version_info.major}.{sys.version_info.minor} backend stub": install.stub,
        "bundled libraries": install.libs,
    }
    missing = [f"{what} ({path})" for what, path in needed.items() if not path.exists()]
    if missing:
        raise ServerError("the pytriton wheel lacks: " + "; ".join(missing))
    return install


def default_backend_root() -> Path:
    """Where the private backend directory goes: `build/triton-backends` of a checkout; for an installed
    package, `mimi-code2wav/triton-backends` in the user's cache folder (XDG_CACHE_HOME, ~/.cache)."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file():
        return checkout / "build" / "triton-backends"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "mimi-code2wav" / "triton-backends"


def _install_file(source: Path, target: Path, mode: int) -> None:
    """Copy `source` to `target` unless an identical file is there; atomic, so concurrent callers
    and running servers (which keep the old inode mapped) never see a half-written file."""
    if target.exists() and filecmp.cmp(source, target, shallow=False):
        return
    partial = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    shutil.copyfile(source, partial)
    os.chmod(partial, mode)
    os.replace(partial, target)


def prepare_backend_directory(install: TritonInstall, root: Path | None = None) -> Path:
    """Make a backend directory whose `python/` holds the wheel's Python backend and this interpreter's
    stub side by side, as the backend requires (the wheel is left untouched). Idempotent. Returns the
    directory to pass as `--backend-directory`."""
    root = Path(root) if root is not None else default_backend_root()
    backend_dir = root / f"py{sys.version_info.major}{sys.version_info.minor}"
    python_dir = backend_dir / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for name, mode in (("libtriton_python.so", 0o755), ("triton_python_backend_utils.py", 0o644)):
        _install_file(install.backends / "python" / name, python_dir / name, mode)
    _install_file(install.stub, python_dir / STUB_NAME, 0o755)
    return backend_dir


def _environment_bin() -> Path:
    """The `bin` folder whose `python3` is this interpreter's environment (a venv or not)."""
    candidate = Path(sys.prefix) / "bin"
    return candidate if (candidate / "python3").exists() else Path(sys.executable).parent


def triton_environment(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its Python stubs: this environment's `bin` first on PATH (the
    stub embeds Python in isolated mode and finds the venv through `python3` on PATH), this interpreter's
    LIBDIR (its libpython) then the wheel's libraries first on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = os.pathsep.join(p for p in (str(_environment_bin()), env.get("PATH", "")) if p)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, str(install.libs), env.get("LD_LIBRARY_PATH", "")) if p)
    # The stub must use this environment, whatever the caller's shell points at.
    env.pop("PYTHONHOME", None)
    # Buffers of 128 KiB and more (a layer's cache of one stream is 248-496 KiB) are mapped and given back
    # when freed: glibc's default threshold rises with every such free until they stay on the heap for good.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES))
    return env


def free_ports(count: int, host: str = LOCALHOST) -> list[int]:
    """`count` distinct free ports (held open together while picking, so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_is_free(port: int, host: str = LOCALHOST) -> bool:
    """True when nothing listens on `host:port` (a bind succeeds; connections of a closed listener
    lingering in TIME_WAIT do not count, as they do not stop a new server from binding)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def fetch_metrics(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Scrape a Prometheus text endpoint into {'name{labels}': value} (histogram series included)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            samples[key] = float(value)
    return samples


def metric_value(samples: dict[str, float], name: str, **labels: str) -> float | None:
    """Sum of the samples of metric `name` whose labels include `labels`; None when there is none."""
    total = None
    for key, value in samples.items():
        sample_name, _, label_text = key.partition("{")
        if sample_name == name and all(f'{label}="{expected}"' in label_text for label, expected in labels.items()):
            total = value if total is None else total + value
    return total


class TritonServer:
    """One tritonserver process leading its own process group, its output in `log_path` (None: a temporary
    file); ports left as None (or 0) are picked free at `start()`. `grpc_url`, `http_url`: "host:port" as
    tritonclient takes them; `metrics_url`: "http://host:port/metrics". Use as a context manager, or call
    `start()` (returns at once), `wait_ready()` (polls readiness while the process lives), `stop()`.

    With `access_dir` (TLS and keys, security.write_access_folder) or `watch`, tritonserver runs under
    the entrypoint script, as compose and Kubernetes run it; then `pid` is the script's. `watch`: the
    script's health checks and stub probes kill a hung server or one with a dead stub (`watch_env`
    overrides their WATCHDOG_* settings); without it the script only maps the access folder."""

    name = "tritonserver"  # in messages
    ready_timeout_s = 60.0

    def __init__(self, model_repository: Path | str, *, http_port: int | None = None, grpc_port: int | None = None,
                 metrics_port: int | None = None, allow_metrics: bool = True, host: str = LOCALHOST,
                 log_path: Path | str | None = None, log_verbose: int = 0, exit_timeout_s: int = DEFAULT_EXIT_TIMEOUT_S,
                 python_shm_default_byte_size: int | None = None, backend_root: Path | str | None = None,
                 extra_args: Sequence[str] = (), access_dir: Path | str | None = None, watch: bool = False,
                 watch_env: dict[str, str] | None = None):
        self.model_repository = Path(model_repository).resolve()
        self.host = host
        # 0 means "any free port", as for a socket bind.
        self.http_port, self.grpc_port, self.metrics_port = http_port or None, grpc_port or None, metrics_port or None
        self.allow_metrics = allow_metrics
        self.log_path = Path(log_path) if log_path is not None else None
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.python_shm_default_byte_size = python_shm_default_byte_size
        self.backend_root = backend_root
        self.extra_args = list(extra_args)
        self.access_dir = Path(access_dir).resolve() if access_dir is not None else None
        self.watch = watch
        self.watch_env = dict(watch_env or {})
        # Triton's HTTP endpoint has no TLS: with TLS on gRPC, HTTP and metrics stay on loopback.
        self.http_host = LOCALHOST if self.access_dir and (self.access_dir / "server.pem").exists() else host
        self.shm_prefix = f"{SHM_PREFIX_BASE}{uuid.uuid4().hex[:12]}_"
        self.process: subprocess.Popen | None = None
        self._tritonserver_pid: int | None = None
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.http_host}:{self.http_port}"

    @property
    def metrics_url(self) -> str | None:
        return f"http://{self.http_host}:{self.metrics_port}/metrics" if self.allow_metrics else None

    @property
    def stop_grace_s(self) -> float:
        """A stop waits for the live streams up to the exit timeout, then 10 s more for the unload."""
        return self.exit_timeout_s + 10.0

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        """The exit code once the process has exited (negative: killed by that signal), else None."""
        return self.process.poll() if self.process is not None else None

    def command(self, install: TritonInstall, backend_dir: Path) -> list[str]:
        """The tritonserver command line for this server's settings (it holds any keys: never print it)."""
        cmd = [str(install.binary), f"--model-repository={self.model_repository}", f"--backend-directory={backend_dir}",
               "--disable-auto-complete-config", f"--http-address={self.http_host}", f"--http-port={self.http_port}",
               f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
               f"--exit-timeout-secs={self.exit_timeout_s}", f"--log-verbose={self.log_verbose}",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}", "--allow-gpu-metrics=false"]
        if self.allow_metrics:
            cmd += ["--allow-metrics=true", f"--metrics-address={self.http_host}", f"--metrics-port={self.metrics_port}"]
        else:
            cmd.append("--allow-metrics=false")
        if self.python_shm_default_byte_size is not None:
            cmd.append(f"--backend-config=python,shm-default-byte-size={self.python_shm_default_byte_size}")
        return cmd + self.extra_args

    def _entrypoint(self, command: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """`command` under the entrypoint script, when this server needs it (the class docstring)."""
        if self.access_dir is None and not self.watch:
            return command, env
        settings = {"WATCHDOG_HTTP": f"http://{self.http_url}",
                    "WATCHDOG_ACCESS_DIR": str(self.access_dir) if self.access_dir else "",
                    **({} if self.watch else {"WATCHDOG_CHECKS": "0", "WATCHDOG_PROBE_S": "0"}), **self.watch_env}
        return ["sh", str(ENTRYPOINT), *command], {**env, **settings}

    def tritonserver_pid(self) -> int | None:
        """tritonserver's own pid: `pid`, or under the entrypoint script the one in its process group
        (None until the script has started it; kept once seen)."""
        if self.process is None or self.access_dir is None and not self.watch:
            return self.pid
        if self._tritonserver_pid is None:
            pids = [pid for pid in group_pids(self.pid) if _program(pid) == "tritonserver"]
            self._tritonserver_pid = pids[0] if pids else None
        return self._tritonserver_pid

    def _prepare(self) -> tuple[list[str], dict[str, str]]:
        """Find the wheel's server, prepare the backend directory, pick the ports, name the log: (command, env)."""
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} is not a directory")
        install = find_triton_install()
        backend_dir = prepare_backend_directory(install, self.backend_root)
        if needs_onnxruntime(self.model_repository):
            install_onnxruntime_backend(backend_dir, _install_file)
        wanted = [self.http_port, self.grpc_port] + ([self.metrics_port] if self.allow_metrics else [])
        picked = iter(free_ports(sum(port is None for port in wanted), self.host))
        self.http_port = self.http_port if self.http_port is not None else next(picked)
        self.grpc_port = self.grpc_port if self.grpc_port is not None else next(picked)
        if self.allow_metrics and self.metrics_port is None:
            self.metrics_port = next(picked)
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix=f"tritonserver-{self.http_port}-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        return self._entrypoint(self.command(install, backend_dir), triton_environment(install))

    def readiness(self) -> str | None:
        """None once `/v2/health/ready` answers 200, else what it answered (a model that fails to load
        makes the server exit, a Python stub that cannot start leaves its model loading: not ready)."""
        return http_ready(f"http://{self.http_url}/v2/health/ready", 1.0)

    def log_report(self) -> str:
        """The log's name and tail, for an error message."""
        return f"(log {self.log_path}):\n{log_tail(self.log_path)}"

    def exit_cause(self) -> str:
        """Why the process exited, when its log says (": ..."), else ""."""
        in_use = re.search(r"Socket '([^']+)' already in use", log_tail(self.log_path))
        return f": address {in_use.group(1)} is already in use (choose other ports)" if in_use else ""

    def start(self) -> None:
        """Launch the process (returns at once; see `wait_ready`). Its output goes to `log_path`."""
        if self.process is not None:
            raise ServerError(f"this {type(self).__name__} was already started")
        command, env = self._prepare()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command, preexec_fn = with_parent_death_signal(command)
        with open(self.log_path, "wb") as log:
            self.started_at = time.monotonic()
            # Own process group: Ctrl-C in a terminal does not reach it, and stop() can end it together
            # with its children (Python stubs) and nothing else.
            self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=preexec_fn)

    def wait_ready(self, timeout_s: float | None = None, poll_s: float = 0.05) -> float:
        """Poll `readiness()` until it says ready; returns seconds since `start()`. Raises ServerError with
        the log tail if the process exits first, or if it is not ready within `timeout_s` (default
        `ready_timeout_s`). Does not stop the server."""
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        self.ready_after_s = self.wait_until(self.readiness, timeout_s, poll_s)
        return self.ready_after_s

    def wait_until(self, check: Callable[[], str | None], timeout_s: float, poll_s: float = 0.05,
                   what: str | None = None) -> float:
        """Poll `check()` (None: ready, else what it saw) while the process lives, as `wait_ready` does
        (`what` names what was not ready in the timeout's message; default the server's name)."""
        if self.process is None:
            raise ServerError("wait_ready() before start()")
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"{self.name} exited with code {code} before it was ready{self.exit_cause()} "
                                  f"{self.log_report()}")
            seen = check()
            if seen is None:
                return time.monotonic() - self.started_at
            if time.monotonic() >= deadline:
                raise ServerError(f"{what or self.name} was not ready after {timeout_s:.0f} s: {seen} {self.log_report()}")
            time.sleep(poll_s)

    def start_ready(self) -> float:
        """`start()`, then `wait_ready()` with its defaults."""
        self.start()
        return self.wait_ready()

    def __enter__(self):
        """`start_ready()` (and `stop()` if that fails); `stop()` on exit."""
        try:
            self.start_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def wait(self, timeout_s: float | None = None) -> int:
        """Block until the process exits by itself; returns its exit code."""
        if self.process is None:
            raise ServerError("wait() before start()")
        return self.process.wait(timeout_s)

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the server, SIGKILL its process group after `grace_s` (default `stop_grace_s`), wait
        for its stubs to go, remove the shared-memory regions it created. Idempotent; returns the
        server's exit code (None if never started)."""
        code = None
        if self.process is not None:
            code = stop_process_group(self.process, self.stop_grace_s if grace_s is None else grace_s)
        self.remove_shm_regions()
        return code

    def shm_regions(self) -> list[Path]:
        """Shared-memory regions that this server's Python stubs created and that still exist."""
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))

    def remove_shm_regions(self) -> None:
        for region in self.shm_regions():
            with contextlib.suppress(FileNotFoundError):
                region.unlink()


def _program(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/exe").resolve(strict=True).name
    except OSError:  # exited, or not ours to read
        return ""
