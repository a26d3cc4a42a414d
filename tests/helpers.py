"""Helpers the test modules share (fixtures: conftest.py, mimi_fixtures.py); tritonclient is imported lazily,
so that the unit tests need only numpy."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.protocol import MODEL_NAME, NUM_CODEBOOKS, SAMPLE_RATE_HZ, SAMPLES_PER_FRAME

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"


# ---- code2wav's request contract (docs/design.md §2) ----------------------------------------------

def sequence_ids(first: int) -> Callable[[], int]:
    """A test module's own sequence ids from `first`, far from those of the other modules on a shared server."""
    return itertools.count(first).__next__


def raw_input(name: str, array: np.ndarray, datatype: str):
    """A gRPC InferInput holding `array` as it is (for requests the contract rejects, too)."""
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def code2wav_inputs(codes: np.ndarray, frame_offset: int | None = None, history_frames: int | None = None) -> list:
    """codes [k, F] -> `input_ids` INT64 [1, k*F] (codebook-major), plus the optional INT64 [1, 1] inputs."""
    codes = np.asarray(codes)
    assert codes.ndim == 2 and codes.shape[0] == NUM_CODEBOOKS, codes.shape
    inputs = [raw_input("input_ids", np.ascontiguousarray(codes, dtype=np.int64).reshape(1, -1), "INT64")]
    for name, value in (("frame_offset", frame_offset), ("history_frames", history_frames)):
        if value is not None:
            inputs.append(raw_input(name, np.array([[value]], np.int64), "INT64"))
    return inputs


def pcm_of(result, new_frames: int | None = None) -> np.ndarray:
    """The response's `model_outputs` as 1-D float32, `sr` and the shape (`new_frames` frames) checked."""
    sr = result.as_numpy("sr")
    assert sr is not None and sr.dtype == np.int32 and sr.shape == (1, 1) and sr[0, 0] == SAMPLE_RATE_HZ, sr
    pcm = result.as_numpy("model_outputs")
    assert pcm.dtype == np.float32 and pcm.ndim == 2 and pcm.shape[0] == 1, (pcm.dtype, pcm.shape)
    assert pcm.shape[1] % SAMPLES_PER_FRAME == 0, pcm.shape
    assert new_frames is None or pcm.shape[1] == new_frames * SAMPLES_PER_FRAME, \
        f"{pcm.shape[1]} samples, expected {new_frames} frame(s) = {new_frames * SAMPLES_PER_FRAME}"
    return pcm[0]


def infer(client, sequence_id: int, codes, frame_offset=None, start=False, end=False, new_frames: int | None = None,
          *, history_frames: int | None = None, headers: dict[str, str] | None = None) -> np.ndarray:
    """One unary request to code2wav; returns the PCM of the frames it decoded (checked to be `new_frames`)."""
    result = client.infer(MODEL_NAME, code2wav_inputs(codes, frame_offset, history_frames), sequence_id=sequence_id,
                          sequence_start=start, sequence_end=end, headers=headers)
    return pcm_of(result, new_frames)


def send_in_chunks(client, sequence_id: int, codes, first: int, stop: int, chunk_frames: int = 16, start=False,
                   end=True, headers: dict[str, str] | None = None) -> list[np.ndarray]:
    """Frames [first, stop) as `chunk_frames` deltas with offsets (START first, END last if asked); each PCM."""
    pcm = []
    for chunk_first in range(first, stop, chunk_frames):
        last = min(chunk_first + chunk_frames, stop)
        pcm.append(infer(client, sequence_id, codes[:, chunk_first:last], chunk_first,
                         start=start and chunk_first == first, end=end and last == stop,
                         new_frames=last - chunk_first, headers=headers))
    return pcm


def decoder_step_inputs() -> list:
    """One step of zero codes for mimi_decoder itself: `codes` INT32 [1, 8, 1]."""
    return [raw_input("codes", np.zeros((1, NUM_CODEBOOKS, 1), np.int32), "INT32")]


