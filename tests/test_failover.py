"""Streams that survive faults: resumable clients (`client.Code2WavStream`) on the real code2wav and python-ort
decoder. Three plain servers (tests in order), each client given every URL, its own first: one SIGKILLed
mid-stream, then started again under the same address. One node: `code2wav-server serve` restarts a killed
tritonserver. References: each stream's solo decode by the same ONNX step here (docs/design.md §2.3)."""

from __future__ import annotations

import os
import re
import signal
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS, SAMPLES_PER_FRAME, StreamOptions
from mimi_code2wav.client.sync import Code2WavClient, Code2WavStream
from mimi_code2wav.export.reference import snr_db
from mimi_code2wav.export.render import CODE2WAV_IDLE_TIMEOUT_US
from mimi_code2wav.server.processes import process_group_alive
from mimi_code2wav.server.triton import TritonServer, free_ports

from helpers import metric, port_is_free, print_and_record, serve_cli, snr_after, stop_cli, wait_until
from mimi_fixtures import assert_equal_audio

pytestmark = pytest.mark.server

# The kill comes past the 250 frames of history a resume replays (so the rebuilt state is not exact).
STREAMS, SERVERS, KILL_AT, AFTER_KILL, AFTER_RESTART, CHUNK_FRAMES, HISTORY_FRAMES = 12, 3, 270, 30, 20, 10, 250
RESUMED_MIN_SNR_DB = 75.0  # after a resume with 250 frames of history (docs/benchmarks.md), with room for other codes
STREAM_IDLE_TIMEOUT_S = CODE2WAV_IDLE_TIMEOUT_US / 1e6  # read from code2wav's config.pbtxt


def _start(repository: Path, log_path: Path, ports: list[int]) -> TritonServer:
    server = TritonServer(repository, log_path=log_path, **dict(zip(("http_port", "grpc_port", "metrics_port"), ports)))
    server.start()
    return server


@pytest.fixture(scope="module")
def servers(served_repository, tmp_path_factory):
    """Three tritonservers of the python-ort repository; `servers[i]` is replaced when a test restarts it."""
    run_dir = tmp_path_factory.mktemp("failover")
    ports = free_ports(3 * SERVERS)
    started = [_start(served_repository, run_dir / f"server-{i}.log", ports[3 * i : 3 * i + 3]) for i in range(SERVERS)]
    try:
        for server in started:
            server.wait_ready(180)
        yield started
    finally:
        for server in started:
            server.stop()


def _urls(servers: list[TritonServer], home: int) -> list[str]:
    """Every server's gRPC URL, `home` first."""
    return [servers[(home + k) % len(servers)].grpc_url for k in range(len(servers))]


_rng = np.random.default_rng(2026)
CODES = {f"call-{n}": _rng.integers(0, CODEBOOK_SIZE, (NUM_CODEBOOKS, KILL_AT + AFTER_KILL + AFTER_RESTART))
         for n in range(STREAMS)}


@pytest.fixture(scope="module")
def solo(ort_decode):
    """Each stream decoded by the ONNX step in this process (the streams batched), 16 frames per call."""
    return dict(zip(CODES, ort_decode(np.stack(list(CODES.values())), frames_per_call=16)))


