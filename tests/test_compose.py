"""docker-compose.yml, docker/export.Dockerfile, docker/export-entrypoint.sh, the `scale` profile's
nginx config (docker/nginx/compose.conf) and the Kubernetes manifests: what the real runs cannot reach.

The compose `cpu`, `bench` and `scale` profiles run on containers (test_compose_cpu.py,
test_compose_scale.py). What needs a GPU or the NGC images (the GPU servers' reservations and memory
pools, the TensorRT jobs, the default image tags) and the Kubernetes manifests (no cluster here) are
checked structurally, as a user's `docker compose` would interpolate the file with no variables set;
the entrypoint's jobs also run on this machine with their folders pointed into tmp dirs.
"""

from __future__ import annotations

import filecmp
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from mimi_code2wav.client.protocol import NUM_CODEBOOKS, SAMPLES_PER_FRAME, STREAM_KEY_HEADER

from helpers import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "docker" / "export.Dockerfile"
DOCKERIGNORE = REPO_ROOT / "docker" / "export.Dockerfile.dockerignore"
ENTRYPOINT = REPO_ROOT / "docker" / "export-entrypoint.sh"
CHECKED_IN_CONFIG = REPO_ROOT / "model_repository" / "mimi_decoder" / "config.pbtxt"
CODE2WAV_DIR = REPO_ROOT / "model_repository" / "code2wav"
PROXY_CONFIG = REPO_ROOT / "docker" / "nginx" / "compose.conf"
WATCHDOG = REPO_ROOT / "server" / "triton-watchdog.sh"
KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
WATCHDOG_IN_CONTAINER = "/opt/code2wav/triton-watchdog.sh"
ACCESS_IN_CONTAINER = "/run/code2wav-access"

# NGC release -> the tritonserver (and SDK: perf_analyzer, tritonclient) version it carries.
NGC_TRITON_VERSIONS = {"24.10": "2.51.0", "26.11": "2.75.0"}
# The default images (TRITON_IMAGE, TRITON_SDK_IMAGE unset), and the release the tests run (the pip
# server's), which the same variables select.
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:26.11-py3"
SDK_IMAGE = "nvcr.io/nvidia/tritonserver:26.11-py3-sdk"
TESTED_TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
TESTED_SDK_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3-sdk"

# The `scale` profile: replicas of the GPU server behind triton-proxy (nginx, stream affinity).
REPLICAS = ("triton-replica-0", "triton-replica-1", "triton-replica-2")
PROXY = "triton-proxy"
# nginx 1.27.3 is the first open-source release with `server ... resolve` in an upstream.
PROXY_MIN_NGINX = (1, 27, 3)
GPU_SERVICES = ("triton", "tensorrt-plan", "triton-tensorrt", *REPLICAS)
SERVERS = ("triton", "triton-cpu", "triton-tensorrt")
PROFILES = {
    "export": None,
    "triton": None,
    "triton-cpu": ["cpu"],
    "tensorrt-plan": ["tensorrt"],
    "tensorrt-render": ["tensorrt"],
    "triton-tensorrt": ["tensorrt"],
    "perf": ["bench"],
    **{replica: ["scale"] for replica in REPLICAS},
    PROXY: ["scale"],
}
# (server, the one-shot service that writes its repository, that service's variable naming the folder)
REPOSITORY_WRITERS = (
    ("triton", "export", "MODELS_DIR"),
    *((replica, "export", "MODELS_DIR") for replica in REPLICAS),
    ("triton-cpu", "export", "MODELS_CPU_DIR"),
    ("triton-tensorrt", "tensorrt-render", "MODELS_DIR"),
)
# service -> the service whose successful completion it waits for
COMPLETION_DEPENDENCIES = {
    "triton": "export",
    "triton-cpu": "export",
    "tensorrt-plan": "export",
    "tensorrt-render": "tensorrt-plan",
    "triton-tensorrt": "tensorrt-render",
    **{replica: "export" for replica in REPLICAS},
}
INSTALL_AT_START = re.compile(r"\b(pip3?|uv|conda|apt-get|apt|apk|git|wget)\b|curl\s|pip install|git clone")

