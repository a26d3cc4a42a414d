"""The README's CPU deployment, run for real: `docker compose --profile cpu up --build triton-cpu`, with only
variables set (the seeded moshi-format checkpoint, free ports, a project name of its own, the stand-in images of
benchmarks/docker_env.py). Where no Docker engine can be had these tests skip, saying why; in CI they fail."""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest

from benchmarks.docker_env import UP_TIMEOUT_S, Compose, host_cpython
from mimi_code2wav.client.protocol import MODEL_NAME
from mimi_code2wav.server.triton import fetch_metrics

from helpers import REPO_ROOT, code2wav_inputs, infer, infer_error, metric, send_in_chunks, sequence_ids, wait_until
from mimi_fixtures import assert_equal_audio, snr_db

pytestmark = [pytest.mark.server, pytest.mark.compose, pytest.mark.timeout(UP_TIMEOUT_S + 600)]
new_sequence_id = sequence_ids(7_100_000)


@pytest.fixture(scope="module")
def cpu_deployment(docker_env, moshi_checkpoint, tmp_path_factory):
    """The CPU profile up and healthy, serving the seeded checkpoint; down -v afterwards."""
    checkpoint = moshi_checkpoint[0]
    compose = Compose(docker_env, tmp_path_factory.mktemp("compose"), MIMI_WEIGHTS_DIR=str(checkpoint.parent),
                      MIMI_WEIGHTS=checkpoint.name)
    try:
        compose.up("cpu", "triton-cpu")
        yield compose
    finally:
        compose.down()


@pytest.fixture
def client(cpu_deployment):
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(cpu_deployment.grpc_url) as client:
        yield client


def test_the_export_completes_and_the_cpu_server_is_healthy(cpu_deployment):
    export = cpu_deployment.service("export")
    assert (export["State"], export["ExitCode"]) == ("exited", 0), export
    server = cpu_deployment.service("triton-cpu")
    assert (server["State"], server["Health"]) == ("running", "healthy"), server
    # The stand-in runs the Python models on NGC 25.x's Python 3.12 with numpy<2 where this host has one.
    python = cpu_deployment("exec", "-T", "triton-cpu", "python3", "-c",
                            "import sys, numpy; print('%d.%d' % sys.version_info[:2], numpy.__version__)").stdout.split()
    assert python == (["3.12", "1.26.4"] if host_cpython() else ["3.11", "1.26.4"]), python
    logs = cpu_deployment.logs("export")
    assert "/models-cpu: code2wav + mimi_decoder (onnxruntime, KIND_CPU)" in logs and "equals the checked-in" in logs, logs


@pytest.mark.parametrize("name", ["A", "B", "C2"])
def test_streams_through_the_published_port_equal_moshi(client, scenario, moshi_streams, name):
    codes = scenario.streams[name]
    pcm = np.concatenate(send_in_chunks(client, new_sequence_id(), codes, 0, codes.shape[1], chunk_frames=5,
                                        start=True))
    error, snr = assert_equal_audio(pcm, moshi_streams[name], what=f"stream {name} through compose")
    print(f"\ncompose cpu profile, stream {name}: vs moshi max abs {error:.2g}, SNR {snr:.1f} dB")


def test_bad_input_is_refused_and_the_server_stays_up(client, scenario, moshi_streams):
    codes = scenario.streams["A"]
    sequence_id = new_sequence_id()
    first = infer(client, sequence_id, codes[:, :3], 0, start=True, new_frames=3)
    bad = codes[:, 3:5].copy()
    bad[2, 1] = 2048
    infer_error(client, sequence_id, code2wav_inputs(bad, 3), "codebook 2, frame 1", "outside [0, 2048)")
    assert client.is_server_ready() and client.is_model_ready(MODEL_NAME)
    rest = infer(client, sequence_id, codes[:, 3:], 3, end=True, new_frames=codes.shape[1] - 3)
    assert_equal_audio(np.concatenate([first, rest]), moshi_streams["A"], what="the stream after a refusal")


