"""gRPC client -> code2wav (BLS) -> mimi_decoder on a real tritonserver, both targets: a stream's PCM equals moshi's
decode (docs/design.md §2.3) and, alone or batched, the ONNX step's. Each test ends the streams it opens."""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import re
import signal
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, MODEL_NAME, NUM_CODEBOOKS, SAMPLES_PER_FRAME, random_codes
from mimi_code2wav.export.reference import moshi_stream_decode
from mimi_code2wav.export.render import DECODER_IDLE_MARGIN_US, DecoderServing, render_repository, set_idle_timeout
from mimi_code2wav.server.processes import process_group_alive
from mimi_code2wav.server.triton import DEFAULT_EXIT_TIMEOUT_S, SHM_DIR, fetch_metrics, metric_value

from helpers import (
    code2wav_inputs,
    copy_repository,
    decoder_holds,
    decoder_step_inputs,
    export_spec,
    infer,
    infer_error,
    metric,
    pcm_of,
    raw_input,
    sequence_ids,
    serve_cli,
    stop_cli,
    stub_pid,
    wait_until,
)
from mimi_fixtures import assert_equal_audio, fixtures_on_each_target, require_target

pytestmark = [pytest.mark.server, pytest.mark.slow]

decoder_target, served_repository, code2wav_server = fixtures_on_each_target()

BATCHED_MAX_ABS = 1e-5  # a stream batched with others vs its solo run (docs/design.md §2.3)
START_HINT = "START flag"  # in Triton's and the core's answers for a sequence they do not hold
SHORT_CODE2WAV_IDLE_S = 4.0  # short to wait out, long beside a loaded machine's request
SHORT_DECODER_IDLE_S = SHORT_CODE2WAV_IDLE_S + DECODER_IDLE_MARGIN_US / 1e6
MEMORY_IDLE_S = 15.0  # far above a loaded machine's step of the memory test's 32 batched streams
PATIENCE_S = 120.0  # for what the server does by itself (an expiry, a count settling)

new_sequence_id = sequence_ids(7_000_001)


def chunk_bounds(rng: np.random.Generator, total_frames: int, max_chunk: int = 8) -> list[tuple[int, int]]:
    """Random chunking of [0, total) into (start, stop) pairs, the first one frame long."""
    edges = [0, 1]
    while edges[-1] < total_frames:
        edges.append(min(edges[-1] + int(rng.integers(1, max_chunk + 1)), total_frames))
    return list(itertools.pairwise(edges))


class StreamingClient:
    """One bidirectional gRPC stream for any sequences' valid requests (an error carries no request id to route)."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self._responses: queue.Queue = queue.Queue()
        self._request_ids = itertools.count(1)
        self.client.start_stream(callback=lambda result, error: self._responses.put((result, error)))

    def send(self, sequence_id: int, codes, frame_offset=None, start=False, end=False) -> str:
        request_id = str(next(self._request_ids))
        self.client.async_stream_infer(MODEL_NAME, code2wav_inputs(codes, frame_offset), request_id=request_id,
                                       sequence_id=sequence_id, sequence_start=start, sequence_end=end)
        return request_id

    def collect(self, count: int, timeout_s: float = PATIENCE_S) -> dict[str, object]:
        results, deadline = {}, time.monotonic() + timeout_s
        while len(results) < count:
            result, error = self._responses.get(timeout=max(deadline - time.monotonic(), 0.001))
            assert error is None, f"streamed request failed: {error}"
            results[result.get_response().id] = result
        return results

    def close(self, cancel_requests: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel_requests)
        self.client.close()


@dataclass(frozen=True)
class ServingMetrics:
    code2wav_live: float
    code2wav_frames: float
    code2wav_pending: float  # requests Triton holds for code2wav, not yet handed to an instance
    decoder_live: float | None  # the python-ort decoder's gauge; None for the native decoder
    decoder_runs: float  # the decoder's executions (Triton's count, any target)
    decoder_rows: float  # the decoder's requests (steps) in them
    decoder_expired: float | None  # the python-ort decoder's count
    errors: dict[str, float]

    @classmethod
    def read(cls, metrics_url: str) -> ServingMetrics:
        samples = fetch_metrics(metrics_url)

        def value(name, **labels):
            return metric_value(samples, name, **labels) or 0.0

        errors = {match.group(1): count for key, count in samples.items()
                  if (match := re.fullmatch(r'code2wav_errors_total\{.*\bkind="([a-z_]+)".*\}', key))}
        return cls(code2wav_live=value("code2wav_live_streams"), code2wav_frames=value("code2wav_frames_decoded_total"),
                   code2wav_pending=value("nv_inference_pending_request_count", model=MODEL_NAME),
                   decoder_live=metric_value(samples, "mimi_decoder_live_streams"),
                   decoder_runs=value("nv_inference_exec_count", model="mimi_decoder"),
                   decoder_rows=value("nv_inference_request_success", model="mimi_decoder")
                   + value("nv_inference_request_failure", model="mimi_decoder"),
                   decoder_expired=metric_value(samples, "mimi_decoder_expired_streams_total"), errors=errors)

    def live(self, more: int = 0) -> tuple[float, float | None]:
        """(code2wav's live streams, the python-ort decoder's or None) plus `more` each."""
        return self.code2wav_live + more, None if self.decoder_live is None else self.decoder_live + more


def wait_for_metrics(metrics_url: str, condition, timeout_s: float = PATIENCE_S) -> ServingMetrics:
    """Poll the metrics until `condition(ServingMetrics)` holds; fails with the last values read."""
    deadline = time.monotonic() + timeout_s
    while not condition(metrics := ServingMetrics.read(metrics_url)):
        assert time.monotonic() < deadline, f"metrics did not reach the expected state in {timeout_s} s: {metrics}"
        time.sleep(0.1)
    return metrics


def settled_metrics(metrics_url: str, min_decoder_rows: float) -> ServingMetrics:
    """The metrics once the decoder's step count is >= `min_decoder_rows` and still (counted after the answer)."""
    previous = [ServingMetrics.read(metrics_url)]

    def settled(metrics):
        rows = previous[-1].decoder_rows
        previous.append(metrics)
        return metrics.decoder_rows == rows >= min_decoder_rows

    return wait_for_metrics(metrics_url, settled)