_VARIABLE = re.compile(r"\$(?:\$|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, env: dict[str, str]):
    """Compose variable interpolation (`${X}`, `${X:-d}`, `${X-d}`, `$X`, `$$`) over a loaded document."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("bare")
        op, default = match.group("op"), match.group("default") or ""
        if op in (":-", ":?"):
            return env.get(name) or default
        if op in ("-", "?"):
            return env.get(name, default)
        return env.get(name, "")

    return _VARIABLE.sub(substitute, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    """The compose file as `docker compose` sees it in a shell that sets none of its variables."""
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), {})


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def volume_mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """Container path -> (source, read_only) of a service's short- and long-syntax volumes."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mounts[volume["target"]] = (volume.get("source", ""), bool(volume.get("read_only")))
            continue
        parts = volume.split(":")
        source, target = parts[0], parts[1]
        mode = parts[2] if len(parts) > 2 else "rw"
        mounts[target] = (source, "ro" in mode.split(","))
    return mounts


def command_args(service: dict) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def flag_value(args: list[str], flag: str) -> str | None:
    for arg in args:
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


# ---- the compose file ------------------------------------------------------------------------------

def dependency_closure(services: dict, name: str) -> set[str]:
    """`name` and every service `docker compose up name` starts with it."""
    pending, needed = [name], set()
    while pending:
        current = pending.pop()
        needed.add(current)
        pending += [dep for dep in services[current].get("depends_on", {}) if dep not in needed]
    return needed


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_service(compose, services, name):
    """Its profile, a pinned image, a GPU only where one is needed, waits for its writer's success,
    installs nothing at start, and publishes ports on loopback only."""
    assert "name" not in compose, "a top-level `name:` is rejected by docker-compose 1.29 (Debian's)"
    service = services[name]
    assert service.get("profiles") == PROFILES[name]
    repository, _, tag = service["image"].rpartition(":")
    assert repository and "/" not in tag and tag != "latest", f"{name}: image {service['image']!r} floats"
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if name in GPU_SERVICES:
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
    else:
        assert not devices, f"{name} must start on a host without a GPU"
    if name in COMPLETION_DEPENDENCIES:
        condition = {"condition": "service_completed_successfully"}
        assert service["depends_on"] == {COMPLETION_DEPENDENCIES[name]: condition}, name
    for key in ("command", "entrypoint"):
        value = service.get(key)
        text = value if isinstance(value, str) else " ".join(value or [])
        assert not INSTALL_AT_START.search(text), f"{name}: {key} installs or downloads at start: {text}"
    for port in service.get("ports", []):
        assert str(port).count(":") == 2 and str(port).startswith("127.0.0.1:"), f"{name}: {port!r} beyond loopback"


def test_images_and_the_tested_ngc_release_one_variable_away(services):
    """The default images are the newest release; TRITON_IMAGE / TRITON_SDK_IMAGE select the release
    whose tritonserver the client pins and the local server (and so the tests) run."""
    for name in (*SERVERS, "tensorrt-plan", *REPLICAS):
        assert services[name]["image"] == TRITON_IMAGE, name
    assert services["perf"]["image"] == SDK_IMAGE
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    (client_pin,) = [req for req in pyproject["project"]["optional-dependencies"]["client"] if req.startswith("tritonclient")]
    release = TESTED_TRITON_IMAGE.rsplit(":", 1)[1].split("-")[0]
    assert NGC_TRITON_VERSIONS[release] == client_pin.split("==")[1]
    assert SDK_IMAGE.startswith(TRITON_IMAGE) and TESTED_SDK_IMAGE.startswith(TESTED_TRITON_IMAGE)
    tested = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()),
                         {"TRITON_IMAGE": TESTED_TRITON_IMAGE, "TRITON_SDK_IMAGE": TESTED_SDK_IMAGE})["services"]
    for name in (*SERVERS, "tensorrt-plan", *REPLICAS):
        assert tested[name]["image"] == TESTED_TRITON_IMAGE, name
    assert tested["perf"]["image"] == TESTED_SDK_IMAGE
    header = COMPOSE_FILE.read_text().split("\n\n")[0]
    assert all(version in header for version in ("26.11", "2.75.0", "24.10", "2.51.0"))


@pytest.mark.parametrize(("name", "writer", "variable"), REPOSITORY_WRITERS)
def test_every_server(compose, services, name, writer, variable):
    """Runs under the watchdog with tini as PID 1 and restarts; drains before Docker kills it; serves,
    read-only, the named volume its writer renders into (at the writer's $variable)."""
    server = services[name]
    args = command_args(server)
    assert args[:3] == ["sh", WATCHDOG_IN_CONTAINER, "tritonserver"], args
    mounts = volume_mounts(server)
    assert mounts[WATCHDOG_IN_CONTAINER] == ("./server/triton-watchdog.sh", True)
    assert server.get("init") is True and server.get("restart") == "unless-stopped", name
    grace_s = int(re.fullmatch(r"(\d+)s", server["stop_grace_period"]).group(1))
    assert grace_s > int(flag_value(args, "--exit-timeout-secs") or 30), f"{name}: Docker kills tritonserver before it drains"
    # The Python backend fails to grow its pool in Docker's default 64 MB /dev/shm.
    assert re.fullmatch(r"\d+(gb|g)", str(server.get("shm_size", "")).lower()), f"{name}: shm_size too small or unset"
    test = server["healthcheck"]["test"]
    assert test[:2] == ["CMD", "curl"] and "-fsS" in test and test[-1] == "http://localhost:8000/v2/health/ready"
    assert server["healthcheck"].get("start_period"), "a server loading models needs a start period"
    for flag in ("--http-port", "--grpc-port", "--metrics-port"):
        assert flag_value(args, flag) is None, f"{name}: {flag} moved away from the published port"
    if name in REPLICAS:
        assert not server.get("ports") and "networks" not in server, f"{name}: clients must go through {PROXY}"
    else:
        assert {int(str(port).rsplit(":", 1)[1]) for port in server["ports"]} == {8000, 8001, 8002}
    written_to = services[writer]["environment"][variable]
    volume, read_only = volume_mounts(services[writer])[written_to]
    assert not read_only, f"{writer} cannot write {written_to}"
    assert flag_value(args, "--model-repository") == "/models" and mounts["/models"] == (volume, True)
    assert volume in compose["volumes"], f"{volume} is a bind mount: the export would write into the host tree"


