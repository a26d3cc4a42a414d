"""Find and run the `tritonserver` binary that the `nvidia-pytriton` wheel ships, without docker.

The wheel carries a real Triton Inference Server (2.51.0) with only the Python backend. Running it
directly needs three things the wheel does not arrange by itself:

- the Python backend stub built for this interpreter's version must sit next to `libtriton_python.so`
  (`prepare_backend_directory` copies both into a private backend directory);
- `PATH` must start with this environment's `bin`: the stub embeds Python in isolated mode and finds
  the virtual environment through `python3` on `PATH`;
- `LD_LIBRARY_PATH` must put this interpreter's own `libpython` first, then the wheel's bundled
  libraries (`triton_environment`).

A repository with a native `onnxruntime` model also gets Triton's ONNX Runtime backend in the backend
directory (`ort_backend`: from ORT_BACKEND, with ONNX Runtime 1.19.2's library from PyPI).

`TritonServer` (a `processes.ServerProcess`) starts one server in its own process group, waits for
`/v2/health/ready` while checking that the process is alive (a stub that cannot start leaves the server
loading forever), and stops only what it started, including the shared-memory regions its Python stubs
created.
"""

from __future__ import annotations

import contextlib
import dataclasses
import filecmp
import os
import re
import shutil
import socket
import sys
import sysconfig
import tempfile
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator, Sequence

from .ort_backend import install_onnxruntime_backend, needs_onnxruntime
from .processes import ServerError, ServerProcess, http_ready, log_tail
from .security import OPEN, ServerSecurity

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
# glibc's mmap threshold for tritonserver and its stubs (the python-ort stub pins the same with mallopt).
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
        raise ServerError(
            "nvidia-pytriton is not installed in this environment: install the 'serve' extra "
            "(pip install -e '.[serve]')"
        ) from exc
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    install = TritonInstall(
        binary=root / "bin" / "tritonserver",
        backends=root / "backends",
        stubs=root / "python_backend_stubs",
        libs=root.parent.parent / "nvidia_pytriton.libs",
    )
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
    """Make a backend directory whose `python/` holds the wheel's Python backend and this
    interpreter's stub side by side, as the backend requires. Idempotent. Returns the directory to
    pass as `--backend-directory`. The wheel itself is left untouched."""
    root = Path(root) if root is not None else default_backend_root()
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    backend_dir = root / version
    python_dir = backend_dir / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    wheel_python = install.backends / "python"
    _install_file(wheel_python / "libtriton_python.so", python_dir / "libtriton_python.so", 0o755)
    _install_file(
        wheel_python / "triton_python_backend_utils.py",
        python_dir / "triton_python_backend_utils.py",
        0o644,
    )
    _install_file(install.stub, python_dir / STUB_NAME, 0o755)
    return backend_dir


def _environment_bin() -> Path:
    """The `bin` folder whose `python3` is this interpreter's environment (a venv or not)."""
    candidate = Path(sys.prefix) / "bin"
    if (candidate / "python3").exists():
        return candidate
    return Path(sys.executable).parent


def triton_environment(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its Python stubs: this environment's `bin` first on PATH,
    this interpreter's LIBDIR then the wheel's libraries first on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = os.pathsep.join(
        p for p in (str(_environment_bin()), env.get("PATH", "")) if p
    )
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (libdir, str(install.libs), env.get("LD_LIBRARY_PATH", "")) if p
    )
    # The stub must use this environment, whatever the caller's shell points at.
    env.pop("PYTHONHOME", None)
    # Buffers of 128 KiB and more (a layer's cache of one stream is 248-496 KiB) are mapped and given
    # back when freed: glibc's default threshold rises with every such free until they stay on the
    # heap for good.
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
        try:
            samples[key] = float(value)
        except ValueError:
            continue
    return samples


def metric_value(samples: dict[str, float], name: str, **labels: str) -> float | None:
    """Sum of the samples of metric `name` whose labels include `labels`; None when there is none."""
    total = None
    for key, value in samples.items():
        sample_name, _, label_text = key.partition("{")
        if sample_name != name:
            continue
        if any(f'{label}="{expected}"' not in label_text for label, expected in labels.items()):
            continue
        total = value if total is None else total + value
    return total


