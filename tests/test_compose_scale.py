"""The README's scale-out on a CPU host, run for real: `docker compose -f docker-compose.yml -f
docker-compose.cpu.yml --profile scale up --build triton-proxy` (three replicas behind nginx, each stream kept
on one by its key) and the faults compose itself handles: the restart policy and the watchdog. Variables as in
test_compose_cpu.py. Faults come from the host: Docker restarts no container it was told to stop or kill."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from benchmarks.docker_env import REPLICAS, UP_TIMEOUT_S, Compose
from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS, SAMPLES_PER_FRAME, StreamOptions
from mimi_code2wav.client.sync import run_streams
from mimi_code2wav.export.reference import snr_db

from helpers import print_and_record, wait_until
from mimi_fixtures import assert_equal_audio

pytestmark = [pytest.mark.server, pytest.mark.compose, pytest.mark.timeout(UP_TIMEOUT_S + 600)]

EXIT_TIMEOUT_S = 25  # the replicas' --exit-timeout-secs (docker-compose.yml)
CHAOS_STREAMS = 6
CHAOS_FRAMES = 500  # 40 s of audio per stream, paced in real time
CHAOS_WINDOW_MIN_SNR_DB = 70.0


@pytest.fixture(scope="module")
def scale(docker_env, moshi_checkpoint, tmp_path_factory):
    checkpoint = moshi_checkpoint[0]
    compose = Compose(docker_env, tmp_path_factory.mktemp("compose-scale"), ("docker-compose.yml", "docker-compose.cpu.yml"),
                      MIMI_WEIGHTS_DIR=str(checkpoint.parent), MIMI_WEIGHTS=checkpoint.name)
    try:
        compose.up("scale", "triton-proxy")
        yield compose
    finally:
        compose.down()


def streams_and_solo(ort_decode, prefix: str, count: int, frames: int, seed: int) -> tuple[dict, dict]:
    """Seeded streams by key, and each one's decode by the ONNX step in this process: what every replica serves."""
    rng = np.random.default_rng(seed)
    codes = {f"{prefix}-{n}": rng.integers(0, CODEBOOK_SIZE, (NUM_CODEBOOKS, frames)) for n in range(count)}
    pcm = ort_decode(np.stack(list(codes.values())), frames_per_call=16)
    return codes, {key: pcm[i] for i, key in enumerate(codes)}


def test_chaos_every_frame_once_through_kills_hangs_and_drains(scale, ort_decode, record_property):
    """6 paced resumable streams through the proxy while, at seeded random moments, a replica's tritonserver is
    SIGKILLed, one SIGSTOPped (its watchdog kills it) and one container SIGTERMed (drained, exits 0); the restart
    policy brings all three back. Every stream gets every frame once, exact up to its first resume, >= 70 dB after."""
    codes, reference = streams_and_solo(ort_decode, "chaos", CHAOS_STREAMS, CHAOS_FRAMES, seed=17)
    rng = np.random.default_rng(17)
    options = StreamOptions(chunk_frames=4, first_chunk_frames=4, paced=True, resume_history_frames=250,
                            resume_timeout_s=90.0, response_timeout_s=3.0)
    restarts_before = {service: scale.inspect(service)["RestartCount"] for service in REPLICAS}
    outcome: dict = {}

    def decode_all():
        try:
            outcome["report"] = run_streams(scale.grpc_url, list(codes.values()), options,
                                            sequence_ids=[9000 + n for n in range(CHAOS_STREAMS)],
                                            stream_keys=list(codes))
        except BaseException as error:  # reported below
            outcome["error"] = error

    started = time.time()
    streams_thread = threading.Thread(target=decode_all, daemon=True)
    streams_thread.start()
    faults = []

    def at(seconds):
        time.sleep(max(0.0, started + seconds - time.time()))

    def busiest(exclude=()):
        """The healthy replica that answered the most streams in the last 3 s (where they are now)."""
        served = scale.placement(time.time() - 3.0)
        counts = {service: sum(service in served.get(key, ()) for key in codes) for service in REPLICAS
                  if service not in exclude and scale.healthy(service)}
        return max(counts, key=counts.get)

    at(rng.uniform(6, 9))
    killed = busiest()
    os.kill(scale.tritonserver_pid(killed), signal.SIGKILL)
    faults.append(f"SIGKILL {killed} at {time.time() - started:.1f} s")
    at(rng.uniform(16, 19))
    hung = busiest(exclude=(killed,))
    os.kill(scale.tritonserver_pid(hung), signal.SIGSTOP)
    # Stopped until its watchdog finds it answering no health check and kills it.
    assert wait_until(lambda: "hung; killing it (SIGKILL)" in scale.logs(hung), 60, poll_s=1.0), scale.logs(hung)[-3000:]
    faults.append(f"SIGSTOP {hung} at {time.time() - started:.1f} s, killed by its watchdog")
    at(rng.uniform(27, 30))
    drained = busiest(exclude=(hung,))
    # Docker's stop signal to the container's first process, which passes it on; not `docker stop` (no restart).
    os.kill(scale.inspect(drained)["State"]["Pid"], signal.SIGTERM)
    drained_at = time.time()
    faults.append(f"SIGTERM {drained} at {drained_at - started:.1f} s")
    streams_thread.join(CHAOS_FRAMES * 0.08 + 240)
    assert not streams_thread.is_alive(), "the streams never finished"
    if "error" in outcome:
        raise outcome["error"]

    resumes = 0
    for key, result in zip(codes, outcome["report"].results):
        assert result.pcm.shape == (CHAOS_FRAMES * SAMPLES_PER_FRAME,), key
        first = result.resumes[0].frame if result.resumes else CHAOS_FRAMES
        cut = first * SAMPLES_PER_FRAME
        assert_equal_audio(result.pcm[:cut], reference[key][:cut], what=f"{key} before its first resume")
        window = 13 * SAMPLES_PER_FRAME
        worst = min((snr_db(result.pcm[start : start + window], reference[key][start : start + window])
                     for start in range(cut, result.pcm.size, window)), default=float("inf"))
        assert worst >= CHAOS_WINDOW_MIN_SNR_DB, (key, worst, [r.describe() for r in result.resumes])
        resumes += len(result.resumes)
    # Drained by itself: exit 0 before the exit timeout would have forced it (as an open connection would).
    assert wait_until(lambda: any(at >= drained_at for at, _ in scale.exits(drained, started)), EXIT_TIMEOUT_S + 15,
                      poll_s=1.0), f"{drained} did not exit:\n{scale.logs(drained)[-3000:]}"
    at, code = next((at, code) for at, code in scale.exits(drained, started) if at >= drained_at)
    assert code == 0 and at - drained_at < EXIT_TIMEOUT_S, \
        f"{drained} exited {code} {at - drained_at:.1f} s after SIGTERM:\n{scale.logs(drained)[-3000:]}"
    faults[-1] += f" (exited 0 after {at - drained_at:.1f} s)"
    assert "answered no health check" in scale.logs(hung)
    for service in {killed, hung, drained}:  # the restart policy brought it back, healthy
        assert wait_until(lambda s=service: scale.inspect(s)["RestartCount"] > restarts_before[s] and scale.healthy(s),
                          120, poll_s=1.0), f"{service} did not come back:\n{scale.logs(service)[-3000:]}"
    assert wait_until(lambda: all(scale.healthy(service) for service in REPLICAS), 120, poll_s=1.0), \
        "a replica did not end healthy"
    summary = f"chaos on compose: {'; '.join(faults)}; {CHAOS_STREAMS} streams, {resumes} resumes, all complete"
    print_and_record(record_property, "compose_chaos", summary)


