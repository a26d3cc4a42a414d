"""tritonserver replicas behind nginx with stream affinity (`server/replicas.py`, `server/nginx.py`),
as real processes on loopback; and the Kubernetes manifests' structure.

Where only routing matters, a tiny sequence-batched Python model, `stream_counter`, stands in for
code2wav: it counts each stream's requests and answers with the count and its server's pid, so every
response says which replica holds the stream, and a request that reaches a replica without its
stream's START is refused (by Triton's sequence batcher, as a code2wav request would be). One test runs
the real code2wav repository. Tests that need nginx skip, saying so, where it is not installed (CI
installs it: .ci/run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS, STREAM_KEY_HEADER
from mimi_code2wav.server import nginx
from mimi_code2wav.server.nginx import NginxError, find_nginx
from mimi_code2wav.server.processes import log_tail, process_group_alive
from mimi_code2wav.server.replicas import ReplicaSet
from mimi_code2wav.server.triton import SHM_DIR, fetch_metrics, free_ports, metric_value, port_is_free

from helpers import REPO_ROOT, code2wav_inputs, pcm_of, print_and_record, process_exists, send_in_chunks, shm_prefix_of

pytestmark = pytest.mark.server

KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
MODEL = "stream_counter"
# Short, so that a restarted replica gets its keys back within a test's patience.
FAIL_TIMEOUT_S = 2
# The replica sets' exit timeout. Their tests leave streams open, and a stopping replica waits for its
# live streams up to this (25 s in production); nothing here is about that wait.
EXIT_TIMEOUT_S = 1
# Triton's refusal of a stream it never saw START (the replica a stream moved to).
NOT_STARTED = "must specify the START flag on the first request of the sequence"
# The proxy's own answer when no replica could take a request (e.g. in flight when its replica died).
PROXY_UNAVAILABLE = "code2wav proxy: the replica for this stream could not be reached"
GRPC_INFER_URI = "/inference.GRPCInferenceService/ModelInfer"

STREAM_COUNTER_CONFIG = """\
name: "stream_counter"
backend: "python"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [
  { name: "count" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "server_pid" data_type: TYPE_INT64 dims: [ 1 ] }
]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  oldest { max_candidate_sequences: 256 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END, int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID, data_type: TYPE_UINT64 } ] }
  ]
}
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

STREAM_COUNTER_MODEL = """\
import os

import numpy as np
import triton_python_backend_utils as pb_utils

START, END = 1, 2


class TritonPythonModel:
    \"\"\"Counts each stream's requests; answers with the count and the pid of its tritonserver.\"\"\"

    def initialize(self, args):
        self.counts = {}
        self.server_pid = os.getppid()

    def execute(self, requests):
        responses = []
        for request in requests:
            stream, flags = request.correlation_id(), request.flags()
            if flags & START:
                self.counts[stream] = 0
            if stream not in self.counts:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"stream {stream} is not open on server {self.server_pid}: START it")))
                continue
            self.counts[stream] += 1
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("count", np.array([[self.counts[stream]]], np.int64)),
                pb_utils.Tensor("server_pid", np.array([[self.server_pid]], np.int64)),
            ]))
            if flags & END:
                del self.counts[stream]
        return responses
"""


# ---- helpers -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nginx_install():
    try:
        return find_nginx()
    except NginxError as error:
        pytest.skip(f"needs nginx, which is not usable here: {error}")


@pytest.fixture(scope="module")
def counter_repository(tmp_path_factory) -> Path:
    repository = tmp_path_factory.mktemp("stream_counter") / "repository"
    model_dir = repository / MODEL
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(STREAM_COUNTER_CONFIG)
    (model_dir / "1" / "model.py").write_text(STREAM_COUNTER_MODEL)
    return repository


@pytest.fixture(scope="module")
def short_idle_counter_repository(tmp_path_factory) -> Path:
    """`stream_counter` whose streams idle out after 2 s, for the commands' tests: they stop (SIGTERM)
    and drain (SIGHUP) replicas that hold streams, and a stopping replica waits for its live streams
    (up to the 25 s exit timeout), so here they leave within 2 s."""
    repository = tmp_path_factory.mktemp("stream_counter_short_idle") / "repository"
    model_dir = repository / MODEL
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(
        STREAM_COUNTER_CONFIG.replace("max_sequence_idle_microseconds: 60000000", "max_sequence_idle_microseconds: 2000000"))
    (model_dir / "1" / "model.py").write_text(STREAM_COUNTER_MODEL)
    return repository