def assert_matches(pcm, moshi_reference, ort_reference, what: str) -> tuple[float, float]:
    """Equal to moshi's decode, within BATCHED_MAX_ABS of the ONNX step; returns (SNR to moshi, ONNX step max abs)."""
    _, snr = assert_equal_audio(pcm, moshi_reference, what=f"{what} vs moshi")
    error, _ = assert_equal_audio(pcm, ort_reference, max_abs=BATCHED_MAX_ABS, what=f"{what} vs ONNX step")
    return snr, error


@pytest.fixture(scope="module")
def check(scenario, moshi_streams, ort_decode):
    """`check(pcm, name, what)`: assert_matches for the first frames of scenario stream `name`."""
    ort_streams = {name: ort_decode(codes) for name, codes in scenario.streams.items()}
    return lambda pcm, name, what: assert_matches(pcm, moshi_streams[name][: pcm.size], ort_streams[name][: pcm.size],
                                                  what)


# ---- 1. one stream, every way of sending it ------------------------------------------------------

@pytest.mark.parametrize("transport, mode, name, seed, max_chunk", [
    pytest.param("unary", "delta", "A", 11, 8, id="unary-delta-A"),
    pytest.param("unary", "cumulative", "B", 12, 8, id="unary-cumulative-B"),
    pytest.param("unary", "offsets", "C1", 13, 8, id="unary-offsets-C1"),
    pytest.param("unary", "offsets", "C2", 17, 1, id="unary-one-frame-per-request-C2"),  # the live pattern
    pytest.param("streaming", "delta", "C2", 14, 8, id="streaming-delta-C2"),
    pytest.param("streaming", "cumulative", "C1", 15, 8, id="streaming-cumulative-C1"),
])
def test_one_stream_equals_moshi_and_the_onnx_step(decoder_target, code2wav_server, grpc_client, scenario, check,
                                                   transport, mode, name, seed, max_chunk):
    codes = scenario.streams[name]
    bounds = chunk_bounds(np.random.default_rng(seed), codes.shape[1], max_chunk)
    requests = [  # (codes, frame_offset, start, end, new frames)
        (codes[:, 0 if mode == "cumulative" else first : stop], {"delta": None, "cumulative": 0, "offsets": first}[mode],
         index == 0, index == len(bounds) - 1, stop - first)
        for index, (first, stop) in enumerate(bounds)
    ]
    sequence_id = new_sequence_id()
    if transport == "unary":
        chunks = [infer(grpc_client, sequence_id, *request) for request in requests]
    else:
        with contextlib.closing(StreamingClient(code2wav_server.grpc_url)) as stream:
            request_ids = [stream.send(sequence_id, *request[:4]) for request in requests]
            results = stream.collect(len(request_ids))
        chunks = [pcm_of(results[rid], request[4]) for rid, request in zip(request_ids, requests)]
    pcm = np.concatenate(chunks)
    snr, _ = check(pcm, name, f"{transport} {mode} {name}")
    print(f"\n{decoder_target} decoder, {transport} {mode} stream {name} in {len(requests)} requests: SNR vs moshi {snr:.1f} dB")


# ---- 2. dedupe -----------------------------------------------------------------------------------

SILENCE = 40  # any frame of stream A; repeated, it plays the part of a silence frame


def deltas(*edges: int) -> list[tuple[int, int, int]]:
    return [(first, stop, stop - first) for first, stop in itertools.pairwise(edges)]


@pytest.mark.parametrize("columns, requests, with_offsets", [
    # Offset deltas with chunk edges inside runs of identical frames.
    pytest.param([SILENCE] * 3 + [0, 1, 1, 1, 2] + [SILENCE] * 4 + [3, 3, 4, SILENCE, SILENCE, 5],
                 deltas(0, 1, 2, 3, 5, 6, 7, 8, 9, 12, 13, 16, 17, 18), True, id="repeated-frames-as-offset-deltas"),
    # dedupe_mode=delta (shipped): silence deltas without offsets, as vLLM-Omni sends (docs/design.md §2.1).
    pytest.param([SILENCE] * 19, deltas(0, 1, 6, 11, 16, 19), False, id="silence-deltas-without-offsets"),
    # (first, stop, new frames): retries, overlaps, requests inside the decoded frames.
    pytest.param(list(range(12)), [(0, 4, 4), (0, 4, 0), (2, 4, 0), (2, 7, 3), (1, 3, 0), (7, 10, 3), (9, 10, 0), (8, 12, 2)],
                 True, id="retries-and-overlaps"),
])
def test_each_frame_is_decoded_once(grpc_client, scenario, moshi_checkpoint, ort_decode, columns, requests,
                                    with_offsets):
    codes, sequence_id = np.ascontiguousarray(scenario.streams["A"][:, columns]), new_sequence_id()
    pcm = np.concatenate([infer(grpc_client, sequence_id, codes[:, first:stop], first if with_offsets else None,
                                start=index == 0, end=index == len(requests) - 1, new_frames=new_frames)
                          for index, (first, stop, new_frames) in enumerate(requests)])
    assert_matches(pcm, moshi_stream_decode(moshi_checkpoint[1], codes[None])[0], ort_decode(codes), "dedupe")