def decoder_holds(grpc_url: str, sequence_id: int, decoder: str = "mimi_decoder") -> bool:
    """Whether the decoder still holds `sequence_id` (Triton refuses a step without START otherwise); the probe
    step carries END, so a held sequence is ended by it."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    with grpcclient.InferenceServerClient(grpc_url) as client:
        try:
            client.infer(decoder, decoder_step_inputs(), sequence_id=sequence_id, sequence_end=True)
        except InferenceServerException as error:
            if "must specify the START flag" in error.message():
                return False
            raise
    return True


_UNCHECKED = object()


def infer_error(client, sequence_id: int, inputs, *expected: str, start=False, end=False, kind=_UNCHECKED) -> str:
    """Send `inputs` (codes [k, F] or InferInputs) expecting an error holding every `expected` substring and, where
    given, code2wav's error `kind` (None: Triton's own error); returns the message."""
    from tritonclient.utils import InferenceServerException

    from mimi_code2wav.client.protocol import error_kind

    if isinstance(inputs, np.ndarray):
        inputs = code2wav_inputs(inputs)
    with pytest.raises(InferenceServerException) as info:
        client.infer(MODEL_NAME, inputs, sequence_id=sequence_id, sequence_start=start, sequence_end=end)
    message = info.value.message()
    for text in expected:
        assert text in message, f"{text!r} not in the error {message!r}"
    if kind is not _UNCHECKED:
        assert error_kind(message) == kind, message
    return message


def frames_of(pcm: np.ndarray, first: int, stop: int | None = None) -> np.ndarray:
    """The samples of frames [first, stop) (to the end without `stop`) of 1-D PCM."""
    return pcm[first * SAMPLES_PER_FRAME : None if stop is None else stop * SAMPLES_PER_FRAME]


def snr_after(pcm: np.ndarray, reference: np.ndarray, frame: int, seconds: int | None = 1) -> list[float]:
    """SNR (dB) to `reference` in each of the first `seconds` 13-frame seconds (None: all) from `frame`, then to the end."""
    from mimi_code2wav.export.reference import snr_db

    bounds = [(first, first + 13) for first in range(frame, pcm.size // SAMPLES_PER_FRAME, 13)][:seconds]
    return [snr_db(frames_of(pcm, *b), frames_of(reference, *b)) for b in [*bounds, (frame, None)]]


def export_spec(export_dir: Path):
    """The DecoderSpec an export folder was built with (its manifest)."""
    from mimi_code2wav.export.onnx_export import read_manifest
    from mimi_code2wav.export.spec import DecoderSpec

    return DecoderSpec.from_dict(read_manifest(export_dir)["spec"])


def copy_repository(repository: Path, target: Path) -> Path:
    """A copy of a rendered repository to edit, its ONNX files (~190 MB each) linked, not copied."""
    shutil.copytree(repository, target, ignore=shutil.ignore_patterns("*.onnx", "__pycache__"))
    for onnx_file in Path(repository).glob("*/*/*.onnx"):
        (target / onnx_file.relative_to(repository)).symlink_to(onnx_file.resolve())
    return target


def print_and_record(record_property, name: str, summary: str) -> None:
    """A measurement line: printed (pytest -s shows it) and kept in the JUnit report as `name`."""
    print(summary)
    record_property(name, summary)


# ---- processes, shared memory, waits -------------------------------------------------------------

def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # exited meanwhile
        return ""


def descendants(pid: int) -> dict[int, str]:
    """The processes that `pid` started, those they started, and so on: pid -> program name."""
    children: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # exited meanwhile
            name, _, fields = stat.read_text().partition(" (")[2].rpartition(")")
            children.setdefault(int(fields.split()[1]), []).append((int(stat.parent.name), name))
    found, parents = {}, [pid]
    while parents:
        generation = [child for parent in parents for child in children.get(parent, [])]
        found.update(generation)
        parents = [child for child, _ in generation]
    return found


def stub_pid(pid: int, model: str = "code2wav") -> int:
    """The Python stub of `model`'s one instance under `pid` (a tritonserver, or a command that runs one)."""
    pids = [stub for stub in descendants(pid) if f"{model}/1/model.py" in command_line(stub)]
    assert len(pids) == 1, f"one {model} stub expected under {pid}, found {pids}"
    return pids[0]


def tritonserver_under(pid: int) -> int | None:
    """The pid of the tritonserver that `pid` or one of its descendants started, if any."""
    return next((child for child, name in descendants(pid).items() if name == "tritonserver"), None)


def metric(server, name: str, **labels: str) -> float:
    """`server`'s metric `name` with `labels` (0.0 while unreported)."""
    from mimi_code2wav.server.triton import fetch_metrics, metric_value

    return metric_value(fetch_metrics(server.metrics_url), name, **labels) or 0.0


def shm_prefix_of(pid: int) -> str:
    """The shared-memory prefix on the command line of tritonserver `pid` (its Python stubs' regions)."""
    return re.search(r"shm-region-prefix-name=(\S+)", command_line(pid))[1]