@contextlib.contextmanager
def running_replicas(repository: Path, run_dir: Path, replicas: int = 3, **kwargs):
    """A started ReplicaSet on free loopback ports, stopped on exit; on an error, the tails of nginx's
    error log and of every replica's log are printed (pytest shows them with the failure)."""
    kwargs.setdefault("fail_timeout_s", FAIL_TIMEOUT_S)
    kwargs.setdefault("exit_timeout_s", EXIT_TIMEOUT_S)
    replica_set = ReplicaSet(repository, replicas, run_dir=run_dir, grpc_port=0, http_port=0,
                             replica_base_port=None, **kwargs)
    try:
        replica_set.start(ready_timeout_s=120)
        yield replica_set
    except BaseException:
        print(f"--- nginx error log ({replica_set.proxy.error_log}):\n{log_tail(replica_set.proxy.error_log)}")
        for replica in replica_set.replicas:
            print(f"--- replica {replica.index} ({replica.log_path}):\n{log_tail(replica.log_path, lines=20)}")
        raise
    finally:
        replica_set.stop()


@dataclasses.dataclass
class Reply:
    key: str | None
    sequence_id: int
    start: bool
    sent_at: float
    received_at: float
    count: int | None = None
    server_pid: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class CounterClient:
    """Unary requests to `stream_counter` through one gRPC channel, each carrying its stream key."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)

    def send(self, key: str | None, sequence_id: int, start: bool = False) -> Reply:
        tensor = grpcclient.InferInput("x", [1, 1], "INT64")
        tensor.set_data_from_numpy(np.zeros((1, 1), np.int64))
        headers = {STREAM_KEY_HEADER: key} if key is not None else None
        sent_at = time.monotonic()
        try:
            result = self.client.infer(MODEL, [tensor], sequence_id=sequence_id, sequence_start=start,
                                       headers=headers, client_timeout=20)
        except InferenceServerException as error:
            return Reply(key, sequence_id, start, sent_at, time.monotonic(), error=error.message())
        return Reply(key, sequence_id, start, sent_at, time.monotonic(),
                     count=int(result.as_numpy("count")[0, 0]), server_pid=int(result.as_numpy("server_pid")[0, 0]))

    def close(self) -> None:
        self.client.close()


_LOG_LINE = re.compile(
    r'^\S+ (?P<msec>[0-9.]+) stream="(?P<key>[^"]*)" upstream="(?P<upstream>[^"]*)" status=(?P<status>\d+) '
    r'upstream_status="(?P<upstream_status>[^"]*)" grpc_status="(?P<grpc_status>[^"]*)" '
    r'request_time=\S+ uri=(?P<uri>\S+)$'
)


def inference_log(replica_set: ReplicaSet, expected_lines: int, timeout_s: float = 5.0) -> list[dict]:
    """The proxy's access log lines of gRPC inference requests, parsed; waits until `expected_lines`
    are there (nginx writes a line once the response is sent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = []
        for line in replica_set.proxy.access_log.read_text().splitlines():
            match = _LOG_LINE.match(line)
            assert match, f"unexpected access log line: {line!r}"
            if match["uri"] == GRPC_INFER_URI:
                entry = match.groupdict()
                entry["tried"] = entry["upstream"].split(", ")
                entry["served_by"] = entry["tried"][-1]
                lines.append(entry)
        if len(lines) >= expected_lines or time.monotonic() >= deadline:
            assert len(lines) == expected_lines, f"{len(lines)} inference lines in the access log, expected {expected_lines}"
            return lines
        time.sleep(0.05)


def replicas_of_stream(replica_set: ReplicaSet, key: str, timeout_s: float = 5.0) -> set[str]:
    """The replicas the proxy's access log names for stream `key`; waits for its first line (nginx
    writes a request's line after the client may already hold the response)."""
    deadline = time.monotonic() + timeout_s
    while (placed := nginx.replicas_by_stream(replica_set.proxy.requests()).get(key)) is None:
        assert time.monotonic() < deadline, f"no access log line for stream {key} in {timeout_s:g} s"
        time.sleep(0.05)
    return placed


def inference_successes(replica) -> float:
    return metric_value(fetch_metrics(replica.metrics_url), "nv_inference_request_success", model=MODEL) or 0.0


def place_streams(client: CounterClient, replica_set: ReplicaSet, per_replica: int = 2, max_keys: int = 400):
    """START streams of keys "stream-0", "stream-1", ... until each replica holds `per_replica` of them;
    returns {key: (sequence_id, replica index)} (sequence id n + 1 for key n)."""
    replica_of = {replica.pid: replica.index for replica in replica_set.replicas}
    placed = {}
    for number in range(max_keys):
        key = f"stream-{number}"
        reply = client.send(key, number + 1, start=True)
        assert reply.ok and reply.count == 1, reply
        placed[key] = (number + 1, replica_of[reply.server_pid])
        held = [sum(index == replica.index for _, index in placed.values()) for replica in replica_set.replicas]
        if min(held) >= per_replica:
            return placed
    raise AssertionError(f"{max_keys} stream keys never gave each replica {per_replica} streams: {held}")


# ---- the proxy's configuration ---------------------------------------------------------------------

def test_missing_nginx_says_how_to_install_it(monkeypatch, tmp_path, counter_repository):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(nginx, "_SEARCH_DIRS", ())
    with pytest.raises(NginxError, match=r"nginx is not installed.*apt-get install nginx.*--nginx"):
        find_nginx()
    # The command stops before starting any replica, with one line.
    missing = tmp_path / "no-such-nginx"
    result = subprocess.run(
        [sys.executable, "-m", "mimi_code2wav.server", "serve-replicas", "--model-repository", str(counter_repository),
         "--nginx", str(missing), "--grpc-port", "0", "--http-port", "0", "--replica-base-port", "0",
         "--run-dir", str(tmp_path / "run")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == f"error: nginx binary {missing} does not exist or is not executable"
    assert not (tmp_path / "run").exists()


def test_local_config_routes_by_stream_key_and_passes_nginx_t(nginx_install, tmp_path):
    proxy = nginx.NginxProxy(tmp_path / "nginx", grpc_servers=["127.0.0.1:9101", "127.0.0.1:9111"],
                             http_servers=["127.0.0.1:9100", "127.0.0.1:9110"], grpc_port=0, http_port=0,
                             max_fails=3, fail_timeout_s=7)
    config = proxy.write_config().read_text()  # runs `nginx -t`
    grpc_upstream = re.search(r"upstream code2wav_grpc \{(.*?)\n    \}", config, re.S).group(1)
    assert "hash $code2wav_stream_key consistent;" in grpc_upstream
    assert re.findall(r"server (\S+) max_fails=3 fail_timeout=7s;", grpc_upstream) == ["127.0.0.1:9101", "127.0.0.1:9111"]
    assert f"127.0.0.1:{proxy.grpc_port}" in config and f"127.0.0.1:{proxy.http_port}" in config
    # Every file nginx writes is in its folder, and it stays in the foreground.
    assert "daemon off;" in config
    for path in re.findall(r"^\s*(?:pid|error_log|access_log|\w+_temp_path) (/\S+?)[; ]", config, re.M):
        assert Path(path).is_relative_to(tmp_path / "nginx"), path
    # Workers drop to an unprivileged user only where nginx starts as root.
    assert bool(re.search(r"^user \w+ \w+;$", config, re.M)) == (os.geteuid() == 0)


def test_make_serve_with_replicas_runs_serve_replicas():
    def dry_run(*variables: str) -> str:
        # --no-print-directory: under `make test` this make is a sub-make, which would print its directory.
        result = subprocess.run(["make", "--no-print-directory", "-n", "serve", *variables], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        (line,) = [line for line in result.stdout.splitlines() if "code2wav-server" in line]
        return line

    assert "code2wav-server serve-replicas --replicas 3 --http-port 8000 --grpc-port 8001" in dry_run("REPLICAS=3")
    assert "code2wav-server serve --metrics-port 8002 --http-port 8000 --grpc-port 8001" in dry_run()


# ---- affinity, failover, restart (tiny model) ----------------------------------------------------

def test_each_stream_stays_on_one_replica(nginx_install, counter_repository, tmp_path):
    """12 interleaved streams through the proxy: each stream's requests all reach one replica (its
    counts run on without a gap, the access log names one upstream, the replicas' own metrics agree),
    and the streams are spread over more than one replica. Requests without a key all reach one."""
    with running_replicas(counter_repository, tmp_path / "run") as replica_set:
        client = CounterClient(replica_set.proxy_grpc_url)
        keys = [f"stream-{number}" for number in range(12)]
        replies = [client.send(key, number + 1, start=round_ == 0)
                   for round_ in range(4) for number, key in enumerate(keys)]
        keyless = [client.send(None, 100, start=index == 0) for index in range(4)]
        client.close()

        replica_of = {replica.pid: replica for replica in replica_set.replicas}
        assert all(reply.ok for reply in replies + keyless), [reply for reply in replies + keyless if not reply.ok]
        pids_of = {key: {reply.server_pid for reply in replies if reply.key == key} for key in keys}
        assert all(len(pids) == 1 for pids in pids_of.values()), pids_of
        for key in keys:
            assert [reply.count for reply in replies if reply.key == key] == [1, 2, 3, 4], key
        used = {pid for pids in pids_of.values() for pid in pids}
        assert used <= set(replica_of) and len(used) > 1, f"all 12 streams on one replica: {pids_of}"
        assert [reply.count for reply in keyless] == [1, 2, 3, 4] and len({reply.server_pid for reply in keyless}) == 1

        # nginx's view: one upstream per key, the replica that answered, no retry.
        log = inference_log(replica_set, len(replies) + len(keyless))
        for key in [*keys, None]:
            lines = [line for line in log if line["key"] == (key or "-")]
            assert len(lines) == 4 and all(len(line["tried"]) == 1 for line in lines), lines
            pid = next(iter(pids_of[key])) if key else keyless[0].server_pid
            assert {line["served_by"] for line in lines} == {replica_of[pid].grpc_url}, key
        # Each replica's own count of the requests it served.
        for replica in replica_set.replicas:
            served = sum(reply.server_pid == replica.pid for reply in replies + keyless)
            assert inference_successes(replica) == served, f"replica {replica.index}"
        print(f"streams per replica: { {replica_of[pid].index: sum(pids == {pid} for pids in pids_of.values()) for pid in used} }")


def test_killed_replica_streams_move_and_the_others_are_unaffected(nginx_install, counter_repository, tmp_path, record_property):
    """SIGKILL one replica while every stream sends requests back to back: the proxy routes the dead
    replica's keys to a live replica at once (which refuses their unknown streams until they START
    again, as a resuming client does), and the streams of the other replicas see no error."""
    with running_replicas(counter_repository, tmp_path / "run") as replica_set:
        client = CounterClient(replica_set.proxy_grpc_url)
        placed = place_streams(client, replica_set)
        held = {replica.index: [key for key, (_, index) in placed.items() if index == replica.index]
                for replica in replica_set.replicas}
        victim = max(held, key=lambda index: len(held[index]))
        victim_pid, victim_url = replica_set.replicas[victim].pid, replica_set.replicas[victim].grpc_url
        live_pids = {replica.pid for replica in replica_set.replicas if replica.index != victim}

        sequence_ids = {key: sequence_id for key, (sequence_id, _) in placed.items()}
        next_sequence_id = iter(range(10_001, 20_000))
        replies: dict[str, list[Reply]] = {key: [] for key in placed}
        stop = threading.Event()
        failures: list[BaseException] = []

        def traffic():
            """Every stream in turn, back to back; a stream whose request fails STARTs again (resume)."""
            restart = dict.fromkeys(placed, False)
            try:
                while not stop.is_set():
                    for key in placed:
                        reply = client.send(key, sequence_ids[key], start=restart[key])
                        replies[key].append(reply)
                        restart[key] = not reply.ok
                        if not reply.ok:
                            sequence_ids[key] = next(next_sequence_id)
            except BaseException as error:  # surfaced by the main thread
                failures.append(error)

        sender = threading.Thread(target=traffic, daemon=True)
        sender.start()
        time.sleep(0.5)
        replica_set.kill(victim)
        killed_wall = time.time()
        time.sleep(1.5)
        stop.set()
        sender.join(30)
        client.close()
        assert not sender.is_alive() and not failures, failures

        # The other replicas' streams: no error, same replica, counts without a gap.
        for key, (_, index) in placed.items():
            if index == victim:
                continue
            assert all(reply.ok for reply in replies[key]), [reply for reply in replies[key] if not reply.ok]
            assert {reply.server_pid for reply in replies[key]} == {replica_set.replicas[index].pid}, key
            assert [reply.count for reply in replies[key]] == list(range(2, 2 + len(replies[key]))), key

        # The dead replica's streams: the last answer from it, then answers from a live replica.
        failover_s, first_answer_s = [], []
        for key in held[victim]:
            stream = replies[key]
            last_good = max(position for position, reply in enumerate(stream) if reply.ok and reply.server_pid == victim_pid)
            after = stream[last_good + 1:]
            assert after and not after[0].ok, f"{key}: no failed request after the kill: {after[:3]}"
            assert NOT_STARTED in after[0].error or PROXY_UNAVAILABLE in after[0].error, after[0].error
            resumed = next(position for position, reply in enumerate(after) if reply.ok)
            assert after[resumed].start and after[resumed].count == 1, after[resumed]
            moved_to = after[resumed].server_pid
            assert moved_to in live_pids, f"{key} resumed on {moved_to}, not a live replica {live_pids}"
            rest = after[resumed:]
            assert all(reply.ok and reply.server_pid == moved_to for reply in rest), f"{key} left {moved_to}: {rest}"
            assert [reply.count for reply in rest] == list(range(1, len(rest) + 1))
            first_answer = next((reply for reply in after if reply.ok or NOT_STARTED in reply.error), None)
            failover_s.append(after[resumed].received_at - stream[last_good].received_at)
            first_answer_s.append(first_answer.received_at - stream[last_good].received_at)
        # Bounded failover: a paced live stream sends a frame every 80 ms.
        assert max(failover_s) < 1.0, f"failover took {max(failover_s):.3f} s"

        # nginx's view: after the kill nothing was served by the dead replica, which was taken out.
        log = inference_log(replica_set, sum(map(len, replies.values())) + len(placed))
        late = [line for line in log if float(line["msec"]) > killed_wall + 0.01]
        assert late and all(line["served_by"] != victim_url for line in late)
        retried = [line for line in log if line["tried"][0] == victim_url and len(line["tried"]) > 1]
        assert retried, "no request went on from the dead replica to a live one"
        print(f"{len(retried)} requests retried past the dead replica, e.g. {retried[0]}")
        disabled = [line for line in replica_set.proxy.error_log.read_text().splitlines()
                    if "upstream server temporarily disabled" in line and f"grpc://{victim_url}" in line]
        assert disabled, "nginx never took the dead replica out"

        summary = (f"failover (last answer from the dead replica -> first answer from a live one): "
                   f"max {max(first_answer_s) * 1e3:.1f} ms, median {statistics.median(first_answer_s) * 1e3:.1f} ms; "
                   f"to the resumed stream's first audio: max {max(failover_s) * 1e3:.1f} ms over {len(failover_s)} streams")
        print_and_record(record_property, "failover", summary)


def test_restarted_replica_takes_its_streams_back(nginx_install, counter_repository, tmp_path, record_property):
    """A killed replica restarted on the same address gets its keys back once its fail timeout has
    passed: new streams of those keys land on it again. A stream that moved away during the outage
    moves back with its key and must START once more there (the cost of hashing without state)."""
    with running_replicas(counter_repository, tmp_path / "run") as replica_set:
        client = CounterClient(replica_set.proxy_grpc_url)
        placed = place_streams(client, replica_set)
        victim = max(range(len(replica_set.replicas)),
                     key=lambda index: sum(held == index for _, held in placed.values()))
        victim_keys = [key for key, (_, index) in placed.items() if index == victim]
        others = {key: value for key, value in placed.items() if value[1] != victim}
        old = replica_set.replicas[victim]
        old_ports, old_pid = (old.server.http_port, old.server.grpc_port, old.server.metrics_port), old.pid

        replica_set.kill(victim)
        # During the outage every victim key STARTs afresh on a live replica (and fails over there).
        moved = {}
        for number, key in enumerate(victim_keys):
            refused = client.send(key, placed[key][0])
            assert not refused.ok and NOT_STARTED in refused.error, refused
            resumed = client.send(key, 30_000 + number, start=True)
            assert resumed.ok and resumed.server_pid != old_pid, resumed
            moved[key] = resumed

        ready_s = replica_set.restart(victim)
        replica = replica_set.replicas[victim]
        assert (replica.server.http_port, replica.server.grpc_port, replica.server.metrics_port) == old_ports
        assert replica.pid != old_pid and replica.is_alive() and replica.restarts == 1
        assert (tmp_path / "run" / f"replica-{victim}.log.1").is_file(), "the crashed replica's log was not kept"

        # New streams of the victim's keys land on the restarted replica within its fail timeout.
        began, attempts = time.monotonic(), 0
        while True:
            attempts += 1
            probe = client.send(victim_keys[0], 40_000 + attempts, start=True)
            assert probe.ok, probe
            if probe.server_pid == replica.pid:
                break
            assert time.monotonic() - began < FAIL_TIMEOUT_S + 5, "the restarted replica never got its keys back"
            time.sleep(0.1)
        returned_after_s = time.monotonic() - began
        for number, key in enumerate(victim_keys):
            fresh = client.send(key, 50_000 + number, start=True)
            assert fresh.ok and fresh.server_pid == replica.pid, (key, fresh)
        # The streams that moved during the outage follow their key back and are unknown there.
        for key, resumed in moved.items():
            again = client.send(key, resumed.sequence_id)
            assert not again.ok and NOT_STARTED in again.error, (key, again)
        # The other replicas' streams never noticed.
        for key, (sequence_id, index) in others.items():
            reply = client.send(key, sequence_id)
            assert reply.ok and reply.count == 2 and reply.server_pid == replica_set.replicas[index].pid, (key, reply)
        client.close()
        summary = (f"restart: ready in {ready_s:.2f} s on the same ports; its keys back after "
                   f"{returned_after_s:.2f} s ({attempts} probes, fail_timeout {FAIL_TIMEOUT_S} s)")
        print_and_record(record_property, "restart", summary)


# ---- the command ---------------------------------------------------------------------------------

def test_serve_replicas_command_stops_cleanly_on_sigterm(nginx_install, short_idle_counter_repository, tmp_path):
    """`code2wav-server serve-replicas` in the foreground: ready, routes a stream, and SIGTERM stops
    nginx and every replica once, exit 0, leaving no process, port or shared memory. (The stream is
    still open at the SIGTERM: its replica waits for it to idle out, 2 s here, not the exit timeout.)"""
    grpc_port, http_port = free_ports(2)
    cli = subprocess.Popen(
        [sys.executable, "-m", "mimi_code2wav.server", "serve-replicas", "--replicas", "2",
         "--model-repository", str(short_idle_counter_repository), "--grpc-port", str(grpc_port),
         "--http-port", str(http_port), "--replica-base-port", "0", "--run-dir", str(tmp_path / "run")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    children: list[int] = []
    printed: list[str] = []
    try:
        # To the end of the command's ready message: the proxy answers as soon as one replica is,
        # while the command still waits for the others (a SIGTERM then stops a start, not a running
        # set). Nothing is printed after it until the stop, so no line is left in the pipe's buffer.
        for line in cli.stdout:
            printed.append(line)
            if "SIGTERM stops everything" in line:
                break
        assert cli.poll() is None, f"serve-replicas exited with {cli.returncode}:\n{''.join(printed)}"
        client = CounterClient(f"127.0.0.1:{grpc_port}")
        assert [client.send("stream-a", 1, start=index == 0).count for index in range(2)] == [1, 2]
        client.close()
        children = [int(pid) for pid in subprocess.check_output(["pgrep", "-P", str(cli.pid)], text=True).split()]
        commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children}
        servers = [pid for pid, command in commands.items() if b"tritonserver" in command]
        masters = [pid for pid, command in commands.items() if b"nginx" in command]
        assert len(servers) == 2 and len(masters) == 1, commands
        prefixes = [shm_prefix_of(pid) for pid in servers]
        assert all(list(SHM_DIR.glob(f"{prefix}*")) for prefix in prefixes)
        cli.send_signal(signal.SIGTERM)
        output, _ = cli.communicate(timeout=90)
        output = "".join(printed) + output
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        for pid in children:  # never leave an orphan behind a failed test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    assert cli.returncode == 0, output
    assert "Traceback" not in output, output
    assert re.search(r"ready in [0-9.]+ s: nginx [0-9.]+ \(pid \d+\) in front of 2 replicas", output), output
    assert f"gRPC     127.0.0.1:{grpc_port}" in output and f"HTTP     http://127.0.0.1:{http_port}" in output
    table = re.findall(r"^  (\d)\s+127\.0\.0\.1:(\d+)\s+127\.0\.0\.1:(\d+)\s+http://127\.0\.0\.1:(\d+)/metrics\s+(\d+)\s", output, re.M)
    assert [row[0] for row in table] == ["0", "1"] and sorted(int(row[4]) for row in table) == sorted(servers), output
    assert "SIGTERM: stopping nginx and the replicas" in output and re.search(r"stopped in [0-9.]+ s", output)
    for pid in children:
        assert not process_exists(pid) and not process_group_alive(pid), f"{pid} ({commands[pid][:60]}) outlived the command"
    ports = [grpc_port, http_port, *(int(port) for row in table for port in row[1:4])]
    assert all(port_is_free(port) for port in ports)
    assert not any(list(SHM_DIR.glob(f"{prefix}*")) for prefix in prefixes)


# ---- the real code2wav repository --------------------------------------------------------------------

def _decode(client, codes: np.ndarray, sequence_id: int, key: str | None) -> np.ndarray:
    """A whole stream, 2 frames per request, carrying its stream key when given."""
    headers = {STREAM_KEY_HEADER: key} if key else None
    return np.concatenate(send_in_chunks(client, sequence_id, codes, 0, codes.shape[1], chunk_frames=2, start=True,
                                         headers=headers))


def test_code2wav_streams_through_the_proxy(nginx_install, served_repository, tmp_path):
    """Two replicas of the real code2wav + python-ort decoder behind the proxy: interleaved streams
    decode exactly as the same streams sent straight to one replica; when a stream's replica dies its
    next request is refused by the replica it moves to, and a new START there decodes it again."""
    from mimi_fixtures import assert_equal_audio

    rng = np.random.default_rng(7)
    streams = {f"conversation-{number}": rng.integers(0, CODEBOOK_SIZE, (NUM_CODEBOOKS, 6), dtype=np.int64)
               for number in range(4)}
    with running_replicas(served_repository, tmp_path / "run", replicas=2) as replica_set:
        with grpcclient.InferenceServerClient(replica_set.proxy_grpc_url) as proxy:
            pcm = {key: [] for key in streams}
            sequence_ids = {key: 900 + number for number, key in enumerate(streams)}
            for first in range(0, 6, 2):  # interleaved: request n of every stream, then n + 1
                for key, codes in streams.items():
                    result = proxy.infer("code2wav", code2wav_inputs(codes[:, first:first + 2], first),
                                         sequence_id=sequence_ids[key], sequence_start=first == 0,
                                         headers={STREAM_KEY_HEADER: key})
                    pcm[key].append(pcm_of(result, 2))
            log = inference_log(replica_set, 12)
            served_by = {key: {line["served_by"] for line in log if line["key"] == key} for key in streams}
            assert all(len(replicas) == 1 for replicas in served_by.values()), served_by
            with grpcclient.InferenceServerClient(replica_set.replicas[0].grpc_url) as direct:
                references = {key: _decode(direct, codes, 1900 + number, key=None)
                              for number, (key, codes) in enumerate(streams.items())}
            for key in streams:
                assert_equal_audio(np.concatenate(pcm[key]), references[key], what=key)

            # The replica of the first stream dies; the other replica refuses the stream, then decodes
            # it from a new START.
            key, codes = next(iter(streams.items()))
            victim = next(replica for replica in replica_set.replicas if replica.grpc_url in served_by[key])
            replica_set.kill(victim.index)
            with pytest.raises(InferenceServerException, match=NOT_STARTED):
                proxy.infer("code2wav", code2wav_inputs(codes[:, :1], 6), sequence_id=sequence_ids[key],
                            headers={STREAM_KEY_HEADER: key})
            assert_equal_audio(_decode(proxy, codes, 2900, key), references[key], what=f"{key} started again")


def test_asyncio_conversations_keep_their_replica_and_survive_its_loss(nginx_install, served_repository, ort_decode,
                                                                      tmp_path):
    """Four conversations on one asyncio client (one channel to the proxy), two on each replica of the
    real code2wav: each replica's own metrics count exactly its conversations' frames (affinity, no
    replay); then one replica is killed between calls: its conversations resume on the other with
    their whole history, the others never resume, and every conversation's PCM equals its solo
    decode, every frame once."""
    import asyncio

    from mimi_code2wav.client.aio import Code2WavClient
    from mimi_code2wav.client.protocol import StreamOptions

    from mimi_fixtures import assert_equal_audio

    rng = np.random.default_rng(11)
    frames, halfway = 40, 21

    def frames_decoded(replica) -> float:
        return metric_value(fetch_metrics(replica.metrics_url), "code2wav_frames_decoded_total") or 0.0

    with running_replicas(served_repository, tmp_path / "run", replicas=2) as replica_set:
        by_url = {replica.grpc_url: replica.index for replica in replica_set.replicas}

        async def run():
            async with Code2WavClient(replica_set.proxy_grpc_url, StreamOptions(response_timeout_s=60.0)) as client:
                # Open conversations until each replica holds two; the first frame places each.
                chosen: dict[int, list] = {0: [], 1: []}
                closed = [0, 0]
                for number in range(24):
                    codes = rng.integers(0, CODEBOOK_SIZE, (NUM_CODEBOOKS, frames), dtype=np.int64)
                    stream = client.stream(stream_key=f"aio-proxy-{number}")
                    first = await stream.decode(codes[:, :1])
                    placed = replicas_of_stream(replica_set, stream.stream_key)
                    (replica,) = {by_url[url] for url in placed}
                    if len(chosen[replica]) < 2:
                        chosen[replica].append((stream, codes, [first]))
                    else:
                        await stream.close()
                        closed[replica] += 1
                    if all(len(held) == 2 for held in chosen.values()):
                        break
                conversations = chosen[0] + chosen[1]
                assert len(conversations) == 4, f"24 stream keys did not give each replica two: {chosen}"

                async def calls(stream, codes, pcm, stop):
                    for first in range(len(pcm) if len(pcm) == 1 else halfway, stop, 5):
                        pcm.append(await stream.decode(codes[:, first : min(first + 5, stop)], end=min(first + 5, stop) == frames))

                await asyncio.gather(*(calls(stream, codes, pcm, halfway) for stream, codes, pcm in conversations))
                decoded = [frames_decoded(replica) for replica in replica_set.replicas]
                replica_set.kill(0)
                await asyncio.gather(*(calls(stream, codes, pcm, frames) for stream, codes, pcm in conversations))
                return conversations, decoded, closed

        conversations, decoded, closed = asyncio.run(run())
        after = frames_decoded(replica_set.replicas[1])
    # Every replica decoded exactly the frames of its own conversations (and the first frame of those
    # closed at once), nothing twice.
    assert decoded == [2 * halfway + closed[0], 2 * halfway + closed[1]], (decoded, closed)
    for index, (stream, codes, pcm) in enumerate(conversations):
        moved = index < 2  # the first two were on replica 0
        assert len(stream.resumes) == (1 if moved else 0), (index, stream.resumes)
        if moved:
            assert stream.resumes[0].frame == halfway and stream.resumes[0].history_frames == halfway
        assert stream.ended
        assert_equal_audio(np.concatenate(pcm), ort_decode(codes), what=f"conversation {index}")
    # Replica 1 decoded its own conversations' remaining frames and the moved ones' history and rest.
    assert after - decoded[1] == 2 * (frames - halfway) + 2 * frames


# ---- Kubernetes (structure only: no cluster here) ----------------------------------------------------

def kubernetes_objects() -> dict[tuple[str, str], dict]:
    objects = {}
    for path in sorted(KUBERNETES_DIR.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                objects[(document["kind"], document["metadata"]["name"])] = document
    return objects


def test_kubernetes_manifests_hash_streams_over_the_ready_pods():
    objects = kubernetes_objects()
    deployment = objects[("Deployment", "code2wav-triton")]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (triton,) = pod["spec"]["containers"]
    (export,) = pod["spec"]["initContainers"]
    assert triton["image"] == "nvcr.io/nvidia/tritonserver:26.11-py3"  # compose's default (tests/test_compose.py)
    assert export["args"] == ["export"] and export["image"].endswith("/mimi-code2wav-export:0.1.0")
    # The init container renders the repository into the volume Triton serves read-only.
    models = {mount["mountPath"]: mount for mount in triton["volumeMounts"]}["/models"]
    assert models["readOnly"] and {"name": models["name"], "mountPath": "/models"} in export["volumeMounts"]
    assert "--model-repository=/models" in triton["args"]
    # `$$` is Kubernetes' escape for a literal `$` in command and args.
    assert "$$(cat /models/tritonserver.args)" in triton["command"][3]
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


def test_serve_replicas_takes_out_a_hung_replica_restarts_it_and_rolls_on_sighup(
        nginx_install, short_idle_counter_repository, tmp_path):
    """`serve-replicas --restart`: a replica that stops answering (SIGSTOP) is taken out of the proxy
    after its unanswered health checks, so new streams of its keys go to the other replica, then killed
    and started again and put back; SIGHUP drains and restarts each replica in turn (exit 0 each),
    the command serving throughout."""
    grpc_port, http_port = free_ports(2)
    cli = subprocess.Popen(
        [sys.executable, "-m", "mimi_code2wav.server", "serve-replicas", "--replicas", "2", "--restart",
         "--health-timeout-s", "0.5", "--health-checks", "2", "--fail-timeout-s", str(FAIL_TIMEOUT_S),
         "--model-repository", str(short_idle_counter_repository), "--grpc-port", str(grpc_port),
         "--http-port", str(http_port), "--replica-base-port", "0", "--run-dir", str(tmp_path / "run")],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(cli.stdout), daemon=True)
    reader.start()

    def wait_for(pattern: str, timeout_s: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(lines):
                if match := re.search(pattern, line):
                    return match
            assert cli.poll() is None, f"serve-replicas exited with {cli.returncode}:\n{''.join(lines)}"
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in {timeout_s:g} s:\n{''.join(lines)}")

    client = CounterClient(f"127.0.0.1:{grpc_port}")
    try:
        wait_for("SIGTERM stops everything")
        pids = [int(pid) for pid in re.findall(r"^  \d\s+127\.0\.0\.1:\d+\s+\S+\s+\S+\s+(\d+)\s", "".join(lines), re.M)]
        assert len(pids) == 2, "".join(lines)
        # A key of each replica.
        key_of: dict[int, str] = {}
        for number in range(200):
            reply = client.send(f"key-{number}", number + 1, start=True)
            assert reply.ok, reply
            key_of.setdefault(reply.server_pid, f"key-{number}")
            if len(key_of) == 2:
                break
        hung_key = key_of[pids[0]]
        os.kill(pids[0], signal.SIGSTOP)
        wait_for(rf"replica 0 \(pid {pids[0]}\) has not answered its health check .*: taken out of the proxy")
        # While it is out (restarting), its keys reach the other replica: at once, but for a request
        # that an nginx worker of the old configuration still took (its connection not yet moved to the
        # new workers), which the hung replica leaves with the proxy's retryable error.
        deadline = time.monotonic() + 5
        while not (reply := client.send(hung_key, 1001, start=True)).ok:
            assert "could not be reached (502); retry" in reply.error and time.monotonic() < deadline, reply
            time.sleep(0.2)
        assert reply.server_pid == pids[1], reply
        restarted = int(wait_for(r"replica 0 restarted \(pid (\d+), restart 1\)")[1])
        wait_for("replica 0: back in the proxy")
        # Its keys come back within moments (the old workers finish the connections they hold).
        deadline = time.monotonic() + 10
        while (reply := client.send(hung_key, 1002, start=True)).server_pid != restarted:
            assert reply.ok and time.monotonic() < deadline, reply
            time.sleep(0.2)

        cli.send_signal(signal.SIGHUP)
        for index in range(2):
            wait_for(rf"replica {index} \(pid \d+\) drained \(exited with code 0\) and restarted in [0-9.]+ s",
                     timeout_s=90)
            # The other replica serves every key meanwhile, or both do once it is back.
            reply = client.send(hung_key, 2000 + index, start=True)
            assert reply.ok, reply
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(90) == 0, "".join(lines)
    finally:
        client.close()
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[0], signal.SIGCONT)
        reader.join(5)
    output = "".join(lines)
    assert "Traceback" not in output, output
    assert "SIGHUP: rolling restart of the replicas, one at a time" in output