def test_profiles_start_what_they_need(services):
    """`--profile cpu up triton-cpu` needs no GPU; `--profile scale up triton-proxy` must not start
    `triton`, which publishes the same host ports; each replica runs what `triton` runs."""
    assert dependency_closure(services, "triton-cpu") == {"triton-cpu", "export"}
    assert dependency_closure(services, PROXY) == {PROXY, "export", *REPLICAS}
    assert services[PROXY]["depends_on"] == {replica: {"condition": "service_healthy"} for replica in REPLICAS}
    for replica in REPLICAS:
        for key in ("image", "entrypoint", "command", "volumes", "healthcheck", "shm_size", "ulimits",
                    "stop_grace_period", "restart", "deploy"):
            assert services[replica][key] == services["triton"][key], f"{replica}: {key} differs from triton's"


def test_checked_in_config_loads_model_onnx():
    """The native ORT backend loads `model.onnx` unless the config names another file; the export
    writes <repository>/mimi_decoder/1/model.onnx (checked by the entrypoint tests below)."""
    config = CHECKED_IN_CONFIG.read_text()
    assert re.search(r'^name: "mimi_decoder"$', config, re.M) and re.search(r'^backend: "onnxruntime"$', config, re.M)
    assert "default_model_filename" not in config


def test_export_paths_and_weights(services):
    """trtexec's command lines carry absolute paths: every job sees the export where it was written.
    The weights are mounted read-only into the export alone."""
    export = services["export"]
    export_dir = export["environment"]["EXPORT_DIR"]
    export_volume = volume_mounts(export)[export_dir][0]
    for name in ("tensorrt-plan", "tensorrt-render"):
        env = services[name]["environment"]
        assert env["EXPORT_DIR"] == export_dir and env["MAX_BATCH_SIZE"] == export["environment"]["MAX_BATCH_SIZE"]
        assert volume_mounts(services[name])[export_dir][0] == export_volume, name
    assert volume_mounts(services["tensorrt-plan"])[export_dir][1] is False, "tensorrt-plan writes the plan"
    # tensorrt-plan runs the entrypoint from the checkout mounted into the NGC image.
    plan_args = command_args(services["tensorrt-plan"])
    workspace = services["tensorrt-plan"]["working_dir"]
    assert volume_mounts(services["tensorrt-plan"])[workspace] == (".", True)
    script = Path(plan_args[1])
    assert plan_args[0] == "sh" and script.is_relative_to(workspace) and plan_args[2] == "tensorrt-plan"
    assert (REPO_ROOT / script.relative_to(workspace)).is_file()
    weights_root = export["environment"]["WEIGHTS_ROOT"]
    assert volume_mounts(export)[weights_root] == ("./weights", True)
    assert "${MIMI_WEIGHTS_DIR:-./weights}:" in COMPOSE_FILE.read_text()
    assert [name for name, service in services.items() if weights_root in volume_mounts(service)] == ["export"]
    code = "\n".join(line for line in ENTRYPOINT.read_text().splitlines() if not line.lstrip().startswith("#"))
    assert not INSTALL_AT_START.search(code)


# ---- the `scale` profile: replicas behind nginx ------------------------------------------------------