def _decode_all(clients: dict[str, Code2WavStream], first: int, stop: int,
                end: bool = False, lockstep: bool = False) -> dict[str, np.ndarray]:
    """Frames [first, stop) of every client's stream, in chunks, a thread each; in `lockstep`, chunk i goes only
    once every stream has chunk i - 1 answered, so none sits idle waiting for the slowest server's streams."""
    barrier = threading.Barrier(len(clients), timeout=120) if lockstep else None
    results, errors = {}, {}

    def decode(key: str) -> None:
        try:
            chunks = []
            for start in range(first, stop, CHUNK_FRAMES):
                if barrier is not None:
                    barrier.wait()
                last = min(start + CHUNK_FRAMES, stop)
                chunks.append(clients[key].decode(CODES[key][:, start:last], end=end and last == stop))
            results[key] = np.concatenate(chunks)
        except BaseException as error:  # reported below, per stream
            errors[key] = error

    threads = [threading.Thread(target=decode, args=(key,), daemon=True) for key in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not any(thread.is_alive() for thread in threads), "a stream never finished"
    assert not errors, errors
    return results


def _assert_resumed_audio(key: str, pcm: np.ndarray, reference: np.ndarray, resume, min_snr_db: float,
                          seconds: int | None = 1) -> None:
    """Exact up to the resume; after it, each of its first `seconds` seconds (None: all) >= `min_snr_db`."""
    cut = resume.frame * SAMPLES_PER_FRAME
    assert_equal_audio(pcm[:cut], reference[:cut], what=f"{key} before its resume at frame {resume.frame}")
    snrs = snr_after(pcm, reference, resume.frame, seconds)
    assert min(snrs) >= min_snr_db, (key, snrs)
    print(f"{key}: {resume.describe()}; SNR after the resume {snrs[0]:.1f} dB (1 s), {snrs[-1]:.1f} dB (to the end)")


def _failovers(stream: Code2WavStream) -> list:
    """The stream's resumes after its first frame: a retried first request loses no audio and moves no state."""
    return [resume for resume in stream.resumes if resume.frame > 0]


@pytest.fixture(scope="module")
def clients(servers):
    """Stream n starts on server n % 3."""
    options = StreamOptions(resume_history_frames=HISTORY_FRAMES, resume_timeout_s=30.0)
    opened = {key: Code2WavClient(_urls(servers, n % SERVERS), options).stream(sequence_id=1000 + n, stream_key=key)
              for n, key in enumerate(CODES)}
    yield opened
    for stream in opened.values():
        stream.close()


def test_a_killed_servers_streams_resume_on_the_next_url_and_the_others_never_notice(
        servers, solo, clients, record_property):
    """12 streams, 4 starting on each of three servers; SIGKILL server 0 at frame 270: every stream completes
    with the exact sample count, the others equal their solo decode, the resumed ones equal it up to the resume
    and meet the resume SNR after it, each on the next server of its list."""
    # In lockstep, so that no server's sequences idle out before the kill while the others' streams catch up.
    before = _decode_all(clients, 0, KILL_AT, lockstep=True)
    victims = [key for key in CODES if clients[key].url == servers[0].grpc_url]
    assert len(victims) == STREAMS // SERVERS, {key: stream.url for key, stream in clients.items()}

    servers[0].process.send_signal(signal.SIGKILL)
    servers[0].process.wait(30)
    after = _decode_all(clients, KILL_AT, KILL_AT + AFTER_KILL)

    stalls = []
    for n, (key, stream) in enumerate(clients.items()):
        pcm = np.concatenate([before[key], after[key]])
        assert pcm.shape == ((KILL_AT + AFTER_KILL) * SAMPLES_PER_FRAME,), key
        reference = solo[key][: pcm.size]
        resumes = _failovers(stream)
        if key not in victims:
            # The victims' replays (the replay lane, docs/design.md §5) hold up none of its requests.
            assert not resumes, (key, [r.describe() for r in resumes])
            assert_equal_audio(pcm, reference, what=f"{key} (on a live server)")
            continue
        # Resumed once, at the kill, on the next server of its list.
        assert len(resumes) == 1 and resumes[0].frame == KILL_AT and resumes[0].history_frames == HISTORY_FRAMES, \
            [r.describe() for r in resumes]
        assert stream.url == _urls(servers, n % SERVERS)[1] == resumes[0].url, (key, stream.url)
        _assert_resumed_audio(key, pcm, reference, resumes[0], RESUMED_MIN_SNR_DB)
        stalls.append(resumes[0].stall_s)
    summary = (f"SIGKILL of server 0 holding {len(victims)} of {STREAMS} streams at frame {KILL_AT}: last good "
               f"response -> first resumed response on the next URL {statistics.median(stalls) * 1e3:.0f} ms median, "
               f"{max(stalls) * 1e3:.0f} ms max")
    print_and_record(record_property, "failover", summary)


def test_a_restarted_server_serves_again_and_idle_streams_resume_where_they_are(
        servers, solo, clients, tmp_path):
    """The killed server starts again under the same address while every stream idles out: each resumes once,
    on its next request, on the next server of its list, with the exact sample count; a new stream whose list
    starts with the restarted server is decoded there, exact."""
    dead = servers[0]
    dead.stop()  # its stubs and shared memory
    servers[0] = _start(dead.model_repository, tmp_path / "server-0-restarted.log",
                        [dead.http_port, dead.grpc_port, dead.metrics_port])
    servers[0].wait_ready(180)
    # Waiting until every server dropped them makes the outcome independent of how long the restart took.
    assert wait_until(lambda: not any(metric(server, "code2wav_live_streams") for server in servers), STREAM_IDLE_TIMEOUT_S + 60, poll_s=0.5), \
        "the idle streams were never expired"
    first, stop = KILL_AT + AFTER_KILL, KILL_AT + AFTER_KILL + AFTER_RESTART
    where = {key: stream.url for key, stream in clients.items()}
    last = _decode_all(clients, first, stop, end=True)
    for n, (key, stream) in enumerate(clients.items()):
        assert last[key].shape == (AFTER_RESTART * SAMPLES_PER_FRAME,)
        reference = solo[key][first * SAMPLES_PER_FRAME : stop * SAMPLES_PER_FRAME]
        later = [r for r in stream.resumes if r.frame >= first]
        # One resume, in one attempt, on the URL after the last one it held.
        urls = _urls(servers, n % SERVERS)
        assert len(later) == 1 and later[0].frame == first, [r.describe() for r in stream.resumes]
        assert later[0].attempts == 1 and later[0].url == urls[(urls.index(where[key]) + 1) % SERVERS], later[0].describe()
        assert snr_db(last[key], reference) >= RESUMED_MIN_SNR_DB, key
    key = next(iter(CODES))
    with Code2WavClient(_urls(servers, 0), StreamOptions()).stream(sequence_id=5000, stream_key=key) as fresh:
        pcm = fresh.decode(CODES[key][:, :4], end=True)
        assert fresh.url == servers[0].grpc_url
    assert pcm.shape == (4 * SAMPLES_PER_FRAME,) and not _failovers(fresh)
    assert_equal_audio(pcm, solo[key][: pcm.size], what="a new stream on the restarted server")


# ---- one node: `code2wav-server serve` restarts a tritonserver that dies ---------------------------

SERVE_STREAMS = 4
RESTARTED_MIN_SNR_DB = 70.0


def test_serve_restarts_a_killed_tritonserver_and_resumable_streams_lose_nothing(
        served_repository, solo, tmp_path, record_property):
    """SIGKILL of `serve`'s tritonserver under 4 resumable streams at frame 270: serve starts it again on the same
    ports, every stream resumes once, exact before the kill and >= 70 dB in every second after it; then
    SIGTERM drains and stops everything, exit 0, nothing left."""
    keys = list(CODES)[:SERVE_STREAMS]
    options = StreamOptions(resume_history_frames=HISTORY_FRAMES, resume_timeout_s=90.0)
    with serve_cli(served_repository, tmp_path / "server.log") as (serve, ports, output):
        clients = {key: Code2WavClient(f"127.0.0.1:{ports[1]}", options).stream(sequence_id=3000 + n, stream_key=key)
                   for n, key in enumerate(keys)}
        try:
            first_pid = int(re.search(r"tritonserver ready in [0-9.]+ s \(pid (\d+)\)", output.read_text())[1])
            before = _decode_all(clients, 0, KILL_AT, lockstep=True)
            os.kill(first_pid, signal.SIGKILL)
            killed = time.monotonic()
            after = _decode_all(clients, KILL_AT, KILL_AT + AFTER_KILL, end=True)
        finally:
            for client in clients.values():
                client.close()
        text = stop_cli(serve, output)
    back = re.search(r"tritonserver restarted \(pid (\d+), restart 1\), ready in ([0-9.]+) s", text)
    assert back and "was killed by SIGKILL" in text and serve.returncode == 0, text
    for key in keys:
        pcm = np.concatenate([before[key], after[key]])
        assert pcm.shape == ((KILL_AT + AFTER_KILL) * SAMPLES_PER_FRAME,), key
        resumes = _failovers(clients[key])
        assert len(resumes) == 1 and resumes[0].frame == KILL_AT, [r.describe() for r in resumes]
        _assert_resumed_audio(key, pcm, solo[key][: pcm.size], resumes[0], RESTARTED_MIN_SNR_DB, seconds=None)
    stalls = [_failovers(clients[key])[0].stall_s for key in keys]
    assert "SIGTERM: draining and stopping tritonserver" in text and "Traceback" not in text, text
    log = (tmp_path / "server.log").read_text()
    assert "Non-graceful termination" not in log and "Exit timeout expired" not in log, log[-3000:]
    for pid in (first_pid, int(back[1])):
        assert not Path(f"/proc/{pid}").exists() and not process_group_alive(pid), pid
    assert all(port_is_free(port) for port in ports)
    summary = (f"SIGKILL of tritonserver under `serve` with {len(keys)} streams at frame {KILL_AT}: back (ready) in "
               f"{float(back[2]):.1f} s after its restart, {time.monotonic() - killed:.0f} s to the end of the streams; "
               f"stall last good response -> resumed response {max(stalls):.1f} s max")
    print_and_record(record_property, "serve_restart", summary)