# ---- 3. many streams at once ---------------------------------------------------------------------

@dataclass
class StreamPlan:
    """`codes` [k, T] sent with offsets in `bounds` chunks, one per round from `join_round` on, answers in `chunks`."""

    sequence_id: int
    codes: np.ndarray
    bounds: list
    join_round: int = 0
    chunks: list = field(default_factory=list)


def send_async(client, sequence_id: int, codes, frame_offset, **flags) -> tuple[object, list, threading.Event]:
    """One request sent without waiting: (its call, the list its (result, error) lands in, an event set then)."""
    outcome, done = [], threading.Event()
    call = client.async_infer(MODEL_NAME, code2wav_inputs(codes, frame_offset), sequence_id=sequence_id,
                              callback=lambda result, error: (outcome.append((result, error)), done.set()), **flags)
    return call, outcome, done


def run_interleaved(grpc_url: str, plans: list[StreamPlan]) -> None:
    """Send the plans over one gRPC stream, a chunk of each per round, each round's answers awaited."""
    with contextlib.closing(StreamingClient(grpc_url)) as client:
        for round_index in range(max(plan.join_round + len(plan.bounds) for plan in plans)):
            sent = {}
            for plan in plans:
                step = round_index - plan.join_round
                if 0 <= step < len(plan.bounds):
                    first, stop = plan.bounds[step]
                    request_id = client.send(plan.sequence_id, plan.codes[:, first:stop], first,
                                             start=step == 0, end=step == len(plan.bounds) - 1)
                    sent[request_id] = (plan, stop - first)
            results = client.collect(len(sent))
            for request_id, (plan, new_frames) in sent.items():
                plan.chunks.append(pcm_of(results[request_id], new_frames))


def test_sixteen_interleaved_streams_are_batched_and_each_equals_its_solo_run(code2wav_server, scenario, check):
    names, rng = ["A", "B", "C1", "C2"], np.random.default_rng(21)
    # 24..39 frames each; streams join one round apart, so every batch mixes rows of different ages.
    plans = [StreamPlan(new_sequence_id(), scenario.streams[names[index % 4]][:, :24 + index],
                        chunk_bounds(rng, 24 + index, max_chunk=3), join_round=index) for index in range(16)]
    total_frames, total_requests = sum(p.codes.shape[1] for p in plans), sum(len(p.bounds) for p in plans)
    before = settled_metrics(code2wav_server.metrics_url, 0)
    run_interleaved(code2wav_server.grpc_url, plans)
    after = settled_metrics(code2wav_server.metrics_url, before.decoder_rows + total_requests)
    worst = max(check(np.concatenate(plan.chunks), names[index % 4], f"stream {plan.sequence_id}")[1]
                for index, plan in enumerate(plans))
    runs, rows = after.decoder_runs - before.decoder_runs, after.decoder_rows - before.decoder_rows
    # Each frame decoded once, each request in one decoder call (slack 2: server-wide counts see other sequences).
    assert after.code2wav_frames - before.code2wav_frames == total_frames
    assert total_requests <= rows <= total_requests + 2, f"{rows} decoder rows for {total_requests} requests"
    assert runs < rows, f"{runs} decoder executions for {rows} rows: none batched two streams"
    assert after.live() == before.live()
    assert not any(decoder_holds(code2wav_server.grpc_url, plan.sequence_id) for plan in plans)
    print(f"\n16 streams: {runs:.0f} decoder runs of {rows / runs:.1f} rows; worst |diff| to solo ONNX {worst:.2g}")


def test_a_long_request_holds_up_no_other_stream(grpc_client, ort_decode):
    """A 400-frame request (more than a resume replays) beside a stream of one-frame requests: these are answered
    while the long one decodes (an instance takes new batches meanwhile, docs/design.md §5); both equal their solo run."""
    rng = np.random.default_rng(41)
    long_codes, live_codes = (rng.integers(0, CODEBOOK_SIZE, (NUM_CODEBOOKS, frames)) for frames in (400, 200))
    live_id, live, answered_during = new_sequence_id(), [], 0
    live.append(infer(grpc_client, live_id, live_codes[:, :1], 0, start=True, new_frames=1))
    _, outcome, done = send_async(grpc_client, new_sequence_id(), long_codes, 0, sequence_start=True, sequence_end=True)
    for frame in range(1, live_codes.shape[1]):
        live.append(infer(grpc_client, live_id, live_codes[:, frame:frame + 1], frame, new_frames=1))
        answered_during += not done.is_set()
        if done.is_set() and frame >= 20:
            break
    infer(grpc_client, live_id, live_codes[:, :0], frame + 1, end=True, new_frames=0)
    assert done.wait(PATIENCE_S)
    (result, error), = outcome
    assert error is None, error
    assert_equal_audio(pcm_of(result, 400), ort_decode(long_codes), max_abs=BATCHED_MAX_ABS, what="the long request")
    live = np.concatenate(live)
    assert_equal_audio(live, ort_decode(live_codes)[: live.size], max_abs=BATCHED_MAX_ABS, what="the 1-frame stream")
    # 25 decoder steps of 16 frames: the 1-frame stream gets its turn between them.
    assert answered_during >= 5, f"only {answered_during} 1-frame requests answered while the long one decoded"