def test_proxy_service(services):
    proxy = services[PROXY]
    repository, _, tag = proxy["image"].rpartition(":")
    assert repository == "nginx", proxy["image"]
    version = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)\.(\d+)", tag).groups())
    assert version >= PROXY_MIN_NGINX, f"{proxy['image']}: compose.conf re-resolves replicas (`resolve`), nginx >= 1.27.3"
    # The proxy takes the single server's host ports (and variables): clients do not change.
    assert proxy["ports"] == ["127.0.0.1:8000:8000", "127.0.0.1:8001:8001"]
    text = COMPOSE_FILE.read_text()
    assert '"127.0.0.1:${TRITON_HTTP_PORT:-8000}:8000"' in text and '"127.0.0.1:${TRITON_GRPC_PORT:-8001}:8001"' in text
    assert volume_mounts(proxy) == {"/etc/nginx/nginx.conf": ("./docker/nginx/compose.conf", True),
                                    "/etc/nginx/code2wav-access.conf": ("./docker/nginx/access-plaintext.conf", True),
                                    ACCESS_IN_CONTAINER: ("./docker/access", True)}
    test = proxy["healthcheck"]["test"]
    # The official image has busybox's wget and no curl (its Dockerfile removes what fetched the keys).
    assert test[:2] == ["CMD", "wget"] and test[-1] == "http://localhost:8000/v2/health/ready", test
    # The image stops nginx with SIGQUIT (graceful), which compose.conf bounds with worker_shutdown_timeout.
    shutdown_s = int(re.search(r"^worker_shutdown_timeout (\d+)s;$", PROXY_CONFIG.read_text(), re.M).group(1))
    assert int(re.fullmatch(r"(\d+)s", proxy["stop_grace_period"]).group(1)) > shutdown_s
    # perf (and anything else on the compose network) reaches the proxy as `triton`.
    assert proxy["networks"]["default"]["aliases"] == ["triton"]
    assert "deploy" not in proxy, "the proxy needs no GPU"


def upstream_servers(config: str, upstream: str) -> list[str]:
    block = re.search(r"^    upstream " + upstream + r" \{\n(.*?)^    \}", config, re.M | re.S)
    assert block, f"no upstream {upstream} in {PROXY_CONFIG}"
    body = block.group(1)
    assert re.search(r"^        hash \$code2wav_stream_key consistent;$", body, re.M), f"{upstream}: no consistent hash on the stream key"
    assert re.search(r"^        zone \w+ \d+k;$", body, re.M), f"{upstream}: `resolve` needs a shared-memory zone"
    return re.findall(r"^        server (\S+) resolve max_fails=\d+ fail_timeout=\d+s;$", body, re.M)


def test_proxy_config_hashes_streams_over_each_replica_by_name(services):
    """One `server` per replica service, by its own name: nginx places a server on the hash ring by
    that name, so the addresses of one name (`--scale`) would share a place and take its streams
    round-robin."""
    config = PROXY_CONFIG.read_text()
    replicas = sorted(name for name in services if name.startswith("triton-replica-"))
    assert replicas == sorted(REPLICAS)
    assert upstream_servers(config, "code2wav_grpc") == [f"{replica}:8001" for replica in replicas]
    assert upstream_servers(config, "code2wav_http") == [f"{replica}:8000" for replica in replicas]
    # The stream key: the `code2wav-stream` metadata, one fixed key when it is missing (an empty key
    # would be balanced round-robin by nginx).
    assert re.search(r'map \$http_code2wav_stream \$code2wav_stream_key \{\n\s+""\s+"[^"]+";\n\s+default \$http_code2wav_stream;', config)
    assert "resolver 127.0.0.11 " in config, "Docker's embedded DNS re-resolves the replicas"
    assert re.search(r"^        include /etc/nginx/code2wav-access.conf;\n        http2 on;$", config, re.M)
    assert re.search(r"^        listen 8000;$", config, re.M)
    assert re.search(r"^            grpc_pass \$code2wav_replicas;$", config, re.M)
    # The included listener: plaintext by default, TLS to clients and to the replicas with CODE2WAV_PROXY_ACCESS=tls.
    nginx = PROXY_CONFIG.parent
    plaintext = (nginx / "access-plaintext.conf").read_text()
    assert re.search(r"^listen 8001;$", plaintext, re.M) and "set $code2wav_replicas grpc://code2wav_grpc;" in plaintext
    tls = (nginx / "access-tls.conf").read_text()
    assert re.search(r"^listen 8001 ssl;$", tls, re.M) and "set $code2wav_replicas grpcs://code2wav_grpc;" in tls
    assert "grpc_ssl_verify on;" in tls and "ssl_certificate /run/code2wav-access/server.pem;" in tls
    assert re.search(r"^            grpc_next_upstream error timeout;$", config, re.M)
    assert "daemon off;" not in config, "the image's command sets it; a second one fails nginx's start"


def test_perf_service_runs_perf_sh_against_the_server(services):
    perf = services["perf"]
    args = command_args(perf)
    assert args[:2] == ["bash", "client/perf.sh"]
    assert (REPO_ROOT / args[1]).is_file()
    assert volume_mounts(perf)[perf["working_dir"]] == (".", True)
    # perf.sh writes its inputs and CSV under BUILD_DIR: it must be a writable mount.
    build_dir = perf["environment"]["BUILD_DIR"]
    assert volume_mounts(perf)[build_dir][1] is False
    host, port = perf["environment"]["URL"].split(":")
    assert port == "8001"
    reachable = {"triton"} | {alias for name in SERVERS for alias in services[name].get("networks", {}).get("default", {}).get("aliases", [])}
    assert host in reachable and reachable == {"triton"}