def test_metrics_scrape(cpu_deployment, client, scenario):
    send_in_chunks(client, new_sequence_id(), scenario.streams["B"], 0, 4, chunk_frames=4, start=True)
    assert metric(cpu_deployment, "nv_inference_request_success", model=MODEL_NAME) >= 1
    assert any(key.startswith("code2wav_") for key in fetch_metrics(cpu_deployment.metrics_url)), "no code2wav_* metric"


def test_bench_profile_writes_perf_analyzers_csv(cpu_deployment):
    """The README's bench line against the running server: perf_analyzer's CSV in ./bench_results."""
    csv = REPO_ROOT / "bench_results" / "perf.csv"
    csv.unlink(missing_ok=True)
    # Any throughput counts as stable: the test checks the CSV, not how steady this machine is.
    cpu_deployment("--profile", "bench", "run", "--rm", "-e", "STABILITY_PERCENTAGE=1000", "perf", timeout_s=600)
    rows = csv.read_text().splitlines()
    assert rows[0].startswith("Concurrency,Inferences/Second"), rows[:2]
    concurrency, per_second = rows[1].split(",")[:2]
    assert int(concurrency) == 1 and float(per_second) > 0, rows[1]


def test_a_second_up_skips_the_export_and_changed_weights_redo_it(cpu_deployment, moshi_checkpoint, client,
                                                                   scenario, moshi_streams):
    cpu_deployment.up("cpu", "triton-cpu")
    assert "up to date with" in cpu_deployment.logs("export").split("exporting to")[-1]
    # Other weights (one decoder tensor scaled), and the README's line for new weights: the export runs
    # again and the recreated server decodes with them.
    from safetensors.torch import load_file, save_file

    checkpoint = moshi_checkpoint[0]
    other = checkpoint.with_name("changed-" + checkpoint.name)
    tensors = load_file(str(checkpoint))
    name = next(n for n in sorted(tensors) if n.startswith("decoder.") and tensors[n].is_floating_point())
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, str(other))
    cpu_deployment.env["MIMI_WEIGHTS"] = other.name
    cpu_deployment.up("cpu", "triton-cpu", "--force-recreate")
    logs = cpu_deployment.logs("export")
    assert "exporting to /export" in logs and "up to date with" not in logs, logs[-3000:]
    codes = scenario.streams["B"]
    pcm = np.concatenate(send_in_chunks(client, new_sequence_id(), codes, 0, codes.shape[1], start=True))
    assert pcm.shape == moshi_streams["B"].shape
    assert snr_db(pcm, moshi_streams["B"]) < 60, f"{name} scaled by 1.5, yet the audio equals the old weights'"


def test_tls_and_keys_from_the_access_folder(cpu_deployment, scenario, tmp_path):
    """CODE2WAV_ACCESS_DIR with a certificate and both keys: the recreated server serves only TLS clients with the
    inference key, the same audio as in plaintext before; perf takes the CA and keys from the same folder; no
    key shows in the logs. Then back to plaintext for the tests after."""
    from mimi_code2wav.client.credentials import Credentials
    from mimi_code2wav.client.protocol import ClientError
    from mimi_code2wav.client.sync import Code2WavClient, run_streams
    from mimi_code2wav.server.security import make_certificates

    access = make_certificates(tmp_path / "access", hosts=("localhost", "127.0.0.1", "triton"))
    (access / "inference.key").write_text("compose-inference-key\n")
    (access / "admin.key").write_text("compose-admin-key\n")
    plaintext = run_streams(cpu_deployment.grpc_url, [scenario.streams["A"]]).results[0].pcm
    cpu_deployment.env["CODE2WAV_ACCESS_DIR"] = str(access)
    try:
        cpu_deployment.up("cpu", "triton-cpu", "--force-recreate")
        url = cpu_deployment.grpc_url.replace("127.0.0.1", "localhost")
        with pytest.raises(ClientError, match="it expects TLS"):
            Code2WavClient(url).check_ready(timeout_s=5)
        with pytest.raises(ClientError, match="requires the inference key"):
            Code2WavClient(url, credentials=Credentials(tls_ca=str(access / "ca.pem"))).check_ready(timeout_s=5)
        good = Credentials(tls_ca=str(access / "ca.pem"), key="compose-inference-key")
        report = run_streams(url, [scenario.streams["A"]], credentials=good)
        assert_equal_audio(report.results[0].pcm, plaintext, what="compose over TLS with the key vs plaintext")
        csv = REPO_ROOT / "bench_results" / "perf.csv"
        csv.unlink(missing_ok=True)
        cpu_deployment("--profile", "bench", "run", "--rm", "perf", "bash", "client/perf.sh", "--request-count", "16",
                       timeout_s=600)
        assert csv.read_text().splitlines()[0].startswith("Concurrency,Inferences/Second")
        logs = cpu_deployment.logs("triton-cpu")
        assert "triton-watchdog: access: TLS on gRPC, inference key required, admin key required" in logs, logs[-2000:]
        assert "compose-inference-key" not in logs and "compose-admin-key" not in logs
    finally:
        del cpu_deployment.env["CODE2WAV_ACCESS_DIR"]
        cpu_deployment.up("cpu", "triton-cpu", "--force-recreate")