# ---- 4. stream lifecycle -------------------------------------------------------------------------

def test_start_and_end_in_one_request_requests_without_start_and_a_start_on_a_live_stream(
        code2wav_server, grpc_client, scenario, check):
    url, a, b = code2wav_server.metrics_url, scenario.streams["A"], scenario.streams["B"]
    ended, empty, never, barged = (new_sequence_id() for _ in range(4))
    check(infer(grpc_client, ended, a[:, :10], start=True, end=True, new_frames=10), "A", "START|END")
    # START|END with no frame at all decodes nothing and leaves nothing open.
    infer(grpc_client, empty, a[:, :0], start=True, end=True, new_frames=0)
    # A stream that ended, or never started, is refused saying to START, with or without an offset.
    for sequence_id in (ended, empty, never):
        assert str(sequence_id) in infer_error(grpc_client, sequence_id, a[:, 10:11], START_HINT)
        infer_error(grpc_client, sequence_id, code2wav_inputs(a[:, 10:11], 10), START_HINT)
    infer_error(grpc_client, 0, a[:, :1], "non-zero", start=True)
    before = ServingMetrics.read(url)
    infer(grpc_client, barged, a[:, :1], 0, start=True, new_frames=1)
    infer(grpc_client, barged, a[:, 1:7], 1, new_frames=6)
    # Barge-in: START on the live stream starts stream B over it; offsets count from 0 again.
    chunks = [infer(grpc_client, barged, b[:, :2], 0, start=True, new_frames=2)]
    assert ServingMetrics.read(url).live() == before.live(1)
    chunks.append(infer(grpc_client, barged, b[:, 1:5], 1, new_frames=3))
    chunks.append(infer(grpc_client, barged, b[:, 5:12], 5, end=True, new_frames=7))
    check(np.concatenate(chunks), "B", "after the barge-in")
    assert ServingMetrics.read(url).live() == before.live()
    assert not decoder_holds(code2wav_server.grpc_url, barged)
    assert grpc_client.is_server_ready() and grpc_client.is_model_ready(MODEL_NAME)


@pytest.mark.parametrize("send_end", [
    pytest.param(lambda client, sequence_id, a: infer(client, sequence_id, a[:, :0], end=True, new_frames=0),
                 id="without-frames"),
    # Triton releases a sequence on its END request whatever the answer: a rejected END must not leave state behind.
    pytest.param(lambda client, sequence_id, a: infer_error(
        client, sequence_id, code2wav_inputs(a[:, 5:6], 5), "gap", "the request carried END, so the stream has ended",
        end=True, kind="gap"), id="rejected"),
])
def test_an_end_ends_the_stream_and_its_decoder_sequence(code2wav_server, grpc_client, scenario, check, send_end):
    url, a, sequence_id = code2wav_server.metrics_url, scenario.streams["A"], new_sequence_id()
    before = settled_metrics(url, 0)
    first = infer(grpc_client, sequence_id, a[:, :3], 0, start=True, new_frames=3)
    opened = settled_metrics(url, before.decoder_rows + 1)
    assert opened.live() == before.live(1)
    send_end(grpc_client, sequence_id, a)
    closed = settled_metrics(url, opened.decoder_rows + 1)
    assert closed.live() == before.live()
    # The decoder got END on one step whose output was discarded, and holds the sequence no more.
    assert closed.decoder_rows - opened.decoder_rows == 1
    assert closed.code2wav_frames == opened.code2wav_frames
    assert not decoder_holds(code2wav_server.grpc_url, sequence_id)
    infer_error(grpc_client, sequence_id, code2wav_inputs(a[:, 3:4], 3), START_HINT)
    # START again: a fresh stream from frame 0.
    again = infer(grpc_client, sequence_id, a[:, :6], 0, start=True, end=True, new_frames=6)
    check(first, "A", "before END")
    check(again, "A", "after a new START")


def _with_code(codes: np.ndarray, codebook: int, frame: int, value: int) -> np.ndarray:
    codes = np.array(codes, dtype=np.int64)
    codes[codebook, frame] = value
    return codes