class TritonServer(ServerProcess):
    """One tritonserver process on loopback ports, started in its own process group.

    Ports left as None (or 0) are picked free at `start()`. Use as a context manager (start, wait for
    readiness, stop on exit) or call `start()`, `wait_ready()`, `stop()` yourself.

    Addresses, once started: `grpc_url` and `http_url` are "host:port" as tritonclient takes them,
    `metrics_url` is the full "http://host:port/metrics" to scrape.
    """

    name = "tritonserver"
    ready_timeout_s = 60.0

    def __init__(
        self,
        model_repository: Path | str,
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        allow_metrics: bool = True,
        host: str = LOCALHOST,
        log_path: Path | str | None = None,
        log_verbose: int = 0,
        exit_timeout_s: int = DEFAULT_EXIT_TIMEOUT_S,
        python_shm_default_byte_size: int | None = None,
        backend_root: Path | str | None = None,
        extra_args: Sequence[str] = (),
        security: ServerSecurity = OPEN,
    ):
        super().__init__(host=host, grpc_port=grpc_port, http_port=http_port, log_path=log_path)
        self.model_repository = Path(model_repository).resolve()
        self.metrics_port = metrics_port or None
        self.allow_metrics = allow_metrics
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.python_shm_default_byte_size = python_shm_default_byte_size
        self.backend_root = backend_root
        self.extra_args = list(extra_args)
        security.validate()
        self.security = security
        # Triton's HTTP endpoint has no TLS: with TLS on gRPC, HTTP and metrics stay on loopback.
        self.http_host = LOCALHOST if security.tls else host
        self.shm_prefix = f"{SHM_PREFIX_BASE}{uuid.uuid4().hex[:12]}_"

    @property
    def http_url(self) -> str:
        return f"{self.http_host}:{self.http_port}"

    @property
    def metrics_url(self) -> str | None:
        return f"http://{self.http_host}:{self.metrics_port}/metrics" if self.allow_metrics else None

    @property
    def probe_headers(self) -> dict[str, str]:
        """The headers of an inference probe (the inference key, where the server requires one)."""
        return self.security.probe_headers()

    @property
    def stop_grace_s(self) -> float:
        """A stop waits for the live streams up to the exit timeout, then 10 s more for the unload."""
        return self.exit_timeout_s + 10.0

    def command(self, install: TritonInstall, backend_dir: Path) -> list[str]:
        """The tritonserver command line for this server's settings (it holds any keys: never print it)."""
        cmd = [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            "--disable-auto-complete-config",
            f"--http-address={self.http_host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--allow-gpu-metrics=false",
        ]
        if self.allow_metrics:
            cmd += [
                "--allow-metrics=true",
                f"--metrics-address={self.http_host}",
                f"--metrics-port={self.metrics_port}",
            ]
        else:
            cmd.append("--allow-metrics=false")
        if self.python_shm_default_byte_size is not None:
            cmd.append(
                f"--backend-config=python,shm-default-byte-size={self.python_shm_default_byte_size}"
            )
        return cmd + self.security.tritonserver_args() + self.extra_args

    # ServerProcess -------------------------------------------------------------------------
    def _prepare(self) -> tuple[list[str], dict[str, str]]:
        """Find the wheel's server, prepare the backend directory, pick the free ports, name the log."""
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
        return self.command(install, backend_dir), triton_environment(install)

    def readiness(self) -> str | None:
        """`/v2/health/ready` answers 200 (a model that fails to load makes the server exit, a Python
        stub that cannot start leaves its model loading: not ready)."""
        return http_ready(f"http://{self.http_url}/v2/health/ready", 1.0)

    def exit_cause(self) -> str:
        in_use = re.search(r"Socket '([^']+)' already in use", log_tail(self.log_path))
        return f": address {in_use.group(1)} is already in use (choose other ports)" if in_use else ""

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the server, SIGKILL its process group after `grace_s` (default: the exit timeout
        plus 10 s), wait for its stubs to go, remove the shared-memory regions it created.
        Idempotent; returns the server's exit code (None if never started)."""
        code = super().stop(grace_s)
        self.remove_shm_regions()
        return code

    def shm_regions(self) -> list[Path]:
        """Shared-memory regions that this server's Python stubs created and that still exist."""
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))

    def remove_shm_regions(self) -> None:
        for region in self.shm_regions():
            with contextlib.suppress(FileNotFoundError):
                region.unlink()


def _port_taken(server: TritonServer) -> bool:
    tail = log_tail(server.log_path, lines=200)
    return "already in use" in tail or "Address in use" in tail


@contextlib.contextmanager
def running_server(
    model_repository: Path | str,
    *,
    ready_timeout_s: float = 60.0,
    attempts: int = 3,
    **kwargs,
) -> Iterator[TritonServer]:
    """Start a TritonServer on free loopback ports, wait until it is ready, yield it, stop it.

    A port picked free can be taken by someone else before the server binds it, and tritonserver 2.51
    now and then aborts while its backends initialise (docs/design.md §7): then it retries (new ports
    where they were picked), up to `attempts` times, saying so on stderr. Any other failure raises
    ServerError with the log tail. Keyword arguments go to TritonServer (fixed ports given there are
    used as they are).
    """
    ports_fixed = any(
        kwargs.get(name) is not None for name in ("http_port", "grpc_port", "metrics_port")
    )
    for attempt in range(1, attempts + 1):
        server = TritonServer(model_repository, **kwargs)
        server.start()
        try:
            server.wait_ready(ready_timeout_s)
        except ServerError as error:
            server.stop()
            crashed = server.process is not None and (server.process.returncode or 0) < 0
            if attempt < attempts and (crashed or (not ports_fixed and _port_taken(server))):
                print(f"tritonserver did not start (attempt {attempt} of {attempts}), starting it again: "
                      f"{str(error).splitlines()[0]}", file=sys.stderr, flush=True)
                continue
            raise
        except BaseException:
            server.stop()
            raise
        break
    try:
        yield server
    finally:
        server.stop()
