"""Every command in the README's shell blocks is run here (small arguments, the session's server) or listed with
the reason it cannot be; a new README command without an entry fails."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS, SAMPLE_RATE_HZ, SAMPLES_PER_FRAME

from helpers import REPO_ROOT

README = REPO_ROOT / "README.md"
PY = str(Path(sys.executable))


def readme_commands() -> list[str]:
    lines = [re.sub(r"\s+#.*$", "", line.strip()) for block in re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)
             for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


NOT_RUN = {
    "make serve": "a foreground server on fixed ports; test_serving.py runs `code2wav-server serve` on free ports",
    "make test": "the command that runs this test",
    "make vllm-omni-venv": "`make test` makes it first (a prerequisite), in CI too",
    "pip install 'mimi-code2wav[vllm-omni] @ <path or git URL of this repository>'":
        "a placeholder URL; `make vllm-omni-venv` installs the same plugin for test_vllm_omni.py",
    "python -m mimi_code2wav.vllm_plugin overlay --url triton-host:8001 --out personaplex-triton.yaml":
        "needs vLLM-Omni's environment; test_vllm_omni.py runs it there and loads what it wrote",
    'make test PYTEST_ARGS="-k parity"': "runs the test suite from inside the test suite",
    "make clean": "removes the working tree's build/ folder (exports) while tests may use it",
    ".venv/bin/python -m benchmarks front": "minutes of load; test_front_benchmark.py runs a short one",
    ".venv/bin/python -m benchmarks gpu": "needs a CUDA GPU; test_export.py checks its exit 3 without one",
    "make bench": "minutes of load; test_perf_inputs.py runs client/perf.sh against a real server",
    "MIMI_WEIGHTS_DIR=/path/to/mimi docker compose --profile scale up --build triton-proxy":
        "its replicas reserve a GPU; test_compose_scale.py runs the same profile with docker-compose.cpu.yml",
    "MIMI_WEIGHTS_DIR=/path/to/mimi docker compose -f docker-compose.yml -f docker-compose.cpu.yml --profile scale "
    "up --build triton-proxy": "test_compose_scale.py runs it as written",
    "kubectl apply -f deploy/kubernetes/code2wav-triton.yaml -f deploy/kubernetes/gateway-envoy.yaml":
        "no cluster here; test_compose.py checks the manifests' structure and routing policy",
    "kubectl apply -f deploy/kubernetes/gateway-envoy-tls.yaml":
        "no cluster here; test_compose.py checks it; test_watchdog.py runs the pods' start line with TLS",
    "make bench-duplex": "minutes of load; test_duplex.py runs `python -m benchmarks duplex` with small arguments",
    "make bench-failover": "minutes of the compose scale profile; test_compose_scale.py runs the same failover",
    "make bench-memory": "a minute of 64 streams; test_serving.py's memory test runs benchmarks.memory at 32 streams",
    **dict.fromkeys(("MIMI_WEIGHTS_DIR=/path/to/mimi docker compose up --build",
                     "MIMI_WEIGHTS_DIR=/path/to/mimi docker compose --profile tensorrt up --build triton-tensorrt"),
                    "needs an NVIDIA GPU; test_compose.py checks the GPU services' structure"),
    "MIMI_WEIGHTS_DIR=/path/to/mimi docker compose --profile cpu up --build triton-cpu":
        "test_compose_cpu.py runs it as written, with the weights, ports and images set by variables",
    "docker compose --profile bench run --rm perf": "test_compose_cpu.py runs it as written against the CPU profile",
    ".venv/bin/code2wav-server serve --host 0.0.0.0 --tls-cert build/access/server.pem --tls-key build/access/server.key "
    "--key-file inference.key --admin-key-file admin.key":
        "a foreground server on fixed ports; test_security.py runs `serve` with the same flags on free ports",
    ".venv/bin/code2wav-client decode --url my-host.example:8001 --tls-ca build/access/ca.pem --key-file inference.key "
    "--random --frames 50": "a placeholder host; test_security.py runs the CLI with these flags against a TLS server",
    "TLS_CA=build/access/ca.pem KEY_FILE=inference.key ADMIN_KEY_FILE=admin.key client/perf.sh --concurrency-range 4":
        "test_security.py runs client/perf.sh with these variables against a TLS server with both keys",
    "CODE2WAV_ACCESS_DIR=/etc/code2wav-access MIMI_WEIGHTS_DIR=/path/to/mimi docker compose --profile cpu up --build "
    "triton-cpu": "test_compose_cpu.py runs the CPU line with CODE2WAV_ACCESS_DIR set to a folder of its certificates and keys",
}

RUN = {
    ".venv/bin/code2wav-client decode --url 127.0.0.1:8001 --random --frames 50 --out out.wav": "decode_random",
    ".venv/bin/code2wav-client decode --codes codes.npy --out speech.wav": "decode_codes",
    ".venv/bin/code2wav-client decode --random --frames 125 --streams 8 --paced": "decode_paced",
    ".venv/bin/code2wav-export encode --weights /path/to/mimi speech.wav --out codes.npy": "encode",
    "make verify MIMI_WEIGHTS=/path/to/tokenizer-e351c8d8-checkpoint125.safetensors": "verify",
    "client/perf.sh --concurrency-range 4": "perf_sh",
    ".venv/bin/code2wav-export render --target python-ort --export-dir build/export/f16-moshi-kvfloat32-k8 "
    "--out build/repo --max-live-streams 256": "render",
    ".venv/bin/code2wav-export build --weights /path/to/mimi": "export_transformers_folder",
    ".venv/bin/code2wav-export build --weights tokenizer-e351c8d8-checkpoint125.safetensors": "export_moshi_file",
    ".venv/bin/code2wav-export build --random-init --seed 0": "export_random",
    ".venv/bin/code2wav-export build --random-init --seed 0 --max-frames-per-step 4 --window exact "
    "--kv-cache-dtype float16 --opset 17 --out build/export/custom": "export_custom",
    "make venv": "make",
    ".venv/bin/code2wav-server certs --out build/access --host my-host.example": "certs",
    "make lint": "make",
    ".venv/bin/python -m benchmarks decoder": "bench_decoder",
    ".venv/bin/python -m mimi_code2wav.export.tensorrt_build --export-dir build/export/f16-moshi-kvfloat32-k8 --fp16 --max-batch 64":
        "tensorrt_build",
}


def test_every_readme_command_is_run_or_has_a_reason():
    commands = readme_commands()
    assert commands, "no shell blocks found in README.md"
    unknown = [c for c in commands if c not in RUN and c not in NOT_RUN]
    assert not unknown, f"README commands with neither a runner nor a reason: {unknown}"
    stale = [c for c in (*RUN, *NOT_RUN) if c not in commands]
    assert not stale, f"entries for commands no longer in the README: {stale}"


def _run(args, cwd, timeout=600, env=None):
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def _python(command: str) -> list[str]:
    """A README `.venv/bin/<program> ...` command, run from this interpreter's venv."""
    program, *args = command.split()
    assert program.startswith(".venv/bin/"), command
    return [str(Path(PY).parent / Path(program).name), *args]


