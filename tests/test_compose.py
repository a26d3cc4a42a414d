"""What the real compose runs (test_compose_cpu.py, test_compose_scale.py) cannot reach, checked structurally: the
GPU services, NGC images, Kubernetes manifests and nginx config; the export image and its entrypoint's jobs."""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from benchmarks.docker_env import REPLICAS
from mimi_code2wav.client.protocol import NUM_CODEBOOKS, SAMPLES_PER_FRAME, STREAM_KEY_HEADER

from helpers import REPO_ROOT, export_spec

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "docker" / "export.Dockerfile"
ENTRYPOINT = REPO_ROOT / "docker" / "export-entrypoint.sh"
NGINX_DIR = REPO_ROOT / "docker" / "nginx"
WATCHDOG = REPO_ROOT / "server" / "triton-watchdog.sh"
KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
WATCHDOG_IN_CONTAINER = "/opt/code2wav/triton-watchdog.sh"
ACCESS_IN_CONTAINER = "/run/code2wav-access"

# NGC release -> the tritonserver (and SDK) version it carries; the default image, and the one the tests run.
NGC_TRITON_VERSIONS = {"24.10": "2.51.0", "26.11": "2.75.0"}
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:26.11-py3"
TESTED_TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
PROXY = "triton-proxy"
# service: (profiles, reserves a GPU, the service whose successful completion it waits for)
SERVICES = {
    "export": (None, False, None),
    "triton": (None, True, "export"),
    "triton-cpu": (["cpu"], False, "export"),
    "tensorrt-plan": (["tensorrt"], True, "export"),
    "tensorrt-render": (["tensorrt"], False, "tensorrt-plan"),
    "triton-tensorrt": (["tensorrt"], True, "tensorrt-render"),
    "perf": (["bench"], False, None),
    **{replica: (["scale"], True, "export") for replica in REPLICAS},
    PROXY: (["scale"], False, None),
}
# server: (the one-shot service that writes its repository, that service's variable naming the folder)
REPOSITORIES = {"triton": ("export", "MODELS_DIR"), "triton-cpu": ("export", "MODELS_CPU_DIR"),
                "triton-tensorrt": ("tensorrt-render", "MODELS_DIR"), **{r: ("export", "MODELS_DIR") for r in REPLICAS}}
INSTALL_AT_START = re.compile(r"\b(pip3?|uv|conda|apt-get|apt|apk|git|wget)\b|curl\s|pip install|git clone")
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?)[-?]([^}]*))?\}")


def load_compose(**env: str) -> dict:
    """The compose file as `docker compose` sees it in a shell that sets `env` and no other variable (`${X}`,
    `${X:-d}`, `${X-d}`, `$$`; a list `environment` as the mapping it means: a bare name passes a set value on)."""
    def substitute(match: re.Match) -> str:
        name, colon, default = match.groups(default="")
        return "$" if not name else (env.get(name) or default) if colon else env.get(name, default)

    compose = yaml.safe_load(_VARIABLE.sub(substitute, COMPOSE_FILE.read_text()))
    for service in compose["services"].values():
        if isinstance(service.get("environment"), list):
            pairs = [item.partition("=") for item in service["environment"]]
            service["environment"] = {name: value if sep else env[name] for name, sep, value in pairs if sep or name in env}
    return compose


@pytest.fixture(scope="module")
def services() -> dict:
    return load_compose()["services"]


def volume_mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """Container path -> (source, read_only) of a service's (short-syntax) volumes."""
    volumes = [volume.split(":") for volume in service.get("volumes", [])]
    return {target: (source, "ro" in ",".join(mode).split(",")) for source, target, *mode in volumes}


def flag_value(args: list[str], flag: str) -> str | None:
    return next((arg.split("=", 1)[1] for arg in args if arg.startswith(flag + "=")), None)


def dependency_closure(services: dict, name: str) -> set[str]:
    """`name` and every service `docker compose up name` starts with it."""
    return {name}.union(*(dependency_closure(services, dep) for dep in services[name].get("depends_on", {})))