def test_tls_and_keys_through_the_proxy(scale, ort_decode, tmp_path):
    """Last on the deployment: CODE2WAV_ACCESS_DIR and CODE2WAV_PROXY_ACCESS=tls. nginx terminates TLS, checks the
    replicas' certificates and forwards the key; clients without TLS or the key are refused; with both, every
    stream is exact and kept on one replica by its key."""
    from mimi_code2wav.client.credentials import Credentials
    from mimi_code2wav.client.protocol import ClientError
    from mimi_code2wav.client.sync import Code2WavClient
    from mimi_code2wav.server.security import make_certificates

    access = make_certificates(tmp_path / "access", hosts=("localhost", "127.0.0.1", "triton"))
    (access / "inference.key").write_text("scale-inference-key\n")
    (access / "admin.key").write_text("scale-admin-key\n")
    scale.env.update(CODE2WAV_ACCESS_DIR=str(access), CODE2WAV_PROXY_ACCESS="tls")
    scale.up("scale", "triton-proxy", "--force-recreate")
    url = scale.grpc_url.replace("127.0.0.1", "localhost")
    with pytest.raises(ClientError, match="it expects TLS"):
        Code2WavClient(url).check_ready(timeout_s=10)
    credentials = Credentials(tls_ca=str(access / "ca.pem"), key="scale-inference-key")
    try:
        Code2WavClient(url, credentials=credentials).check_ready(timeout_s=10)
    except ClientError as error:
        raise AssertionError(f"{error}\nproxy:\n{scale.logs('triton-proxy')[-3000:]}") from None
    with pytest.raises(ClientError, match="requires the inference key .*, and none was given"):
        Code2WavClient(url, credentials=Credentials(tls_ca=str(access / "ca.pem"))).check_ready(timeout_s=10)

    streams, solo = streams_and_solo(ort_decode, "call", 3, 60, seed=35)
    keys = list(streams)
    started = time.time()
    report = run_streams(url, list(streams.values()), StreamOptions(chunk_frames=4), stream_keys=keys,
                         credentials=credentials)
    for key, result in zip(keys, report.results):
        assert_equal_audio(result.pcm, solo[key], what=f"{key} through the TLS proxy")
    served = scale.placement(started)
    assert all(len(served.get(key, ())) == 1 for key in keys), served
    for service in ("triton-proxy", *REPLICAS):
        logs = scale.logs(service)
        assert "scale-inference-key" not in logs and "scale-admin-key" not in logs, service