def _assert_wav(path: Path, frames: int) -> None:
    from mimi_code2wav.client.wav import read_wav

    data = read_wav(path)
    assert data.sample_rate_hz == SAMPLE_RATE_HZ and data.to_float32_mono().shape[-1] == frames * SAMPLES_PER_FRAME


@pytest.fixture
def runner(tmp_path, code2wav_server, moshi_checkpoint, onnx_fp32, scenario):
    """Runs one README command with small arguments against the session's server."""
    url = code2wav_server.grpc_url
    checkpoint = moshi_checkpoint[0]

    def decode_random(command):
        out = tmp_path / "out.wav"
        _run(_python(command.replace("127.0.0.1:8001", url).replace("out.wav", str(out))), tmp_path)
        _assert_wav(out, 50)

    def decode_codes(command):
        np.save(tmp_path / "codes.npy", scenario.streams["A"][:, :20])
        _run(_python(command) + ["--url", url], tmp_path)
        _assert_wav(tmp_path / "speech.wav", 20)

    def decode_paced(command):
        result = _run(_python(command.replace("--frames 125", "--frames 10").replace("--streams 8", "--streams 2"))
                      + ["--url", url], tmp_path)
        assert "real-time factor" in result.stdout + result.stderr

    def encode(command):
        from mimi_code2wav.client.wav import write_wav

        rng = np.random.default_rng(0)
        write_wav(tmp_path / "speech.wav", (0.1 * rng.standard_normal(SAMPLE_RATE_HZ)).astype(np.float32), SAMPLE_RATE_HZ)
        _run(_python(command.replace("/path/to/mimi", str(checkpoint))), tmp_path)
        codes = np.load(tmp_path / "codes.npy")
        assert codes.shape == (NUM_CODEBOOKS, 13) and codes.min() >= 0 and codes.max() < CODEBOOK_SIZE

    def verify(command):
        # The session server serves exactly this checkpoint.
        args = command.replace("/path/to/tokenizer-e351c8d8-checkpoint125.safetensors", str(checkpoint)).split()
        result = _run(args + [f"URL={url}"], REPO_ROOT)
        assert "PASS" in result.stdout

    def export_transformers_folder(command):
        from mimi_code2wav.export.weights import new_model, randomize_

        from mimi_fixtures import tiny_config

        model = new_model(tiny_config())
        randomize_(model, 1)
        folder = tmp_path / "mimi"
        model.save_pretrained(str(folder))
        # The tiny config's 20-step window holds at most 9 frames per call (the real one: 124).
        result = _run(_python(command.replace("/path/to/mimi", str(folder))) + ["--max-frames-per-step", "9"], tmp_path)
        assert (tmp_path / result.stdout.strip() / "model.onnx").is_file()

    def export_moshi_file(command):
        shutil.copy(checkpoint, tmp_path / "tokenizer-e351c8d8-checkpoint125.safetensors")
        result = _run(_python(command), tmp_path)
        assert (tmp_path / result.stdout.strip() / "manifest.json").is_file()

    def export_random(command):
        result = _run(_python(command), tmp_path)
        assert "RANDOM weights" in result.stderr and "state per stream: 7.80 MiB" in result.stderr

    def export_custom(command):
        result = _run(_python(command), tmp_path)
        manifest = json.loads((tmp_path / "build/export/custom/manifest.json").read_text())
        assert manifest["options"] == {"num_codebooks": 8, "max_frames_per_step": 4, "window": "exact",
                                       "kv_cache_dtype": "float16", "opset": 17}
        assert "passed onnx.checker" in result.stderr

    def make(command):  # `make venv` and `make lint` on this venv
        result = _run(command.split() + [f"VENV={Path(PY).parent.parent}"], REPO_ROOT)
        assert command != "make lint" or "All checks passed" in result.stdout

    def bench_decoder(command):
        result = _run(_python(command) + ["--seconds", "0.05", "--batches", "1", "--frames-per-call", "1",
                                          "--threads", "1", "--weights", str(checkpoint), "--out", str(tmp_path)],
                      REPO_ROOT, timeout=900)  # benchmarks/ runs from the repository root
        assert "| onnxruntime | 1 | 1 | 1 |" in result.stdout and (tmp_path / "decoder.json").is_file()

    def perf_sh(command):
        # One measurement of a fixed request count: short, and no stability search on busy cores.
        env = {"URL": url, "STREAMS": "4", "FRAMES": "9", "BUILD_DIR": str(tmp_path / "perf"), "PYTHON": PY}
        result = _run(["bash", *command.split(), "--request-count", "12"], REPO_ROOT, env=env, timeout=180)
        assert "mimi_decoder" in result.stdout  # the composing model's statistics are reported

    def certs(command):
        _run(_python(command), tmp_path)
        names = sorted(path.name for path in (tmp_path / "build/access").iterdir())
        assert names == ["ca.key", "ca.pem", "client.key", "client.pem", "server.key", "server.pem"], names
        san = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "build/access/server.pem"), "-noout", "-ext",
                              "subjectAltName"], capture_output=True, text=True, check=True).stdout
        assert "DNS:my-host.example" in san, san

    def render(command):
        result = _run(_python(command.replace("build/export/f16-moshi-kvfloat32-k8", str(onnx_fp32))), tmp_path)
        config = (tmp_path / "build/repo/code2wav/config.pbtxt").read_text()
        assert re.search(r'key: "max_live_streams"\s*value: \{ string_value: "256" \}', config), result.stderr

    def tensorrt_build(command):
        args = _python(command.replace("build/export/f16-moshi-kvfloat32-k8", str(onnx_fp32)))
        result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PATH": "/usr/bin:/bin"})
        assert result.returncode == 3 and "TensorRT is not available here" in result.stderr

    return locals()