# ---- the compose file ------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "profiles", "gpu", "waits_for"), [(name, *row) for name, row in SERVICES.items()])
def test_every_service(services, name, profiles, gpu, waits_for):
    """Its profile, a pinned image, a GPU only where needed, waits for its writer, installs nothing, loopback ports."""
    service = services[name]
    assert service.get("profiles") == profiles
    repository, _, tag = service["image"].rpartition(":")
    assert repository and "/" not in tag and tag != "latest", f"{name}: image {service['image']!r} floats"
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    assert devices == ([{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}] if gpu else []), name
    if waits_for:
        assert service["depends_on"] == {waits_for: {"condition": "service_completed_successfully"}}, name
    for key in ("command", "entrypoint"):
        value = service.get(key)
        text = value if isinstance(value, str) else " ".join(value or [])
        assert not INSTALL_AT_START.search(text), f"{name}: {key} installs or downloads at start: {text}"
    for port in service.get("ports", []):
        assert str(port).count(":") == 2 and str(port).startswith("127.0.0.1:"), f"{name}: {port!r} beyond loopback"


@pytest.mark.parametrize("triton_image", [TRITON_IMAGE, TESTED_TRITON_IMAGE], ids=["default", "tested"])
def test_images_and_the_tested_ngc_release_one_variable_away(triton_image):
    """Newest by default; TRITON_IMAGE / TRITON_SDK_IMAGE select the release the client pins and the tests run."""
    tested = {"TRITON_IMAGE": triton_image, "TRITON_SDK_IMAGE": triton_image + "-sdk"}
    services = load_compose(**({} if triton_image == TRITON_IMAGE else tested))["services"]
    for name in (*REPOSITORIES, "tensorrt-plan"):
        assert services[name]["image"] == triton_image, name
    assert services["perf"]["image"] == triton_image + "-sdk"
    (client_pin,) = [req for req in PYPROJECT["project"]["optional-dependencies"]["client"] if req.startswith("tritonclient")]
    assert NGC_TRITON_VERSIONS[TESTED_TRITON_IMAGE.rsplit(":", 1)[1].split("-")[0]] == client_pin.split("==")[1]
    header = COMPOSE_FILE.read_text().split("\n\n")[0]
    assert all(version in header for version in ("26.11", "2.75.0", "24.10", "2.51.0"))