# Sent after frames [0, 3) of stream A: (inputs from A's codes, error substrings, code2wav's error kind or None when
# Triton rejects the request before the model).
BAD_REQUESTS = [
    pytest.param(lambda a: [raw_input("input_ids", np.arange(19, dtype=np.int64)[None], "INT64")], ["holds 19 codes", "not a multiple of num_codebooks=8"], "length", id="length"),
    pytest.param(lambda a: code2wav_inputs(_with_code(a[:, 3:5], 2, 1, CODEBOOK_SIZE), 3), ["input_ids[5] = 2048", "codebook 2, frame 1", "outside [0, 2048)"], "code_range", id="code-too-large"),
    pytest.param(lambda a: code2wav_inputs(a[:, 3:4], -1), ["frame_offset must be >= 0, got -1"], "negative_offset", id="negative-offset"),
    pytest.param(lambda a: code2wav_inputs(a[:, 5:6], 5), ["frame_offset 5 leaves a gap", "has decoded 3 frames", "at most 3"], "gap", id="gap"),
    pytest.param(lambda a: code2wav_inputs(_with_code(a[:, 1:5], 4, 1, (int(a[4, 2]) + 1) % CODEBOOK_SIZE), 1), ["frame 2 differs", "cannot change"], "changed_frame", id="changed-frame"),
    pytest.param(lambda a: [raw_input("input_ids", a[:, 3:4].astype(np.float32).reshape(1, -1), "FP32")], ["input_ids", "data-type is 'FP32'", "expects 'INT64'"], None, id="float-input-ids"),
    pytest.param(lambda a: code2wav_inputs(a[:, 3:4])[:1] + [raw_input("frame_offset", np.array([[3]], np.int32), "INT32")], ["frame_offset", "data-type is 'INT32'", "expects 'INT64'"], None, id="int32-frame-offset"),
    pytest.param(lambda a: code2wav_inputs(a[:, 3:4])[:1] + [raw_input("frame_offset", np.array([[3, 4]]), "INT64")], ["unexpected shape for input 'frame_offset'"], None, id="frame-offset-shape"),
    pytest.param(lambda a: [raw_input("input_ids", np.ascontiguousarray(a[:, 3:5], np.int64).reshape(2, -1), "INT64")], ["batch-size 1"], None, id="two-rows"),
    pytest.param(lambda a: [raw_input("frame_offset", np.array([[3]]), "INT64")], ["no input_ids"], "shape", id="no-input-ids"),
    pytest.param(lambda a: code2wav_inputs(a[:, 3:4]) + [raw_input("bogus", np.array([[3]], np.int64), "INT64")], ["unexpected inference input 'bogus'"], None, id="unknown-input"),
    pytest.param(lambda a: code2wav_inputs(random_codes(1501, seed=1501), 3), ["1501 new frames", "max_new_frames_per_request=1500"], "limit", id="too-many-new-frames"),
]


@pytest.mark.parametrize("build, expected, kind", BAD_REQUESTS)
def test_bad_request_names_the_problem_and_leaves_streams_as_they_were(code2wav_server, grpc_client, scenario, check,
                                                                      build, expected, kind):
    url, a, b = code2wav_server.metrics_url, scenario.streams["A"], scenario.streams["B"]
    victim, bystander = new_sequence_id(), new_sequence_id()
    base = ServingMetrics.read(url)
    victim_pcm = [infer(grpc_client, victim, a[:, :3], 0, start=True, new_frames=3)]
    bystander_pcm = [infer(grpc_client, bystander, b[:, :2], 0, start=True, new_frames=2)]
    before = settled_metrics(url, base.decoder_rows + 2)  # the two first steps counted
    infer_error(grpc_client, victim, build(a), *expected, kind=kind)
    assert grpc_client.is_server_ready() and grpc_client.is_model_ready(MODEL_NAME)
    after = settled_metrics(url, before.decoder_rows)
    counted = {k: after.errors.get(k, 0) - before.errors.get(k, 0) for k in after.errors}
    assert {k: v for k, v in counted.items() if v} == ({kind: 1} if kind else {})
    # Rejected before any decoder call; both streams go on exactly where they were.
    assert (after.code2wav_frames, after.decoder_rows, after.live()) == (before.code2wav_frames, before.decoder_rows,
                                                                         before.live())
    bystander_pcm.append(infer(grpc_client, bystander, b[:, 2:5], 2, end=True, new_frames=3))
    victim_pcm.append(infer(grpc_client, victim, a[:, 3:7], 3, end=True, new_frames=4))
    check(np.concatenate(victim_pcm), "A", "victim")
    check(np.concatenate(bystander_pcm), "B", "bystander")


# ---- 5, 6. idle expiry and the cancelled-request regression, with second-scale timeouts -----------

@pytest.fixture(scope="module")
def short_timeout_server(served_repository, triton_server_factory, tmp_path_factory):
    repository = copy_repository(served_repository, tmp_path_factory.mktemp("short_idle") / "model_repository")
    set_idle_timeout(repository, SHORT_CODE2WAV_IDLE_S)
    return triton_server_factory(repository)