@pytest.mark.parametrize("command", list(RUN))
def test_readme_command_runs(command, runner):
    runner[RUN[command]](command)


PYTHON_EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(PYTHON_EXAMPLES)))
def test_readme_python_example_runs(index, code2wav_server, tmp_path):
    """Each README Python example runs as written (against the session's server) in a fresh interpreter."""
    example = PYTHON_EXAMPLES[index].replace("127.0.0.1:8001", code2wav_server.grpc_url)
    _run([PY, "-c", example], tmp_path, timeout=120)


def test_the_readme_parameter_table_is_the_shipped_config():
    """The README's code2wav parameter table holds exactly the shipped config.pbtxt's parameters and values."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse((REPO_ROOT / "model_repository/code2wav/config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    shipped = {key: value.string_value for key, value in config.parameters.items()}
    shipped["max_sequence_idle_microseconds"] = str(config.sequence_batching.max_sequence_idle_microseconds)
    table = README.read_text().split("`code2wav` parameters", 1)[1].split("\n\n", 2)[1]
    documented = {}
    for row in table.splitlines()[2:]:
        names, defaults = [cell.strip() for cell in row.strip("|").split("|")][:2]
        names, defaults = [n.strip("` ") for n in names.split("/")], [d.strip("` ") for d in defaults.split("/")]
        assert len(names) == len(defaults), row
        documented.update(zip(names, defaults))
    assert documented == shipped


def test_the_design_doc_lists_every_custom_metric():
    """The metrics the Python models create are the ones docs/design.md §5 lists."""
    created = set()
    for model in ("code2wav/1/model.py", "mimi_decoder/python_ort/model.py"):
        created |= set(re.findall(r'"((?:code2wav|mimi_decoder)_[a-z_]+)"', (REPO_ROOT / "model_repository" / model).read_text()))
    design = (REPO_ROOT / "docs/design.md").read_text()
    listed = set(re.findall(r"`((?:code2wav|mimi_decoder)_[a-z_]+)(?:\{kind\})?`", design.split("## 5.", 1)[1].split("### 5.1", 1)[0]))
    assert created and created == listed