@pytest.mark.parametrize(("name", "writer", "variable"), [(name, *row) for name, row in REPOSITORIES.items()])
def test_every_server(services, name, writer, variable, tmp_path):
    """Under the watchdog, tini as PID 1, restarted; drains before Docker kills it; serves, read-only, the named
    volume its writer renders into (at the writer's $variable); on a GPU, with the export's memory pools."""
    server, args = services[name], services[name]["command"]
    assert args[:3] == ["sh", WATCHDOG_IN_CONTAINER, "tritonserver"], args
    mounts = volume_mounts(server)
    assert mounts[WATCHDOG_IN_CONTAINER] == ("./server/triton-watchdog.sh", True)
    assert server.get("init") is True and server.get("restart") == "unless-stopped", name
    exit_timeout_s = int(flag_value(args, "--exit-timeout-secs") or 30)
    assert int(server["stop_grace_period"].removesuffix("s")) > exit_timeout_s, f"{name}: Docker kills tritonserver before it drains"
    # The Python backend fails to grow its pool in Docker's default 64 MB /dev/shm.
    assert re.fullmatch(r"\d+(gb|g)", str(server.get("shm_size", "")).lower()), f"{name}: shm_size too small or unset"
    test = server["healthcheck"]["test"]
    assert test[:2] == ["CMD", "curl"] and "-fsS" in test and test[-1] == "http://localhost:8000/v2/health/ready"
    assert server["healthcheck"].get("start_period"), "a server loading models needs a start period"
    for flag in ("--http-port", "--grpc-port", "--metrics-port"):
        assert flag_value(args, flag) is None, f"{name}: {flag} moved away from the published port"
    published = {int(str(port).rsplit(":", 1)[1]) for port in server.get("ports", [])}
    assert published == (set() if name in REPLICAS else {8000, 8001, 8002}), f"{name}: replicas are reached through {PROXY}"
    assert name not in REPLICAS or "networks" not in server, f"{name}: clients must go through {PROXY}"
    written_to = services[writer]["environment"][variable]
    volume, read_only = volume_mounts(services[writer])[written_to]
    assert not read_only, f"{writer} cannot write {written_to}"
    assert flag_value(args, "--model-repository") == "/models" and mounts["/models"] == (volume, True)
    assert volume in load_compose()["volumes"], f"{volume} is a bind mount: the export would write into the host tree"
    if not SERVICES[name][1]:
        return
    # After the NGC image's entrypoint, a shell appends the flags of /models/tritonserver.args to the command:
    # run that line and the watchdog here, with echo standing in for the server.
    entrypoint = server["entrypoint"]
    assert entrypoint[:3] == ["/opt/nvidia/nvidia_entrypoint.sh", "sh", "-c"], entrypoint
    args_file = tmp_path / "tritonserver.args"
    pools = ["--cuda-memory-pool-byte-size=0:1048576", "--pinned-memory-pool-byte-size=268435456"]
    args_file.write_text("\n".join(pools) + "\n")
    script = ["sh", "-c", entrypoint[3].replace("/models/tritonserver.args", str(args_file)), *entrypoint[4:]]
    result = subprocess.run([*script, "sh", str(WATCHDOG), "echo", "--model-repository=/models"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.split() == ["--model-repository=/models", *pools], result.stderr
    # Without the file the server does not start on default pools.
    args_file.unlink()
    result = subprocess.run([*script, "echo", "x"], capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and "tritonserver.args" in result.stderr


def test_services_start_what_they_need_and_share_the_export(services):
    """`--profile cpu up triton-cpu` needs no GPU; `--profile scale up triton-proxy` must not start `triton`,
    which publishes the same host ports; each replica runs what `triton` runs; the jobs share the export;
    the weights are mounted read-only into the export alone; perf runs client/perf.sh against `triton`."""
    assert "name" not in load_compose(), "a top-level `name:` is rejected by docker-compose 1.29 (Debian's)"
    assert sorted(services) == sorted(SERVICES)
    assert dependency_closure(services, "triton-cpu") == {"triton-cpu", "export"}
    assert dependency_closure(services, PROXY) == {PROXY, "export", *REPLICAS}
    assert services[PROXY]["depends_on"] == {replica: {"condition": "service_healthy"} for replica in REPLICAS}
    for replica in REPLICAS:
        for key in ("image", "entrypoint", "command", "volumes", "healthcheck", "shm_size", "ulimits",
                    "stop_grace_period", "restart", "deploy"):
            assert services[replica][key] == services["triton"][key], f"{replica}: {key} differs from triton's"
    # trtexec's command lines carry absolute paths: every job sees the export where it was written.
    export, plan = services["export"], services["tensorrt-plan"]
    export_dir = export["environment"]["EXPORT_DIR"]
    for name in ("tensorrt-plan", "tensorrt-render"):
        assert services[name]["environment"] == export["environment"], name
        assert volume_mounts(services[name])[export_dir][0] == volume_mounts(export)[export_dir][0], name
    assert volume_mounts(plan)[export_dir][1] is False, "tensorrt-plan writes the plan"
    # tensorrt-plan runs the entrypoint from the checkout mounted into the NGC image.
    workspace, script = plan["working_dir"], Path(plan["command"][1])
    assert volume_mounts(plan)[workspace] == (".", True)
    assert plan["command"][::2] == ["sh", "tensorrt-plan"] and script.is_relative_to(workspace)
    assert (REPO_ROOT / script.relative_to(workspace)).is_file()
    weights_root = export["environment"]["WEIGHTS_ROOT"]
    assert volume_mounts(export)[weights_root] == ("./weights", True)
    assert "${MIMI_WEIGHTS_DIR:-./weights}:" in COMPOSE_FILE.read_text()
    assert [name for name, service in services.items() if weights_root in volume_mounts(service)] == ["export"]
    code = "\n".join(line for line in ENTRYPOINT.read_text().splitlines() if not line.lstrip().startswith("#"))
    assert not INSTALL_AT_START.search(code)

    perf = services["perf"]
    assert perf["command"][:2] == ["bash", "client/perf.sh"] and (REPO_ROOT / perf["command"][1]).is_file()
    assert volume_mounts(perf)[perf["working_dir"]] == (".", True)
    # perf.sh writes its inputs and CSV under BUILD_DIR: it must be a writable mount.
    assert volume_mounts(perf)[perf["environment"]["BUILD_DIR"]][1] is False
    host, port = perf["environment"]["URL"].split(":")
    aliases = [services[name].get("networks", {}).get("default", {}).get("aliases", []) for name in REPOSITORIES]
    assert port == "8001" and host == "triton" and {alias for names in aliases for alias in names} <= {"triton"}


# ---- the `scale` profile: replicas behind nginx ------------------------------------------------------

PROXY_LINES = {  # file in docker/nginx -> lines it must hold: a fixed key for keyless streams, Docker's DNS
    "compose.conf": [r'map \$http_code2wav_stream \$code2wav_stream_key \{\n\s+""\s+"[^"]+";\n\s+default \$http_code2wav_stream;',
                     r"resolver 127\.0\.0\.11 ", r"^        include /etc/nginx/code2wav-access.conf;\n        http2 on;$",
                     r"^        listen 8000;$", r"^            grpc_pass \$code2wav_replicas;$",
                     r"^            grpc_next_upstream error timeout;$"],
    "access-plaintext.conf": [r"^listen 8001;$", r"^set \$code2wav_replicas grpc://code2wav_grpc;$"],
    "access-tls.conf": [r"^listen 8001 ssl;$", r"^set \$code2wav_replicas grpcs://code2wav_grpc;$", r"^grpc_ssl_verify on;$",
                        r"^ssl_certificate /run/code2wav-access/server.pem;$"],
}


def test_proxy_hashes_streams_over_each_replica_by_name(services):
    """One `server` per replica service, by its own name: nginx places a server on the hash ring by that name
    (the addresses of one `--scale` name would share a place). Clients keep the single server's host ports."""
    proxy, config = services[PROXY], (NGINX_DIR / "compose.conf").read_text()
    repository, _, tag = proxy["image"].rpartition(":")
    # nginx 1.27.3 is the first open-source release with `server ... resolve` in an upstream.
    assert repository == "nginx" and tuple(map(int, tag.split("-")[0].split("."))) >= (1, 27, 3), proxy["image"]
    assert proxy["ports"] == ["127.0.0.1:8000:8000", "127.0.0.1:8001:8001"]
    ports = load_compose(TRITON_HTTP_PORT="18000", TRITON_GRPC_PORT="18001")["services"][PROXY]["ports"]
    assert ports == ["127.0.0.1:18000:8000", "127.0.0.1:18001:8001"]
    assert volume_mounts(proxy) == {"/etc/nginx/nginx.conf": ("./docker/nginx/compose.conf", True),
                                    "/etc/nginx/code2wav-access.conf": ("./docker/nginx/access-plaintext.conf", True),
                                    ACCESS_IN_CONTAINER: ("./docker/access", True)}
    # The official image has busybox's wget and no curl.
    test = proxy["healthcheck"]["test"]
    assert test[:2] == ["CMD", "wget"] and test[-1] == "http://localhost:8000/v2/health/ready", test
    # The image stops nginx with SIGQUIT (graceful), which compose.conf bounds with worker_shutdown_timeout.
    shutdown_s = int(re.search(r"^worker_shutdown_timeout (\d+)s;$", config, re.M).group(1))
    assert int(proxy["stop_grace_period"].removesuffix("s")) > shutdown_s
    # perf (and anything else on the compose network) reaches the proxy as `triton`.
    assert proxy["networks"]["default"]["aliases"] == ["triton"] and "deploy" not in proxy, "the proxy needs no GPU"
    for upstream, port in (("code2wav_grpc", 8001), ("code2wav_http", 8000)):
        body = re.search(rf"^    upstream {upstream} \{{\n(.*?)^    \}}", config, re.M | re.S).group(1)
        assert re.search(r"^        hash \$code2wav_stream_key consistent;$", body, re.M), f"{upstream}: no consistent hash on the stream key"
        assert re.search(r"^        zone \w+ \d+k;$", body, re.M), f"{upstream}: `resolve` needs a shared-memory zone"
        servers = re.findall(r"^        server (\S+) resolve max_fails=\d+ fail_timeout=\d+s;$", body, re.M)
        assert servers == [f"{replica}:{port}" for replica in REPLICAS], upstream
    for file, patterns in PROXY_LINES.items():
        for pattern in patterns:
            assert re.search(pattern, (NGINX_DIR / file).read_text(), re.M), f"{file}: no {pattern!r}"
    assert "daemon off;" not in config, "the image's command sets it; a second one fails nginx's start"


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
    """`docker compose config -q`, every profile, of the files as the README combines them (benchmarks/docker_env.py)."""
    args = [arg for name in files for arg in ("-f", name)]
    env = {key: value for key, value in docker_env.items() if not key.startswith("COMPOSE_")}
    result = subprocess.run(["docker", "compose", *args, "--profile", "*", "config", "-q"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# ---- the export image -------------------------------------------------------------------------------

def dockerignore_allows(path: str) -> bool:
    """Whether docker/export.Dockerfile.dockerignore keeps `path` in the build context (last match wins,
    a pattern matching a parent folder covers what is inside)."""
    parts, allowed = path.split("/"), True
    for line in map(str.strip, DOCKERFILE.with_name("export.Dockerfile.dockerignore").read_text().splitlines()):
        pattern = re.escape(line.removeprefix("!").rstrip("/"))
        regex = pattern.replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        if line and not line.startswith("#") and any(re.fullmatch(regex, "/".join(parts[: i + 1])) for i in range(len(parts))):
            allowed = line.startswith("!")
    return allowed


def test_export_image_pins_its_base_installs_pyprojects_cpu_torch_and_keeps_model_files_out():
    """What the image copies is checked by building it (tests/test_compose_cpu.py); model files, exports
    and environments must never enter the build context of either builder."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    code = re.sub(r"\\[ \t]*\n", " ", "\n".join(lines))  # continuation lines joined
    args = dict(re.findall(r"^ARG (\w+)=(.*)$", code, re.M))
    (base,) = re.findall(r"^FROM (.*)$", code, re.M)
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base.split()[0])
    repository, _, tag = image.rpartition(":")
    assert repository == "python" and tag.startswith("3.11.") and "@" not in repository, f"base image {image!r}: pin a patch release"
    (torch_pin,) = [req for req in PYPROJECT["project"]["optional-dependencies"]["export"] if req.startswith("torch==")]
    assert args["TORCH_VERSION"] == torch_pin.split("==")[1]
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(re.findall(r"^RUN (.*)$", code, re.M))
    # The CPU torch wheel, then everything else from pyproject's extra under the project's constraints.
    for command in ('torch_source="--index-url ${TORCH_INDEX_URL}"', "['optional-dependencies']['export']",
                    'pip install --no-deps ${torch_source} "torch==${TORCH_VERSION}+cpu"',
                    "pip install -c requirements/constraints.txt -r /tmp/requirements-export.txt"):
        assert command in runs, command
    for kept_out in ("weights/model.safetensors", "build/export/f1/model.onnx", ".venv/bin/python",
                     "model_repository/mimi_decoder/1/model.onnx", "export/__pycache__/spec.cpython-311.pyc"):
        assert not dockerignore_allows(kept_out), kept_out


# ---- the entrypoint's jobs, run here -----------------------------------------------------------------

def run_entrypoint(job: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    base = {key: value for key, value in os.environ.items()
            if not key.startswith(("MIMI_", "EXPORT_", "RENDER_", "TENSORRT_", "MODELS_"))}
    base.update(PYTHON=sys.executable, WEIGHTS_ROOT=str(tmp_path / "weights"), EXPORT_DIR=str(tmp_path / "export"),
                MODELS_DIR=str(tmp_path / "models"), MODELS_CPU_DIR=str(tmp_path / "models-cpu"),
                TRTEXEC=str(tmp_path / "trtexec"))
    return subprocess.run(["sh", str(ENTRYPOINT), job], cwd=tmp_path, env={**base, **env}, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize(("job", "messages"), [
    ("export", ("no Mimi weights at {weights}", "MIMI_WEIGHTS_DIR", "MIMI_RANDOM_INIT=1")),  # the folder is empty
    ("serve", ("unknown job 'serve'",)),
    ("tensorrt-plan", ("the export service writes it",)),
    ("tensorrt-render", ("the tensorrt-plan service builds it",)),
])
def test_entrypoint_refuses_unknown_jobs_and_missing_inputs(tmp_path, job, messages):
    """Exit 2, saying what is missing and how to provide it, and nothing written."""
    (tmp_path / "weights").mkdir()
    result = run_entrypoint(job, tmp_path)
    expected = [message.format(weights=tmp_path / "weights") for message in messages]
    assert result.returncode == 2 and all(message in result.stderr for message in expected), result.stderr
    assert not (tmp_path / "export").exists() and not (tmp_path / "models").exists()


@pytest.mark.slow
def test_entrypoint_jobs_write_the_served_repositories(tmp_path, moshi_checkpoint, onnx_fp32, repository_for):
    """export -> tensorrt-plan -> tensorrt-render on a moshi-format checkpoint. The export folder holds the session's
    export of it, so the job finds it up to date (as a second `docker compose up` does) instead of exporting again."""
    checkpoint = moshi_checkpoint[0]
    weights, export_dir = tmp_path / "weights", tmp_path / "export"
    weights.mkdir()
    (weights / checkpoint.name).symlink_to(checkpoint)
    export_dir.mkdir()
    for name in ("manifest.json", "model.onnx"):
        shutil.copy2(onnx_fp32 / name, export_dir / name)
    calls, trtexec = tmp_path / "trtexec-calls.txt", tmp_path / "trtexec"
    # Stands in for trtexec: records its command line and writes the engine file it was asked for.
    trtexec.write_text(f"""#!/bin/sh
printf '%s\\n' "$*" >> "{calls}"
for arg in "$@"; do case $arg in --saveEngine=*) printf 'engine' > "${{arg#--saveEngine=}}" ;; esac; done
""")
    trtexec.chmod(0o755)

    result = run_entrypoint("export", tmp_path, MIMI_WEIGHTS=checkpoint.name)
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stderr and "nothing to do" in result.stderr, result.stderr

    # GPU repository: the checked-in config, model.onnx where that config expects it, code2wav as tracked.
    models, models_cpu = tmp_path / "models", tmp_path / "models-cpu"
    gpu_config = (REPO_ROOT / "model_repository" / "mimi_decoder" / "config.pbtxt").read_text()
    assert 'backend: "onnxruntime"' in gpu_config and "default_model_filename" not in gpu_config
    assert (models / "mimi_decoder" / "config.pbtxt").read_text() == gpu_config and "equals the checked-in" in result.stderr
    cpu_config = (models_cpu / "mimi_decoder" / "config.pbtxt").read_text()
    assert "kind: KIND_CPU" in cpu_config and cpu_config == gpu_config.replace("KIND_GPU", "KIND_CPU")
    # The CPU profile serves exactly the repository the contract suite runs on the native target.
    for config in ("mimi_decoder/config.pbtxt", "code2wav/config.pbtxt"):
        assert (models_cpu / config).read_text() == (repository_for("onnxruntime") / config).read_text(), config
    for repository in (models, models_cpu):
        onnx = repository / "mimi_decoder" / "1" / "model.onnx"
        assert os.path.samefile(onnx, export_dir / "model.onnx") or filecmp.cmp(onnx, export_dir / "model.onnx", shallow=False)
        for file in ("config.pbtxt", "1/model.py"):
            assert (repository / "code2wav" / file).read_bytes() == (REPO_ROOT / "model_repository/code2wav" / file).read_bytes()
    # The GPU repository carries the memory pools of its 1024 streams (the math: tests/test_configs.py); the CPU one none.
    assert sorted(p.name for p in models.iterdir()) == ["code2wav", "mimi_decoder", "tritonserver.args"]
    assert sorted(p.name for p in models_cpu.iterdir()) == ["code2wav", "mimi_decoder"]
    state, mib, pools = 8177156, 2**20, (models / "tritonserver.args").read_text().splitlines()
    io = 4 * 16 * (NUM_CODEBOOKS + SAMPLES_PER_FRAME)  # a row's int32 codes and fp32 PCM, 16 frames a step
    assert export_spec(export_dir).state_bytes_per_stream() == state  # fp32 KV 8x2x8x248x64 + 12672 conv floats + 1
    assert pools == [f"--cuda-memory-pool-byte-size=0:{-(-(2 * 1024 + 64) * state // mib) * mib}",
                     f"--pinned-memory-pool-byte-size={max(256 * mib, -(-64 * (state + io) // mib) * mib)}"]

    # trtexec command lines, one argument per line, with the paths the NGC job will see.
    for precision in ("fp32", "fp16"):
        args = (export_dir / "tensorrt" / f"trtexec-{precision}.args").read_text().splitlines()
        assert args[0] == str(trtexec) and f"--onnx={export_dir / 'model.onnx'}" in args
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
    assert (trt_models / "tritonserver.args").read_text().splitlines() == pools
    assert (trt_models / "code2wav" / "1" / "model.py").is_file()


# ---- Kubernetes (structure only: no cluster here) ----------------------------------------------------

def kubernetes_objects(*files: str) -> dict[tuple[str, str], dict]:
    """(kind, name) -> object, as `kubectl apply -f` of `files` in that order leaves them."""
    documents = [document for name in files for document in yaml.safe_load_all((KUBERNETES_DIR / name).read_text())]
    return {(document["kind"], document["metadata"]["name"]): document for document in documents if document}


def test_kubernetes_manifests_hash_streams_over_the_ready_pods(services):
    objects = kubernetes_objects("code2wav-triton.yaml", "gateway-envoy.yaml")
    deployment = objects[("Deployment", "code2wav-triton")]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (triton,), (export,) = pod["spec"]["containers"], pod["spec"]["initContainers"]
    assert triton["image"] == TRITON_IMAGE  # compose's default
    assert export["args"] == ["export"] and export["image"].endswith("/mimi-code2wav-export:0.1.0")
    # The init container renders the repository into the volume Triton serves read-only.
    mounts = {mount["mountPath"]: mount for mount in triton["volumeMounts"]}
    assert mounts["/models"]["readOnly"] and {"name": mounts["/models"]["name"], "mountPath": "/models"} in export["volumeMounts"]
    # It starts as compose's `triton` does, the watchdog from a ConfigMap, TLS and keys from an optional Secret.
    assert [arg.replace("$$", "$") for arg in triton["command"]] == services["triton"]["entrypoint"]
    assert triton["args"] == [arg for arg in services["triton"]["command"] if not arg.startswith("--log-verbose=")]
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    assert volumes[mounts[str(Path(WATCHDOG_IN_CONTAINER).parent)]["name"]]["configMap"] == {"name": "code2wav-watchdog"}
    assert f"--from-file=server/{WATCHDOG.name}" in (KUBERNETES_DIR / "code2wav-triton.yaml").read_text()
    assert ACCESS_IN_CONTAINER in volume_mounts(services["triton"])
    access = mounts[ACCESS_IN_CONTAINER]
    assert access["readOnly"] and volumes[access["name"]]["secret"] == {"secretName": "code2wav-access", "optional": True}
    ports = {port["name"]: port["containerPort"] for port in triton["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert triton["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    # Live: it answers (a dead Python stub is the watchdog's to find, tests/test_watchdog.py).
    assert triton["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(flag_value(triton["args"], "--exit-timeout-secs"))

    service = objects[("Service", "code2wav-triton")]["spec"]
    assert service["selector"].items() <= pod["metadata"]["labels"].items()
    (grpc_port,) = [port for port in service["ports"] if port["name"] == "grpc"]
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

    # gateway-envoy-tls.yaml after gateway-envoy.yaml: TLS on the same port, and to the pods, checking their name.
    tls = kubernetes_objects("code2wav-triton.yaml", "gateway-envoy.yaml", "gateway-envoy-tls.yaml")
    plain, gateway = objects[("Gateway", "code2wav")]["spec"], tls[("Gateway", "code2wav")]["spec"]
    assert gateway["gatewayClassName"] == plain["gatewayClassName"]
    (cleartext,), (listener,) = plain["listeners"], gateway["listeners"]
    assert (listener["protocol"], listener["port"], cleartext["protocol"]) == ("HTTPS", cleartext["port"], "HTTP")
    assert listener["tls"] == {"mode": "Terminate", "certificateRefs": [{"kind": "Secret", "name": "code2wav-gateway-tls"}]}
    policy = tls[("BackendTLSPolicy", "code2wav-triton-tls")]["spec"]
    assert policy["targetRefs"] == [{"group": "", "kind": "Service", "name": "code2wav-triton", "sectionName": "grpc"}]
    assert policy["validation"] == {"hostname": "code2wav-triton",
                                    "caCertificateRefs": [{"group": "", "kind": "ConfigMap", "name": "code2wav-ca"}]}
    # The names the header's commands create are the ones the objects use; ca.crt is Gateway API's key.
    for command in ("kubectl create secret tls code2wav-gateway-tls", "kubectl create configmap code2wav-ca --from-file=ca.crt=",
                    "--host code2wav-triton"):
        assert command in (KUBERNETES_DIR / "gateway-envoy-tls.yaml").read_text(), command