def wait_until(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll `condition` until it holds or `timeout_s` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return condition()


def wait_http_ready(http_port: int, process, timeout_s: float, output: Path | None = None, poll_s: float = 0.1) -> float:
    """Poll /v2/health/ready on `http_port` until 200 while `process` runs; returns the seconds waited. Fails the test
    (with `output`'s text) if the process exits first or `timeout_s` passes."""
    started = time.monotonic()

    def output_text() -> str:
        return f":\n{output.read_text()}" if output is not None else ""

    while True:
        code = process.poll()
        assert code is None, f"the command exited with {code} before the server was ready{output_text()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, OSError):
            pass
        assert time.monotonic() - started < timeout_s, f"the server was not ready after {timeout_s:.0f} s{output_text()}"
        time.sleep(poll_s)


# ---- the model repository's Python files, without a server -----------------------------------------

def load_model_module(path: Path, name: str | None = None):
    """A model's Python file loaded as module `name` (default: its stem), its folder and model_repository/common on
    the path; one already loaded from that file is reused (one `model_errors` for the test and the models)."""
    for folder in (str(MODEL_REPOSITORY / "common"), str(Path(path).resolve().parent)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    name = name or Path(path).stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == Path(path).resolve():
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def triton_model_config(parameters: dict[str, str | None], idle_us: int | str | None = "30000000") -> dict:
    """A model config as Triton hands it to `initialize`: string parameters (None: left out), the idle timeout."""
    config = {"parameters": {key: {"string_value": value} for key, value in parameters.items() if value is not None}}
    if idle_us is not None:
        config["sequence_batching"] = {"max_sequence_idle_microseconds": idle_us}
    return config


class FakeClock:
    """A clock the test moves by hand: `clock.now += seconds`."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# A loaded machine (two shared cores, other suites running) can take minutes to start a server.
SERVE_READY_S = 300


def serve_command(repository: Path | None, log: Path, ports: list[int], *extra_args: str) -> list[str]:
    """`code2wav-server serve` of `repository` (None: `extra_args` say what) on `ports` (HTTP, gRPC, metrics)."""
    flags = [arg for name, port in zip(("http", "grpc", "metrics"), ports) for arg in (f"--{name}-port", str(port))]
    served = [] if repository is None else ["--model-repository", str(repository)]
    return [sys.executable, "-m", "mimi_code2wav.server", "serve", *served, *flags, "--log-file", str(log), *extra_args]


def serve_unready(repository: Path, tmp_path: Path, ports: list[int], **popen) -> subprocess.Popen:
    """`code2wav-server serve` of `repository` on `ports`, logging to tmp_path/server.log; not waited for."""
    return subprocess.Popen(serve_command(repository, tmp_path / "server.log", ports), cwd=REPO_ROOT, **popen)


@contextlib.contextmanager
def serve_cli(repository: Path | None, log: Path, *extra_args: str, env: dict[str, str] | None = None,
              ready_timeout_s: float = SERVE_READY_S):
    """`code2wav-server serve` on free ports, ready; yields (process, ports, its output file <log>.out). Killed on
    the way out if still running."""
    from mimi_code2wav.server.triton import free_ports

    ports = free_ports(3)
    output = log.with_name(f"{log.name}.out")
    with output.open("w") as sink:
        cli = subprocess.Popen(serve_command(repository, log, ports, *extra_args), cwd=REPO_ROOT, stdout=sink,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env)
    try:
        # Serve's own readiness: until then a server that dies failed to start, and serve does not restart it.
        wait_printed(cli, output, "tritonserver ready in ", ready_timeout_s)
        yield cli, ports, output
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()


def wait_printed(cli: subprocess.Popen, output: Path, text: str, timeout_s: float = SERVE_READY_S) -> None:
    """Wait until the serve command has printed `text`; fails the test with its output if it does not."""
    assert wait_until(lambda: text in output.read_text() or cli.poll() is not None, timeout_s) \
        and text in output.read_text(), f"serve did not print {text!r}:\n{output.read_text()}"


def stop_cli(cli: subprocess.Popen, output: Path) -> str:
    """SIGTERM the serve command, wait for it, and return everything it printed."""
    cli.send_signal(signal.SIGTERM)
    cli.wait(timeout=SERVE_READY_S)
    return output.read_text()


# ---- TLS ---------------------------------------------------------------------------------------------

def make_pki(folder: Path) -> Path:
    """`make_certificates` in `folder` (ca, server, client: NAME.pem + NAME.key), plus another CA's rogue-*.pem/.key."""
    from mimi_code2wav.server.processes import ServerError
    from mimi_code2wav.server.security import make_certificates

    try:
        make_certificates(folder, days=2)
        make_certificates(folder / "rogue", days=2)
    except ServerError as error:
        pytest.fail(f"the TLS tests make their certificates: {error}")
    for name in ("ca.pem", "client.pem", "client.key"):
        shutil.copy(folder / "rogue" / name, folder / f"rogue-{name}")
    return folder


def perf_analyzer_problem() -> str | None:
    """Why perf_analyzer cannot run here, or None."""
    binary = Path(sysconfig.get_paths()["scripts"]) / "perf_analyzer"
    if not binary.exists():
        return f"perf_analyzer is not installed ({binary} missing; it comes with tritonclient[all]==2.51.0)"
    libs = Path(sysconfig.get_paths()["purelib"]) / "nvidia_pytriton.libs"
    if not list(libs.glob("libb64-*.so.0d")) or not list(libs.glob("libcudart-*.so.12*")):
        return f"libb64/libcudart that perf_analyzer links are not in {libs} (the nvidia-pytriton wheel)"
    return None


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a server could bind `host:port` (connections lingering in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