def test_idle_streams_expire_everywhere_and_cancelled_requests_leave_no_shared_state(
        short_timeout_server, scenario, check):
    """Idle streams expire in both models while one sending within the timeout lives on. Regression (docs/design.md
    §7): a cancel then an idle timeout released a slot twice, two sequences sharing one state. Requests queued behind
    a first are cancelled: unary ones with code2wav's stub stopped, then streamed ones."""
    server, a, codes = short_timeout_server, scenario.streams["A"], random_codes(245, seed=51)
    expiring, closing, kept = new_sequence_id(), new_sequence_id(), new_sequence_id()
    baseline = ServingMetrics.read(server.metrics_url)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        first = infer(client, expiring, a[:, :4], 0, start=True, new_frames=4)
        infer(client, closing, a[:, :2], 0, start=True, new_frames=2)
        kept_pcm = []

        def send_kept(end=False):
            frame = len(kept_pcm)
            kept_pcm.append(infer(client, kept, a[:, frame:frame + 1], frame, start=frame == 0, end=end, new_frames=1))

        send_kept()
        idle_started = time.monotonic()
        assert ServingMetrics.read(server.metrics_url).live() == baseline.live(3)
        # Two streams go idle, both models drop them; the native decoder's timeout (it reports none) is waited out.
        decoder_gone_s = idle_started + SHORT_DECODER_IDLE_S + 5
        while True:
            time.sleep(0.5)
            send_kept()
            expired = ServingMetrics.read(server.metrics_url)
            if expired.live() == baseline.live(1) and (expired.decoder_live is not None
                                                       or time.monotonic() > decoder_gone_s):
                break
            assert time.monotonic() - idle_started < PATIENCE_S, f"the idle streams did not expire: {expired}"
        assert time.monotonic() - idle_started > SHORT_CODE2WAV_IDLE_S
        assert expired.decoder_expired is None or expired.decoder_expired - baseline.decoder_expired == 2
        assert not any(decoder_holds(server.grpc_url, sequence_id) for sequence_id in (expiring, closing))
        send_kept(end=True)
        # Continuing an expired stream is refused, saying to START.
        infer_error(client, expiring, code2wav_inputs(a[:, 4:5], 4), START_HINT)
        # START|END with no frame on an expired stream: nothing to decode, nothing to end.
        infer(client, closing, a[:, :0], start=True, end=True, new_frames=0)
        # A new START with the same id is a fresh stream.
        again = [infer(client, expiring, a[:, :1], 0, start=True, new_frames=1),
                 infer(client, expiring, a[:, 1:8], 1, end=True, new_frames=7)]
    check(first, "A", "before expiry")
    check(np.concatenate(kept_pcm), "A", "kept alive")
    check(np.concatenate(again), "A", "restarted")
    assert ServingMetrics.read(server.metrics_url).live() == baseline.live()
    unary_cancelled, stream_cancelled = new_sequence_id(), new_sequence_id()
    requests = [(1, 241)] + [(first, first + 1) for first in range(241, 245)]

    def cancelled_while_held(send_requests, held, cancel, stopped_pid: int | None = None) -> None:
        if stopped_pid:
            os.kill(stopped_pid, signal.SIGSTOP)  # nothing is answered until after the cancel
        try:
            send_requests()
            wait_for_metrics(server.metrics_url, held)
            cancel()
        finally:
            if stopped_pid:
                os.kill(stopped_pid, signal.SIGCONT)
        # The cancelled stream leaves by the idle timeout, and Triton's queue empties.
        wait_for_metrics(server.metrics_url, lambda m: m.live() == baseline.live() and not m.code2wav_pending)

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        infer(client, unary_cancelled, codes[:, :1], 0, start=True, new_frames=1)
        calls = []
        cancelled_while_held(
            lambda: calls.extend(send_async(client, unary_cancelled, codes[:, first:stop], first) for first, stop in requests),
            lambda m: m.code2wav_pending >= len(requests) - 1, lambda: [call.cancel() for call, _, _ in calls],
            stopped_pid=stub_pid(server.pid, "code2wav"))
        for _, outcome, done in calls:
            assert done.wait(PATIENCE_S)
            (result, error), = outcome
            assert result is None and "CANCELLED" in str(error).upper(), (result, error)
        infer_error(client, unary_cancelled, code2wav_inputs(codes[:, 1:2], 1), START_HINT)

    # The same over a bidirectional stream, closed with its requests in flight and queued.
    stream = StreamingClient(server.grpc_url)
    stream.send(stream_cancelled, codes[:, :1], 0, start=True)
    stream.collect(1)
    rows = settled_metrics(server.metrics_url, 0).decoder_rows
    cancelled_while_held(lambda: [stream.send(stream_cancelled, codes[:, first:stop], first) for first, stop in requests],
                         lambda m: m.decoder_rows > rows, lambda: stream.close(cancel_requests=True))

    # Three streams at once, two of them on the ids of the cancelled ones: each is its own stream.
    rng = np.random.default_rng(31)
    plans = {name: StreamPlan(sequence_id, scenario.streams[name][:, :36], chunk_bounds(rng, 36, 3), join_round)
             for name, sequence_id, join_round in [("C1", unary_cancelled, 0), ("C2", stream_cancelled, 0),
                                                   ("A", new_sequence_id(), 1)]}
    run_interleaved(server.grpc_url, list(plans.values()))
    for name, plan in plans.items():
        check(np.concatenate(plan.chunks), name, f"stream {plan.sequence_id} ({name}) after the cancellations")
    assert ServingMetrics.read(server.metrics_url).live() == baseline.live()


# ---- 7. `make serve`, the null decoder (bench target) ----------------------------------------------

def test_serve_exports_into_a_clean_build_folder_serves_and_stops_cleanly(tmp_path):
    build_dir = tmp_path / "build"
    # Ready once it has exported the random-init checkpoint: minutes on a loaded machine.
    with serve_cli(None, tmp_path / "tritonserver.log", "--random-init", "--seed", "0", "--build-dir", str(build_dir),
                   ready_timeout_s=600) as (cli, ports, output):
        assert (build_dir / "model_repository" / "mimi_decoder" / "1" / "model.onnx").is_file()
        with grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}") as client:
            pcm = infer(client, new_sequence_id(), random_codes(3, seed=3), 0, start=True, end=True, new_frames=3)
        assert np.all(np.isfinite(pcm)) and np.any(pcm != 0)
        text = stop_cli(cli, output)
    # What serve leaves after SIGTERM (no process, port or shared memory): test_server_launcher.py.
    assert cli.returncode == 0 and "SIGTERM: draining and stopping tritonserver" in text, text