def test_compose_v1_reads_the_compose_file():
    """Debian's docker-compose 1.29 (v1), where it is installed: the file keeps to what v1 reads."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose (v1) is not installed; Compose v2 checks the file in the next test")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("COMPOSE_", "DOCKER_"))}
    result = subprocess.run(["docker-compose", "-f", str(COMPOSE_FILE), "config", "-q"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.compose
@pytest.mark.parametrize("files", [("docker-compose.yml",), ("docker-compose.yml", "docker-compose.cpu.yml")],
                         ids=["gpu", "with-cpu-overlay"])
def test_compose_v2_validates_the_files(docker_env, files):
    """`docker compose config -q` of the files as the README combines them, every profile, with the
    Compose v2 the compose tests use (benchmarks/docker_env.py)."""
    args = [arg for name in files for arg in ("-f", name)]
    env = {key: value for key, value in docker_env.items() if not key.startswith("COMPOSE_")}
    result = subprocess.run(["docker", "compose", *args, "--profile", "*", "config", "-q"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# ---- the export image -------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        lines.append(current.strip())
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def dockerfile_args() -> dict[str, str]:
    return dict(arguments.split("=", 1) for instruction, arguments in dockerfile_instructions()
                if instruction == "ARG" and "=" in arguments)


def test_dockerfile_pins_its_base_image():
    args = dockerfile_args()
    froms = [arguments for instruction, arguments in dockerfile_instructions() if instruction == "FROM"]
    assert len(froms) == 1
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], froms[0].split()[0])
    repository, _, tag = image.rpartition(":")
    assert repository == "python" and tag.startswith("3.11."), f"base image {image!r}: pin a patch release"
    assert tag != "latest" and "@" not in repository


def test_dockerfile_torch_is_pyprojects_cpu_build():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    torch_pins = [req for req in pyproject["project"]["optional-dependencies"]["export"] if req.startswith("torch==")]
    assert len(torch_pins) == 1
    args = dockerfile_args()
    assert args["TORCH_VERSION"] == torch_pins[0].split("==")[1]
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(arguments for instruction, arguments in dockerfile_instructions() if instruction == "RUN")
    assert 'torch_source="--index-url ${TORCH_INDEX_URL}"' in runs
    assert 'pip install --no-deps ${torch_source} "torch==${TORCH_VERSION}+cpu"' in runs
    # Everything else from pyproject's extra under the project's constraints, at build time.
    assert "pip install -c requirements/constraints.txt -r /tmp/requirements-export.txt" in runs
    assert "['optional-dependencies']['export']" in runs


def dockerignore_allows(path: str) -> bool:
    """Whether docker/export.Dockerfile.dockerignore keeps `path` in the build context (last match wins,
    a pattern matching a parent folder covers what is inside)."""
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        regex = re.escape(pattern.rstrip("/")).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        rules.append((re.compile(regex + r"\Z"), negate))
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    allowed = True
    for regex, negate in rules:
        if any(regex.match(candidate) for candidate in candidates):
            allowed = negate
    return allowed


def test_build_context_keeps_model_files_out():
    """What the image copies is checked by building it (tests/test_compose_cpu.py); model files, exports
    and environments must never enter the build context of either builder."""
    for kept_out in ("weights/model.safetensors", "build/export/f1/model.onnx", ".venv/bin/python",
                     "model_repository/mimi_decoder/1/model.onnx", "export/__pycache__/spec.cpython-311.pyc"):
        assert not dockerignore_allows(kept_out), kept_out


# ---- the entrypoint's jobs, run here -----------------------------------------------------------------

def run_entrypoint(job: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    base = {key: value for key, value in os.environ.items()
            if not key.startswith(("MIMI_", "EXPORT_", "RENDER_", "TENSORRT_", "MODELS_"))}
    base.update(
        PYTHON=sys.executable,
        WEIGHTS_ROOT=str(tmp_path / "weights"),
        EXPORT_DIR=str(tmp_path / "export"),
        MODELS_DIR=str(tmp_path / "models"),
        MODELS_CPU_DIR=str(tmp_path / "models-cpu"),
        TRTEXEC=str(tmp_path / "trtexec"),
    )
    base.update(env)
    return subprocess.run(["sh", str(ENTRYPOINT), job], cwd=tmp_path, env=base, capture_output=True, text=True, timeout=600)


def test_entrypoint_without_weights_says_how_to_mount_them(tmp_path):
    (tmp_path / "weights").mkdir()
    result = run_entrypoint("export", tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"no Mimi weights at {tmp_path / 'weights'}" in result.stderr
    assert "MIMI_WEIGHTS_DIR" in result.stderr and "MIMI_RANDOM_INIT=1" in result.stderr
    assert not (tmp_path / "export").exists() and not (tmp_path / "models").exists()


def test_entrypoint_rejects_unknown_jobs_and_missing_inputs(tmp_path):
    result = run_entrypoint("serve", tmp_path)
    assert result.returncode == 2 and "unknown job 'serve'" in result.stderr
    result = run_entrypoint("tensorrt-plan", tmp_path)
    assert result.returncode == 2 and "the export service writes it" in result.stderr
    result = run_entrypoint("tensorrt-render", tmp_path)
    assert result.returncode == 2 and "the tensorrt-plan service builds it" in result.stderr


FAKE_TRTEXEC = """\
#!/bin/sh
# Stands in for trtexec: records its command line and writes the engine file it was asked for.
printf '%s\\n' "$*" >> "{calls}"
for arg in "$@"; do
    case $arg in --saveEngine=*) printf 'engine' > "${{arg#--saveEngine=}}" ;; esac