def test_stop_with_streams_in_flight_drains_and_down_leaves_nothing(cpu_deployment, scenario):
    """`docker compose stop` with 8 paced streams in flight: the server exits by itself with 0 inside
    the grace period (no SIGKILL); `down -v` leaves no container, volume or network of the project."""
    import threading

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    codes = scenario.streams["A"]
    sent = [0] * 8
    stop = threading.Event()

    def stream(index: int) -> None:
        sequence_id = new_sequence_id()
        with grpcclient.InferenceServerClient(cpu_deployment.grpc_url) as client:
            frame = 0
            while not stop.is_set():
                try:
                    infer(client, sequence_id, codes[:, frame % codes.shape[1]][:, None], frame, start=frame == 0,
                          new_frames=1)
                except InferenceServerException:
                    return
                sent[index] = frame = frame + 1
                time.sleep(0.08)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        assert wait_until(lambda: min(sent) >= 3, 30), f"streams did not get going: {sent}"
        started = time.monotonic()
        cpu_deployment("stop", "triton-cpu", timeout_s=120)
        stopped_s = time.monotonic() - started
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    server = cpu_deployment.service("triton-cpu")
    assert (server["State"], server["ExitCode"]) == ("exited", 0), server
    assert stopped_s < 30, f"stop took {stopped_s:.1f} s: past the 30 s grace period"
    print(f"\ncompose stop with 8 streams in flight: the server exited 0 after {stopped_s:.1f} s")
    cpu_deployment.down()
    label = f"label=com.docker.compose.project={cpu_deployment.project}"
    for kind in ("container", "volume", "network"):
        left = subprocess.run(["docker", kind, "ls", *(["-a"] if kind == "container" else []), "-q", "--filter", label],
                              env=cpu_deployment.env, capture_output=True, text=True, check=True).stdout.split()
        assert not left, f"down -v left {kind}s of {cpu_deployment.project}: {left}"


def test_a_broken_checkpoint_fails_the_export_naming_it_and_starts_no_server(docker_env, tmp_path):
    """(Weights that are missing: the entrypoint's refusal in test_compose.py.)"""
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "mimi.safetensors").write_bytes(b"not a safetensors file")
    compose = Compose(docker_env, tmp_path, MIMI_WEIGHTS_DIR=str(weights), MIMI_WEIGHTS="mimi.safetensors")
    try:
        assert compose.up("cpu", "triton-cpu", check=False).returncode != 0
        logs = compose.logs("export")
        assert "/weights/mimi.safetensors" in logs, logs[-3000:]
        assert compose.service("export")["ExitCode"] != 0
        assert not [c for c in compose.containers() if c["Service"] == "triton-cpu" and c["State"] == "running"]
    finally:
        compose.down()