def test_two_front_instances_behind_the_null_decoder_and_the_bench_profile_counts_every_process(
        onnx_fp32, tmp_path, triton_server_factory):
    """`render --front-instances 2`: 6 streams get all their silence, a request is one decoder call, and the point
    profile charges tritonserver's and every stub's CPU time to the requests."""
    from benchmarks.profile import PointProfile, process_role
    from benchmarks.sweep import decode_streams
    from mimi_code2wav.server.processes import group_pids

    repository = render_repository(export_spec(onnx_fp32), onnx_fp32 / "model.onnx", tmp_path / "repo", "null",
                                   DecoderServing(instance_kind="KIND_CPU", front_instances=2))
    assert not (repository / "mimi_decoder" / "1" / "model.onnx").exists()
    server = triton_server_factory(repository)
    roles = sorted(process_role(pid) for pid in group_pids(server.pid))
    assert roles == ["stub code2wav", "stub code2wav", "stub mimi_decoder", "tritonserver"]
    profile = PointProfile(server.pid, server.metrics_url)
    profile.start()
    decoded = metric(server, "nv_inference_request_success", model="mimi_decoder")
    # 1 frame, then 13 per request: 4 requests of each stream.
    report = decode_streams(server.grpc_url, [random_codes(40, seed) for seed in range(6)], chunk_frames=13)
    requests = sum(len(r.chunk_frames) for r in report.results)
    # Triton counts a request once answered: finish waits for the front's count, this for the decoder's.
    assert wait_until(lambda: metric(server, "nv_inference_request_success", model="mimi_decoder") - decoded == requests, 10)
    result = profile.finish(requests)
    assert [r.pcm.shape for r in report.results] == [(40 * SAMPLES_PER_FRAME,)] * 6
    assert all(not r.pcm.any() for r in report.results)
    assert result["requests"] == 6 * 4 == result["code2wav"]["requests"] == result["mimi_decoder"]["requests"]
    assert set(result["server_cpu_ms_per_request"]) == {"tritonserver", "stub code2wav", "stub mimi_decoder"}
    assert result["server_cpu_ms_per_request_total"] > 0 and result["load_cpu_ms_per_request"] > 0
    for model in ("code2wav", "mimi_decoder"):
        assert 1 <= result[model]["mean_batch"] <= 6 and result[model]["execute_ms"] > 0


# ---- 8. shutdown under traffic, the stream cap, memory per stream ---------------------------------

def _stream_until_stopped(url: str, stop: threading.Event, outcomes: list, seed: int) -> None:
    """START, then 4-frame requests back to back until `stop` or an error, each outcome in `outcomes`."""
    codes, sequence_id, frame = random_codes(4000, seed), new_sequence_id(), 0
    try:
        with grpcclient.InferenceServerClient(url) as client:
            while not stop.is_set() and frame + 4 <= codes.shape[1]:
                size = 1 if frame == 0 else 4
                infer(client, sequence_id, codes[:, frame : frame + size], frame, start=frame == 0, new_frames=size)
                outcomes.append(("ok", size))
                frame += size
    except InferenceServerException as exc:
        outcomes.append(("error", str(exc)))


def test_sigterm_with_streams_in_flight_unloads_both_models_without_waiting_out_the_exit_timeout(
        served_repository, tmp_path):
    """SIGTERM with 8 streams in flight: each request is answered or told the server is shutting down; both models
    unload and the server exits inside the exit timeout, leaving no process or shared memory."""
    from mimi_code2wav.server.supervise import running_server

    log = tmp_path / "server.log"
    with running_server(served_repository, log_path=log) as server:
        assert server.exit_timeout_s == DEFAULT_EXIT_TIMEOUT_S
        stop, outcomes = threading.Event(), [[] for _ in range(8)]
        threads = [threading.Thread(target=_stream_until_stopped, args=(server.grpc_url, stop, o, 50 + i), daemon=True)
                   for i, o in enumerate(outcomes)]
        for thread in threads:
            thread.start()
        assert wait_until(lambda: all(sum(1 for kind, _ in o if kind == "ok") >= 3 for o in outcomes), PATIENCE_S), \
            f"the streams did not get going: {[len(o) for o in outcomes]}"
        prefix, pgid = server.shm_prefix, server.pid
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=60)
        exit_s = time.monotonic() - signalled
        stop.set()
        for thread in threads:
            thread.join(timeout=90)
        assert not any(thread.is_alive() for thread in threads), "a client request never got an answer"
    text = log.read_text()
    tail = text[-3000:]
    assert code == 0 and exit_s < DEFAULT_EXIT_TIMEOUT_S, f"exit {code} after {exit_s:.1f} s:\n{tail}"
    assert all(f"successfully unloaded '{model}' version 1" in text for model in ("code2wav", "mimi_decoder")), tail
    counts = [int(n) for n in re.findall(r"Found (\d+) model versions that have in-flight inferences", text)]
    assert counts and counts[-1] == 0, tail
    # A shutdown error logged as a fault, or a stub's stacks written as it died.
    for fault in ("Non-graceful termination", "Exit timeout expired", "Traceback", "Fatal Python error"):
        assert fault not in text, tail
    errors = [message for stream in outcomes for kind, message in stream if kind == "error"]
    assert len(errors) <= len(outcomes), errors
    for message in errors:
        assert "the server is shutting down" in message and "StatusCode.UNAVAILABLE" in message, message
    assert not process_group_alive(pgid)
    assert list(SHM_DIR.glob(f"{prefix}*")) == []
    print(f"\nSIGTERM with 8 streams in flight: exited in {exit_s:.1f} s, {len(errors)} requests refused")