done
"""


@pytest.mark.slow
def rendered_pool_args(export_dir: Path, streams: int, max_batch_size: int) -> list[str]:
    """The pool flags for an export, from the memory math written out here (not from render's code):
    per stream 2 x its state (input and output buffers), plus one batch of new output buffers."""
    import json

    from mimi_code2wav.export.spec import DecoderSpec

    spec = DecoderSpec.from_dict(json.loads((export_dir / "manifest.json").read_text())["spec"])
    state = spec.state_bytes_per_stream()
    assert state == 8177156  # fp32 KV: 8 x 2 x 8 x 248 x 64 floats + 12672 conv floats + 1 int32
    mib = 2**20
    cuda = -(-(2 * streams + max_batch_size) * state // mib) * mib
    io = NUM_CODEBOOKS * 16 * 4 + SAMPLES_PER_FRAME * 16 * 4
    pinned = max(256 * mib, -(-max_batch_size * (state + io) // mib) * mib)
    return [f"--cuda-memory-pool-byte-size=0:{cuda}", f"--pinned-memory-pool-byte-size={pinned}"]


@pytest.mark.parametrize("name", ("triton", "triton-tensorrt", *REPLICAS))
def test_gpu_servers_take_the_rendered_memory_pools(services, name, tmp_path):
    """The GPU servers start through a shell that appends the flags of /models/tritonserver.args
    (rendered by the export) to their command, after the NGC image's own entrypoint."""
    entrypoint = services[name]["entrypoint"]
    assert entrypoint[:3] == ["/opt/nvidia/nvidia_entrypoint.sh", "sh", "-c"], entrypoint
    # Run the same shell line and the watchdog here, with echo standing in for the server.
    args_file = tmp_path / "tritonserver.args"
    args_file.write_text("--cuda-memory-pool-byte-size=0:1048576\n--pinned-memory-pool-byte-size=268435456\n")
    script = entrypoint[3].replace("/models/tritonserver.args", str(args_file))
    sh, watchdog, server = command_args(services[name])[:3]
    assert (watchdog, server) == (WATCHDOG_IN_CONTAINER, "tritonserver")
    result = subprocess.run(["sh", "-c", script, *entrypoint[4:], sh, str(WATCHDOG), "echo", "--model-repository=/models"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["--model-repository=/models", "--cuda-memory-pool-byte-size=0:1048576",
                                     "--pinned-memory-pool-byte-size=268435456"]
    # Without the file the server does not start on default pools.
    args_file.unlink()
    result = subprocess.run(["sh", "-c", script, *entrypoint[4:], "echo", "x"], capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "tritonserver.args" in result.stderr


def test_entrypoint_jobs_write_the_served_repositories(tmp_path, moshi_checkpoint, onnx_fp32, repository_for):
    """export -> tensorrt-plan -> tensorrt-render with a moshi-format checkpoint as the mounted weights.

    The export folder starts with the session's export of the same checkpoint, so the job finds it
    up to date instead of exporting again (which is what a second `docker compose up` does).
    """
    checkpoint = moshi_checkpoint[0]
    weights = tmp_path / "weights"
    weights.mkdir()
    try:
        os.link(checkpoint, weights / checkpoint.name)
    except OSError:
        shutil.copy2(checkpoint, weights / checkpoint.name)
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    for name in ("manifest.json", "model.onnx"):
        shutil.copy2(onnx_fp32 / name, export_dir / name)
    calls = tmp_path / "trtexec-calls.txt"
    trtexec = tmp_path / "trtexec"
    trtexec.write_text(FAKE_TRTEXEC.format(calls=calls))
    trtexec.chmod(0o755)

    result = run_entrypoint("export", tmp_path, MIMI_WEIGHTS=checkpoint.name)
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stderr and "nothing to do" in result.stderr, result.stderr

    # GPU repository: the checked-in config, model.onnx where that config expects it, code2wav as tracked.
    models = tmp_path / "models"
    assert (models / "mimi_decoder" / "config.pbtxt").read_text() == CHECKED_IN_CONFIG.read_text()
    assert "equals the checked-in" in result.stderr
    gpu_config = CHECKED_IN_CONFIG.read_text()
    cpu_config = (tmp_path / "models-cpu" / "mimi_decoder" / "config.pbtxt").read_text()
    assert "kind: KIND_CPU" in cpu_config and cpu_config == gpu_config.replace("KIND_GPU", "KIND_CPU")
    # The CPU profile serves exactly the repository the contract suite runs on the native target.
    suite = repository_for("onnxruntime")
    for config in ("mimi_decoder/config.pbtxt", "code2wav/config.pbtxt"):
        assert (tmp_path / "models-cpu" / config).read_text() == (suite / config).read_text(), config
    for repository in (models, tmp_path / "models-cpu"):
        onnx = repository / "mimi_decoder" / "1" / "model.onnx"
        assert onnx.stat().st_size == (export_dir / "model.onnx").stat().st_size
        assert os.path.samefile(onnx, export_dir / "model.onnx") or filecmp.cmp(onnx, export_dir / "model.onnx", shallow=False)
        for file in ("config.pbtxt", "1/model.py"):
            assert (repository / "code2wav" / file).read_bytes() == (CODE2WAV_DIR / file).read_bytes()
    # The GPU repository carries the memory-pool flags for its streams; the CPU one needs none.
    assert sorted(p.name for p in models.iterdir()) == ["code2wav", "mimi_decoder", "tritonserver.args"]
    assert sorted(p.name for p in (tmp_path / "models-cpu").iterdir()) == ["code2wav", "mimi_decoder"]
    expected_pools = rendered_pool_args(export_dir, streams=1024, max_batch_size=64)
    assert (models / "tritonserver.args").read_text().splitlines() == expected_pools

    # trtexec command lines, one argument per line, with the paths the NGC job will see.
    for precision in ("fp32", "fp16"):
        args = (export_dir / "tensorrt" / f"trtexec-{precision}.args").read_text().splitlines()
        assert args[0] == str(trtexec)
        assert f"--onnx={export_dir / 'model.onnx'}" in args
        assert f"--saveEngine={export_dir / 'tensorrt' / f'model-{precision}.plan'}" in args
        assert any(arg.startswith("--maxShapes=codes:64x") for arg in args)
        assert ("--fp16" in args) == (precision == "fp16")

    # tensorrt-plan builds once, then finds the plan up to date until told to rebuild.
    plan = export_dir / "tensorrt" / "model-fp16.plan"
    for expected_calls, env in ((1, {}), (1, {}), (2, {"TENSORRT_REBUILD": "1"})):
        result = run_entrypoint("tensorrt-plan", tmp_path, TENSORRT_FP16="1", **env)
        assert result.returncode == 0, result.stderr
        assert len(calls.read_text().splitlines()) == expected_calls, result.stderr
        assert plan.read_text() == "engine"
    assert "--fp16" in calls.read_text().split()

    # tensorrt-render: the TensorRT repository around that plan.
    trt_models = tmp_path / "models-tensorrt"
    result = run_entrypoint("tensorrt-render", tmp_path, TENSORRT_FP16="1", MODELS_DIR=str(trt_models))
    assert result.returncode == 0, result.stderr
    trt_config = (trt_models / "mimi_decoder" / "config.pbtxt").read_text()
    assert 'backend: "tensorrt"' in trt_config and "kind: KIND_GPU" in trt_config and "max_batch_size: 64" in trt_config
    assert (trt_models / "mimi_decoder" / "1" / "model.plan").read_text() == "engine"
    assert (trt_models / "tritonserver.args").read_text().splitlines() == expected_pools
    assert (trt_models / "code2wav" / "1" / "model.py").is_file()


# ---- Kubernetes (structure only: no cluster here) ----------------------------------------------------

def kubernetes_objects(*files: str) -> dict[tuple[str, str], dict]:
    """(kind, name) -> object, as `kubectl apply -f` of `files` in that order leaves them."""
    objects = {}
    for name in files:
        for document in yaml.safe_load_all((KUBERNETES_DIR / name).read_text()):
            if document:
                objects[(document["kind"], document["metadata"]["name"])] = document
    return objects


def test_kubernetes_manifests_hash_streams_over_the_ready_pods(services):
    objects = kubernetes_objects("code2wav-triton.yaml", "gateway-envoy.yaml")
    deployment = objects[("Deployment", "code2wav-triton")]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (triton,) = pod["spec"]["containers"]
    (export,) = pod["spec"]["initContainers"]
    assert triton["image"] == TRITON_IMAGE  # compose's default
    assert export["args"] == ["export"] and export["image"].endswith("/mimi-code2wav-export:0.1.0")
    # The init container renders the repository into the volume Triton serves read-only.
    models = {mount["mountPath"]: mount for mount in triton["volumeMounts"]}["/models"]
    assert models["readOnly"] and {"name": models["name"], "mountPath": "/models"} in export["volumeMounts"]
    # It starts as compose's `triton` does: the rendered pools appended, tritonserver under the
    # watchdog (from a ConfigMap), TLS and keys from an optional Secret (`$$` is Kubernetes' escape
    # for a literal `$`, as compose's).
    assert [arg.replace("$$", "$") for arg in triton["command"]] == services["triton"]["entrypoint"]
    compose_args = [arg for arg in command_args(services["triton"]) if not arg.startswith("--log-verbose=")]
    assert triton["args"] == compose_args and triton["args"][1] == WATCHDOG_IN_CONTAINER
    mounts = {mount["mountPath"]: mount for mount in triton["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    watchdog = mounts[str(Path(WATCHDOG_IN_CONTAINER).parent)]
    assert volumes[watchdog["name"]]["configMap"] == {"name": "code2wav-watchdog"}
    assert f"--from-file=server/{WATCHDOG.name}" in (KUBERNETES_DIR / "code2wav-triton.yaml").read_text()
    assert ACCESS_IN_CONTAINER in volume_mounts(services["triton"])
    access = mounts[ACCESS_IN_CONTAINER]
    assert access["readOnly"] and volumes[access["name"]]["secret"] == {"secretName": "code2wav-access", "optional": True}
    ports = {port["name"]: port["containerPort"] for port in triton["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert triton["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1
    exit_timeout_s = int(next(arg for arg in triton["args"] if arg.startswith("--exit-timeout-secs=")).split("=")[1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > exit_timeout_s

    service = objects[("Service", "code2wav-triton")]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    grpc_port = next(port for port in service["spec"]["ports"] if port["name"] == "grpc")
    assert grpc_port["targetPort"] in ports and grpc_port["appProtocol"] == "kubernetes.io/h2c"

    route = objects[("GRPCRoute", "code2wav")]
    assert [parent["name"] for parent in route["spec"]["parentRefs"]] == ["code2wav"] and ("Gateway", "code2wav") in objects
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["name"], backend["port"]) == ("code2wav-triton", grpc_port["port"])

    policy = objects[("BackendTrafficPolicy", "code2wav-stream-affinity")]["spec"]
    assert policy["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "GRPCRoute", "name": "code2wav"}]
    assert policy["loadBalancer"] == {"type": "ConsistentHash",
                                      "consistentHash": {"type": "Headers", "headers": [{"name": STREAM_KEY_HEADER}]}}
    assert policy["timeout"]["http"]["requestTimeout"] == "0s", "a route timeout would cut long gRPC streams"
    assert f"httpHeaderName: {STREAM_KEY_HEADER}" in (KUBERNETES_DIR / "gateway-envoy.yaml").read_text()


def test_kubernetes_tls_gateway_terminates_and_checks_the_pods():
    """gateway-envoy-tls.yaml, applied after gateway-envoy.yaml: the Gateway's one listener is TLS on
    the same port, and the gateway speaks TLS to the Service's gRPC port, checking the pods' name."""
    plain = kubernetes_objects("code2wav-triton.yaml", "gateway-envoy.yaml")
    objects = kubernetes_objects("code2wav-triton.yaml", "gateway-envoy.yaml", "gateway-envoy-tls.yaml")
    (cleartext,) = plain[("Gateway", "code2wav")]["spec"]["listeners"]
    gateway = objects[("Gateway", "code2wav")]["spec"]
    assert gateway["gatewayClassName"] == plain[("Gateway", "code2wav")]["spec"]["gatewayClassName"]
    (listener,) = gateway["listeners"]
    assert (listener["protocol"], listener["port"], cleartext["protocol"]) == ("HTTPS", cleartext["port"], "HTTP")
    assert listener["tls"] == {"mode": "Terminate", "certificateRefs": [{"kind": "Secret", "name": "code2wav-gateway-tls"}]}
    service = objects[("Service", "code2wav-triton")]
    grpc_port = next(port for port in service["spec"]["ports"] if port["name"] == "grpc")
    policy = objects[("BackendTLSPolicy", "code2wav-triton-tls")]["spec"]
    assert policy["targetRefs"] == [{"group": "", "kind": "Service", "name": "code2wav-triton",
                                     "sectionName": grpc_port["name"]}]
    assert policy["validation"] == {"hostname": "code2wav-triton",
                                    "caCertificateRefs": [{"group": "", "kind": "ConfigMap", "name": "code2wav-ca"}]}
    text = (KUBERNETES_DIR / "gateway-envoy-tls.yaml").read_text()
    # The names the header's commands create are the ones the objects use; ca.crt is Gateway API's key.
    assert "kubectl create secret tls code2wav-gateway-tls" in text
    assert "kubectl create configmap code2wav-ca --from-file=ca.crt=" in text
    assert "--host code2wav-triton" in text