@pytest.fixture(scope="module", params=["null", "onnxruntime"])
def capped_server(request, onnx_fp32, tmp_path_factory, triton_server_factory):
    """code2wav over the null decoder, then the native one, for 3 streams at most."""
    repository = render_repository(export_spec(onnx_fp32), onnx_fp32 / "model.onnx",
                                   tmp_path_factory.mktemp("capped") / "repo", require_target(request.param),
                                   DecoderServing(instance_kind="KIND_CPU", max_candidate_sequences=3))
    server = triton_server_factory(repository)
    server.decoder_target = request.param
    return server


def test_a_start_past_the_stream_cap_is_refused_and_harms_no_live_stream(capped_server):
    codes, url = random_codes(3, seed=3), capped_server.grpc_url
    with grpcclient.InferenceServerClient(url) as client:
        live = [new_sequence_id() for _ in range(3)]
        for sequence_id in live:
            infer(client, sequence_id, codes[:, :1], 0, start=True, new_frames=1)
        if capped_server.decoder_target == "onnxruntime":
            # The native decoder backlogs a START past its cap (docs/design.md §7), hence code2wav refuses first.
            with pytest.raises(InferenceServerException, match="Deadline|DEADLINE_EXCEEDED"):
                client.infer("mimi_decoder", decoder_step_inputs(), sequence_id=new_sequence_id(),
                             sequence_start=True, sequence_end=True, client_timeout=2.0)
        refused = new_sequence_id()
        with pytest.raises(InferenceServerException) as failure:
            client.infer(MODEL_NAME, code2wav_inputs(codes[:, :1], 0), sequence_id=refused, sequence_start=True)
        assert failure.value.status() == "StatusCode.UNAVAILABLE", failure.value
        assert ("resource exhausted: this code2wav instance already holds 3 live streams, its limit "
                "(max_live_streams=3); the new stream was refused and no other stream was affected") in failure.value.message()
        # The refused stream does not exist; the live ones go on; a restart of a live one is no new stream.
        infer_error(client, refused, code2wav_inputs(codes[:, 1:2], 1), START_HINT)
        for sequence_id in live:
            assert infer(client, sequence_id, codes[:, 1:3], 1, new_frames=2).shape == (2 * SAMPLES_PER_FRAME,)
        infer(client, live[0], codes[:, :1], 0, start=True, new_frames=1)
        # One stream ends: there is room for a new one.
        infer(client, live[1], codes[:, 3:3], 3, end=True, new_frames=0)
        infer(client, refused, codes[:, :1], 0, start=True, new_frames=1)
        for sequence_id in (live[0], live[2], refused):
            infer(client, sequence_id, codes[:, :0], None, end=True, new_frames=0)
    assert metric_value(fetch_metrics(capped_server.metrics_url), "code2wav_errors_total", kind="stream_cap") == 1


def test_memory_per_live_stream_and_after_expiry(onnx_fp32, tmp_path):
    """32 streams opened and abandoned, three times, on the native decoder (docs/design.md §5.1): PSS idle, live and
    expired; slots reuse their state buffers, and steps are batches of 32, so later rounds stay within 2%."""
    from benchmarks.memory import open_streams, snapshot, wait_expired
    from mimi_code2wav.server.supervise import running_server

    repository = render_repository(export_spec(onnx_fp32), onnx_fp32 / "model.onnx", tmp_path / "repo",
                                   require_target("onnxruntime"), DecoderServing(
                                       instance_kind="KIND_CPU", preferred_batch_sizes=[32], max_queue_delay_us=10**6))
    set_idle_timeout(repository, MEMORY_IDLE_S)
    state_mib = export_spec(onnx_fp32).state_bytes_per_stream() / 2**20
    with running_server(repository, log_path=tmp_path / "server.log") as server:
        open_streams(server.grpc_url, 1, 1, [1, 4], 0)  # warm-up: one stream, ended
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            infer(client, 1, np.zeros((NUM_CODEBOOKS, 0), np.int64), 5, end=True, new_frames=0)
        rounds = [snapshot(server.pid, "idle", {})]
        for first_id in (100, 200, 300):
            open_streams(server.grpc_url, first_id, 32, [1, 4, 4], first_id)
            rounds.append(snapshot(server.pid, f"32 live from id {first_id}", {}))
            # code2wav's expiry, then the decoder's; the probe ends a sequence Triton still holds, freeing every slot.
            wait_expired(server.metrics_url, 10 * MEMORY_IDLE_S, DECODER_IDLE_MARGIN_US / 1e6 + 0.5)
            held = sum(decoder_holds(server.grpc_url, sequence_id) for sequence_id in range(first_id, first_id + 32))
            rounds.append(snapshot(server.pid, f"expired ({held} decoder sequences still held)", {}))
        # code2wav counts what it forgot without an END: the 32 of each round, not the warm-up stream.
        assert metric_value(fetch_metrics(server.metrics_url), "code2wav_expired_streams_total") == 3 * 32
    idle, peak, *later = rounds
    per_stream = (peak["pss_mib"] - idle["pss_mib"]) / 32
    readings = ", ".join(f"{r['label']} {r['pss_mib']:.0f} MiB" for r in rounds)
    print(f"\nonnxruntime: PSS {readings}; {per_stream:.1f} MiB per live stream, state {state_mib:.2f}")
    # The state once per stream, plus ONNX Runtime's scratch for batches of up to 32 rows.
    assert per_stream <= 5 * state_mib, f"{per_stream:.1f} MiB per live stream"
    for snapshot_mib in later:
        assert snapshot_mib["pss_mib"] <= 1.02 * peak["pss_mib"], \
            f"a later round of streams added to the memory: {snapshot_mib['label']} after {peak['pss_mib']:.0f} MiB"
