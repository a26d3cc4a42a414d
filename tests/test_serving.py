"""End to end through a real tritonserver: gRPC client -> code2wav (BLS) -> python-ort mimi_decoder.

The served decoder is the real-architecture ONNX export with seeded random weights; every stream's
PCM is compared with moshi's streaming decode of the same codes (docs/design.md §2.3 "equal": exact sample
counts, max abs error 1e-4 and >= 100 dB SNR) and, where it ran alone or batched, with the same ONNX
step run directly in ONNX Runtime (within 1e-5).

Covered: the three ways a client sends a stream (deltas, cumulative prefixes from offset 0, offsets) over unary and
bidirectional streaming gRPC; dedupe of retries, overlaps and repeated frames; 16 interleaved streams
batched by the decoder; every row of the stream lifecycle and each kind of bad request; idle expiry and
the cancelled-request regression on a server with second-scale timeouts; `code2wav-server serve`
from a clean build folder.

Every test uses its own sequence ids and ends the streams it opens.
"""

from __future__ import annotations

import itertools
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, MODEL_NAME, NUM_CODEBOOKS, SAMPLES_PER_FRAME, random_codes
from mimi_code2wav.export.reference import moshi_stream_decode
from mimi_code2wav.export.render import DECODER_IDLE_MARGIN_US, DecoderServing, render_repository, set_idle_timeout
from mimi_code2wav.server.processes import process_group_alive
from mimi_code2wav.server.triton import (
    DEFAULT_EXIT_TIMEOUT_S,
    SHM_DIR,
    fetch_metrics,
    free_ports,
    metric_value,
    port_is_free,
)

from helpers import (
    REPO_ROOT,
    code2wav_inputs,
    copy_repository,
    decoder_holds,
    decoder_step_inputs,
    export_spec,
    frames_of,
    infer,
    infer_error,
    pcm_of,
    raw_input,
    sequence_ids,
    shm_prefix_of,
    stub_pid,
    tritonserver_child,
    wait_http_ready,
    wait_until,
)
from mimi_fixtures import assert_equal_audio, fixtures_on_each_target, require_target

pytestmark = [pytest.mark.server, pytest.mark.slow]

# The contract tests run on both decoder targets (python-ort, then the native onnxruntime backend).
decoder_target, served_repository, code2wav_server = fixtures_on_each_target()

MAX_NEW_FRAMES_PER_REQUEST = 1500
MAX_REQUEST_FRAMES = 45000
# A stream batched with others stays within this of its solo run (docs/design.md §2.3).
BATCHED_MAX_ABS = 1e-5
# Triton's own answer to a request for a sequence it does not hold, and the core's, both say this.
START_HINT = "START flag"

# Idle timeouts of the short-timeout server: code2wav's, and the decoder's above it by the margin the
# shipped configs keep (render.set_idle_timeout).
SHORT_CODE2WAV_IDLE_S = 2.0

# Sequence ids far from small numbers another test module might pick on the shared server.
new_sequence_id = sequence_ids(7_000_001)


def chunk_bounds(rng: np.random.Generator, total_frames: int, max_chunk: int = 8) -> list[tuple[int, int]]:
    """Random chunking of [0, total) into (start, stop) pairs, the first one frame long."""
    bounds, start = [], 0
    while start < total_frames:
        size = 1 if start == 0 else int(rng.integers(1, max_chunk + 1))
        stop = min(start + size, total_frames)
        bounds.append((start, stop))
        start = stop
    return bounds


class StreamingClient:
    """One bidirectional gRPC stream carrying requests of any number of sequences; responses are
    routed back by request id. Errors fail the test (the stream transport is used for valid
    requests only: an error response carries no request id)."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self._responses: queue.Queue = queue.Queue()
        self._request_ids = itertools.count(1)
        self.client.start_stream(callback=lambda result, error: self._responses.put((result, error)))

    def send(self, sequence_id: int, codes, frame_offset=None, start=False, end=False) -> str:
        request_id = str(next(self._request_ids))
        self.client.async_stream_infer(
            MODEL_NAME, code2wav_inputs(codes, frame_offset), request_id=request_id,
            sequence_id=sequence_id, sequence_start=start, sequence_end=end,
        )
        return request_id

    def collect(self, count: int, timeout_s: float = 120.0) -> dict[str, object]:
        """Wait for `count` responses; returns {request id: InferResult}."""
        results = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < count:
            result, error = self._responses.get(timeout=max(deadline - time.monotonic(), 0.001))
            if error is not None:
                raise AssertionError(f"streamed request failed: {error}")
            results[result.get_response().id] = result
        return results

    def close(self, cancel_requests: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel_requests)
        self.client.close()


# ---- metrics -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServingMetrics:
    code2wav_live: float
    code2wav_frames: float
    decoder_live: float | None  # the python-ort decoder's gauge; None for the native decoder
    decoder_runs: float  # the decoder's executions (Triton's count, any target)
    decoder_rows: float  # the decoder's requests (steps) in them
    decoder_expired: float | None  # the python-ort decoder's count
    errors: dict[str, float]

    @classmethod
    def read(cls, metrics_url: str) -> ServingMetrics:
        samples = fetch_metrics(metrics_url)

        def value(name, **labels):
            found = metric_value(samples, name, **labels)
            return 0.0 if found is None else found

        errors = {}
        for key, count in samples.items():
            match = re.fullmatch(r'code2wav_errors_total\{.*\bkind="([a-z_]+)".*\}', key)
            if match:
                errors[match.group(1)] = count
        return cls(
            code2wav_live=value("code2wav_live_streams"),
            code2wav_frames=value("code2wav_frames_decoded_total"),
            decoder_live=metric_value(samples, "mimi_decoder_live_streams"),
            decoder_runs=value("nv_inference_exec_count", model="mimi_decoder"),
            decoder_rows=value("nv_inference_request_success", model="mimi_decoder")
            + value("nv_inference_request_failure", model="mimi_decoder"),
            decoder_expired=metric_value(samples, "mimi_decoder_expired_streams_total"),
            errors=errors,
        )

    def live(self, more: int = 0) -> tuple[float, float | None]:
        """(code2wav's live streams, the python-ort decoder's or None) plus `more` each."""
        return self.code2wav_live + more, None if self.decoder_live is None else self.decoder_live + more


def settled_metrics(metrics_url: str, min_decoder_rows: float, timeout_s: float = 5.0) -> ServingMetrics:
    """The metrics once the decoder has counted at least `min_decoder_rows` steps and its count holds
    still for 0.1 s: a backend reports a step's count a moment after its answer."""
    previous = None
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = ServingMetrics.read(metrics_url)
        if previous is not None and metrics.decoder_rows == previous.decoder_rows >= min_decoder_rows:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"the decoder's step count did not settle at >= {min_decoder_rows}: {metrics}")
        previous = metrics
        time.sleep(0.1)


def wait_for_metrics(metrics_url: str, condition, timeout_s: float, poll_s: float = 0.1):
    """Poll the metrics until `condition(ServingMetrics)` holds; returns (metrics, seconds waited)
    or fails with the last values read."""
    started = time.monotonic()
    while True:
        metrics = ServingMetrics.read(metrics_url)
        if condition(metrics):
            return metrics, time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"metrics did not reach the expected state in {timeout_s} s: {metrics}")
        time.sleep(poll_s)


# ---- references ----------------------------------------------------------------------------------

def moshi_decode(model, codes: np.ndarray) -> np.ndarray:
    """moshi's streaming decode of codes [k, T], one frame per call: PCM float32 [1920*T]."""
    return moshi_stream_decode(model, np.asarray(codes)[None])[0]


@pytest.fixture(scope="module")
def ort_streams(ort_decode, scenario):
    """Each scenario stream decoded alone by the ONNX step in ONNX Runtime."""
    return {name: ort_decode(codes) for name, codes in scenario.streams.items()}


def repeated_frame_codes(scenario) -> np.ndarray:
    """[k, 18]: runs of identical consecutive frames, as silence produces, the first at the start."""
    a = scenario.streams["A"]
    silence = 40  # any frame; repeated, it plays the part of a silence frame
    columns = [silence, silence, silence, 0, 1, 1, 1, 2, silence, silence, silence, silence, 3, 3, 4,
               silence, silence, 5]
    return np.ascontiguousarray(a[:, columns])


@pytest.fixture(scope="module")
def repeated(scenario, moshi_checkpoint, ort_decode):
    """The repeated-frame codes with their moshi and ORT references."""
    codes = repeated_frame_codes(scenario)
    return codes, moshi_decode(moshi_checkpoint[1], codes), ort_decode(codes)


def assert_matches(pcm, moshi_reference, ort_reference, what: str) -> float:
    """Equal to moshi's streaming decode, and within 1e-5 of the ONNX step run directly. Returns the
    max abs difference to the ONNX step."""
    assert_equal_audio(pcm, moshi_reference, what=f"{what} vs moshi")
    error, _ = assert_equal_audio(pcm, ort_reference, max_abs=BATCHED_MAX_ABS, what=f"{what} vs ONNX step")
    return error


# ---- 1. one stream, every way of sending it ------------------------------------------------------

SEND_CASES = [
    pytest.param("unary", "delta", "A", 11, id="unary-delta-A"),
    pytest.param("unary", "cumulative", "B", 12, id="unary-cumulative-B"),
    pytest.param("unary", "offsets", "C1", 13, id="unary-offsets-C1"),
    pytest.param("streaming", "delta", "C2", 14, id="streaming-delta-C2"),
    pytest.param("streaming", "cumulative", "C1", 15, id="streaming-cumulative-C1"),
    pytest.param("streaming", "offsets", "A", 16, id="streaming-offsets-A"),
]


@pytest.mark.parametrize("transport, mode, name, seed", SEND_CASES)
def test_one_stream_equals_moshi_and_the_onnx_step(
    decoder_target, code2wav_server, scenario, moshi_streams, ort_streams, transport, mode, name, seed
):
    codes = scenario.streams[name]
    bounds = chunk_bounds(np.random.default_rng(seed), codes.shape[1])
    requests = []  # (codes, frame_offset, start, end, new frames)
    for index, (first, stop) in enumerate(bounds):
        sent = {"delta": codes[:, first:stop], "cumulative": codes[:, :stop], "offsets": codes[:, first:stop]}[mode]
        offset = {"delta": None, "cumulative": 0, "offsets": first}[mode]
        requests.append((sent, offset, index == 0, index == len(bounds) - 1, stop - first))

    sequence_id = new_sequence_id()
    if transport == "unary":
        with grpcclient.InferenceServerClient(code2wav_server.grpc_url) as client:
            chunks = [
                infer(client, sequence_id, sent, offset, start, end, new_frames)
                for sent, offset, start, end, new_frames in requests
            ]
    else:
        stream = StreamingClient(code2wav_server.grpc_url)
        try:
            request_ids = [stream.send(sequence_id, sent, offset, start, end) for sent, offset, start, end, _ in requests]
            results = stream.collect(len(request_ids))
        finally:
            stream.close()
        chunks = [pcm_of(results[rid], request[4]) for rid, request in zip(request_ids, requests)]

    pcm = np.concatenate(chunks)
    assert_matches(pcm, moshi_streams[name], ort_streams[name], f"{transport} {mode} {name}")
    error, snr = assert_equal_audio(pcm, moshi_streams[name], what="vs moshi")
    print(f"\n{decoder_target} decoder, {transport} {mode} stream {name} ({pcm.size // SAMPLES_PER_FRAME} frames): "
          f"vs moshi max abs {error:.2g}, SNR {snr:.1f} dB")


def test_one_frame_per_request_round_trip(code2wav_server, grpc_client, scenario, moshi_streams, ort_streams):
    """The live pattern: one frame every request, with offsets. Reports the round trip per frame."""
    codes = scenario.streams["C2"][:, :40]
    sequence_id = new_sequence_id()
    chunks, round_trips_ms = [], []
    for frame in range(codes.shape[1]):
        started = time.perf_counter()
        chunks.append(infer(grpc_client, sequence_id, codes[:, frame : frame + 1], frame, start=frame == 0,
                            end=frame == codes.shape[1] - 1, new_frames=1))
        round_trips_ms.append((time.perf_counter() - started) * 1e3)
    pcm = np.concatenate(chunks)
    assert_matches(pcm, moshi_streams["C2"][: pcm.size], ort_streams["C2"][: pcm.size], "one frame per request")
    p50, p90 = np.percentile(round_trips_ms[1:], [50, 90])
    print(f"\none frame per request through Triton: p50 {p50:.1f} ms, p90 {p90:.1f} ms "
          f"(first request {round_trips_ms[0]:.1f} ms)")


# ---- 2. dedupe -----------------------------------------------------------------------------------

def test_identical_consecutive_frames_sent_as_offset_deltas_are_all_decoded(grpc_client, repeated):
    codes, moshi_reference, ort_reference = repeated
    # Chunk edges inside runs of identical frames: each chunk starts with a copy of the frame before.
    bounds = [(0, 1), (1, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 12), (12, 13), (13, 16),
              (16, 17), (17, 18)]
    sequence_id = new_sequence_id()
    chunks = [
        infer(grpc_client, sequence_id, codes[:, first:stop], first, start=first == 0,
              end=stop == codes.shape[1], new_frames=stop - first)
        for first, stop in bounds
    ]
    assert_matches(np.concatenate(chunks), moshi_reference, ort_reference, "repeated frames")


def test_retries_and_overlaps_decode_only_new_frames(grpc_client, scenario, moshi_streams, ort_streams):
    codes, moshi_reference, ort_reference = scenario.streams["B"], moshi_streams["B"], ort_streams["B"]
    sequence_id = new_sequence_id()
    decoded = []

    def send(first, stop, new_frames, start=False, end=False):
        pcm = infer(grpc_client, sequence_id, codes[:, first:stop], first, start=start, end=end,
                    new_frames=new_frames)
        if new_frames:
            new_first = stop - new_frames
            assert_matches(pcm, frames_of(moshi_reference, new_first, stop),
                           frames_of(ort_reference, new_first, stop), f"frames [{new_first}, {stop})")
            decoded.append(pcm)

    send(0, 4, 4, start=True)
    send(0, 4, 0)  # identical retry: nothing new
    send(2, 4, 0)  # a retry of the tail only
    send(2, 7, 3)  # overlaps 2 decoded frames, decodes 3
    send(1, 3, 0)  # entirely inside the decoded frames
    send(7, 10, 3)
    send(9, 10, 0)
    send(8, 12, 2, end=True)  # the last request overlaps too
    assert_matches(np.concatenate(decoded), moshi_reference[: 12 * SAMPLES_PER_FRAME],
                   ort_reference[: 12 * SAMPLES_PER_FRAME], "retries and overlaps")


def test_silence_deltas_without_offsets_are_all_decoded(grpc_client, scenario, moshi_checkpoint, ort_decode):
    """The shipped default (dedupe_mode=delta): one stream sent as vLLM-Omni's stage 0 sends it, 1
    frame then 5-frame deltas without frame_offset, every frame the same code (silence). Every frame
    comes back, equal to moshi; `auto` would return 1, 4, 0, 0, 3 of them (docs/design.md §2.1)."""
    codes = np.repeat(scenario.streams["A"][:, 40:41], 19, axis=1)
    moshi_reference, ort_reference = moshi_decode(moshi_checkpoint[1], codes), ort_decode(codes)
    bounds = [(0, 1), (1, 6), (6, 11), (11, 16), (16, 19)]
    sequence_id = new_sequence_id()
    chunks = [
        infer(grpc_client, sequence_id, codes[:, first:stop], start=first == 0, end=stop == 19, new_frames=stop - first)
        for first, stop in bounds
    ]
    assert [chunk.size // SAMPLES_PER_FRAME for chunk in chunks] == [1, 5, 5, 5, 3]
    assert_matches(np.concatenate(chunks), moshi_reference, ort_reference, "silence deltas without offsets")


# ---- 3. many streams at once ---------------------------------------------------------------------

@dataclass
class StreamPlan:
    """One stream of an interleaved run: `codes` [k, T] sent with offsets in `bounds` chunks, one
    chunk per round from round `join_round` on."""

    sequence_id: int
    codes: np.ndarray
    bounds: list
    join_round: int = 0

    def __post_init__(self):
        self.chunks: list[np.ndarray] = []

    @property
    def frames(self) -> int:
        return self.bounds[-1][1]

    def pcm(self) -> np.ndarray:
        return np.concatenate(self.chunks)


def run_interleaved(grpc_url: str, plans: list[StreamPlan]) -> float:
    """Send every plan over one bidirectional gRPC stream, round by round (each active stream sends
    its next chunk, then the round's responses are awaited), so that the server sees the streams'
    requests together. Fills each plan's `chunks`; returns the wall time in seconds."""
    client = StreamingClient(grpc_url)
    started = time.perf_counter()
    try:
        for round_index in itertools.count():
            sent = {}
            for plan in plans:
                step = round_index - plan.join_round
                if 0 <= step < len(plan.bounds):
                    first, stop = plan.bounds[step]
                    request_id = client.send(plan.sequence_id, plan.codes[:, first:stop], first,
                                             start=step == 0, end=step == len(plan.bounds) - 1)
                    sent[request_id] = (plan, stop - first)
            if not sent:
                if all(round_index - plan.join_round >= len(plan.bounds) for plan in plans):
                    break
                continue
            results = client.collect(len(sent))
            for request_id, (plan, new_frames) in sent.items():
                plan.chunks.append(pcm_of(results[request_id], new_frames))
    finally:
        client.close()
    return time.perf_counter() - started


def test_sixteen_interleaved_streams_are_batched_and_each_equals_its_solo_run(
    code2wav_server, scenario, moshi_streams, ort_streams
):
    names = ["A", "B", "C1", "C2"]
    rng = np.random.default_rng(21)
    plans, references = [], []
    for index in range(16):
        name = names[index % 4]
        frames = 24 + index  # 24..39 frames
        # Streams join one round apart, so every batch mixes rows of different ages.
        plans.append(StreamPlan(new_sequence_id(), scenario.streams[name][:, :frames],
                                chunk_bounds(rng, frames, max_chunk=3), join_round=index))
        references.append((name, frames * SAMPLES_PER_FRAME))

    before = settled_metrics(code2wav_server.metrics_url, 0)
    elapsed_s = run_interleaved(code2wav_server.grpc_url, plans)
    after = settled_metrics(code2wav_server.metrics_url, before.decoder_rows + sum(len(p.bounds) for p in plans))

    worst = 0.0
    for plan, (name, samples) in zip(plans, references):
        worst = max(worst, assert_matches(plan.pcm(), moshi_streams[name][:samples], ort_streams[name][:samples],
                                          f"stream {plan.sequence_id} ({name}, {plan.frames} frames)"))

    total_frames = sum(plan.frames for plan in plans)
    total_requests = sum(len(plan.bounds) for plan in plans)
    runs = after.decoder_runs - before.decoder_runs
    rows = after.decoder_rows - before.decoder_rows
    # Each frame was decoded exactly once, each request in one decoder call (one row: requests hold
    # at most 3 frames here), and the decoder batched steps of different streams (a BLS that
    # serialised its decoder calls would give executions of one row only: as many as rows).
    assert after.code2wav_frames - before.code2wav_frames == total_frames
    # Triton's counters are server-wide: a step of another sequence (an END, an idle release) may land
    # in the window, hence the slack of 2; a BLS that split requests would add a row per extra call.
    assert total_requests <= rows <= total_requests + 2, f"{rows} decoder rows for {total_requests} requests"
    assert runs < rows, f"{runs} decoder executions for {rows} rows: none batched two streams"
    assert after.live() == before.live()
    assert not any(decoder_holds(code2wav_server.grpc_url, plan.sequence_id) for plan in plans)
    print(f"\n16 interleaved streams: {total_frames} frames in {elapsed_s:.1f} s = {total_frames / elapsed_s:.0f} "
          f"frames/s ({total_frames * 0.08 / elapsed_s:.1f}x real time); decoder: {runs:.0f} executions, mean "
          f"{rows / runs:.1f} rows; worst |diff| to the solo ONNX step {worst:.2g}")


def test_a_long_request_holds_up_no_other_stream(code2wav_server, ort_decode):
    """One stream sends 400 frames in one request (longer than the 250 a resume replays) while another
    sends one frame per request, each after the previous answer: the short requests are answered while
    the long one is still decoding (a code2wav instance answers each request when it is done and takes
    new batches meanwhile, docs/design.md §5), and both streams equal their solo decode."""
    rng = np.random.default_rng(41)
    long_codes, live_codes = rng.integers(0, CODEBOOK_SIZE, (NUM_CODEBOOKS, 400)), rng.integers(0, CODEBOOK_SIZE, (NUM_CODEBOOKS, 200))
    long_id, live_id = new_sequence_id(), new_sequence_id()
    outcome, done = [], threading.Event()

    def on_done(result, error):
        outcome.append((result, error))
        done.set()

    live, answered_during = [], 0
    with grpcclient.InferenceServerClient(code2wav_server.grpc_url) as client:
        live.append(infer(client, live_id, live_codes[:, :1], 0, start=True, new_frames=1))
        client.async_infer(MODEL_NAME, code2wav_inputs(long_codes, 0), callback=on_done, sequence_id=long_id,
                           sequence_start=True, sequence_end=True)
        for frame in range(1, live_codes.shape[1]):
            live.append(infer(client, live_id, live_codes[:, frame:frame + 1], frame, end=frame == 199, new_frames=1))
            if not done.is_set():
                answered_during += 1
            elif frame >= 20:
                break
        assert done.wait(120)
        if frame < 199:
            infer(client, live_id, live_codes[:, frame + 1:frame + 2], frame + 1, end=True, new_frames=1)
    (result, error), = outcome
    assert error is None, error
    assert_equal_audio(pcm_of(result, 400), ort_decode(long_codes), max_abs=BATCHED_MAX_ABS, what="the long request")
    live = np.concatenate(live)
    assert_equal_audio(live, ort_decode(live_codes)[: live.size], max_abs=BATCHED_MAX_ABS, what="the 1-frame stream")
    # 25 decoder steps of 16 frames: the 1-frame stream gets its turn between them.
    assert answered_during >= 5, f"only {answered_during} 1-frame requests answered while the long one decoded"
    print(f"\n{answered_during} one-frame requests answered while a 400-frame request decoded")


# ---- 4. stream lifecycle -------------------------------------------------------------------------

def test_start_and_end_in_one_request(grpc_client, scenario, moshi_streams, ort_streams):
    a = scenario.streams["A"]
    sequence_id = new_sequence_id()
    pcm = infer(grpc_client, sequence_id, a[:, :10], start=True, end=True, new_frames=10)
    assert_matches(pcm, moshi_streams["A"][: pcm.size], ort_streams["A"][: pcm.size], "START|END")
    # The stream ended with its first request.
    infer_error(grpc_client, sequence_id, code2wav_inputs(a[:, 10:11], 10), START_HINT)
    # START|END with no frame at all decodes nothing and leaves nothing open.
    empty = new_sequence_id()
    infer(grpc_client, empty, a[:, :0], start=True, end=True, new_frames=0)
    infer_error(grpc_client, empty, a[:, :1], START_HINT)
    assert grpc_client.is_server_ready()


def test_end_without_frames_ends_the_stream_and_its_decoder_sequence(
    code2wav_server, grpc_client, scenario, moshi_streams, ort_streams
):
    url = code2wav_server.metrics_url
    a = scenario.streams["A"]
    sequence_id = new_sequence_id()
    before = settled_metrics(url, 0)
    first = infer(grpc_client, sequence_id, a[:, :5], 0, start=True, new_frames=5)
    opened = settled_metrics(url, before.decoder_rows + 1)
    assert opened.live() == before.live(1)

    infer(grpc_client, sequence_id, a[:, :0], end=True, new_frames=0)
    closed = settled_metrics(url, opened.decoder_rows + 1)
    assert closed.live() == before.live()
    # The decoder got END on one step whose output was discarded, and holds the sequence no more.
    assert closed.decoder_rows - opened.decoder_rows == 1
    assert not decoder_holds(code2wav_server.grpc_url, sequence_id)
    assert closed.code2wav_frames == opened.code2wav_frames

    message = infer_error(grpc_client, sequence_id, code2wav_inputs(a[:, 5:6], 5), START_HINT)
    assert str(sequence_id) in message
    # START again: a fresh stream from frame 0.
    again = infer(grpc_client, sequence_id, a[:, :6], 0, start=True, end=True, new_frames=6)
    assert_matches(first, moshi_streams["A"][: first.size], ort_streams["A"][: first.size], "before END")
    assert_matches(again, moshi_streams["A"][: again.size], ort_streams["A"][: again.size], "after a new START")


def test_a_rejected_end_ends_the_stream_and_its_decoder_sequence(code2wav_server, grpc_client, scenario):
    """Triton releases a sequence when it schedules its END request, whatever the model answers: a
    rejected END must not leave the stream (and ~8 MiB of decoder state) behind until the timeout."""
    url = code2wav_server.metrics_url
    a = scenario.streams["A"]
    sequence_id = new_sequence_id()
    before = settled_metrics(url, 0)
    infer(grpc_client, sequence_id, a[:, :3], 0, start=True, new_frames=3)
    opened = settled_metrics(url, before.decoder_rows + 1)
    assert opened.live() == before.live(1)
    infer_error(grpc_client, sequence_id, code2wav_inputs(a[:, 5:6], 5), "gap",
                "the request carried END, so the stream has ended", end=True, kind="gap")
    closed = settled_metrics(url, opened.decoder_rows + 1)
    assert closed.live() == before.live()
    assert closed.decoder_rows - opened.decoder_rows == 1  # the discarded END step
    assert not decoder_holds(code2wav_server.grpc_url, sequence_id)


def test_start_on_a_live_stream_resets_it(code2wav_server, grpc_client, scenario, moshi_streams, ort_streams):
    url = code2wav_server.metrics_url
    a, b = scenario.streams["A"], scenario.streams["B"]
    sequence_id = new_sequence_id()
    before = ServingMetrics.read(url)
    infer(grpc_client, sequence_id, a[:, :1], 0, start=True, new_frames=1)
    infer(grpc_client, sequence_id, a[:, 1:7], 1, new_frames=6)
    # Barge-in: START on the live stream starts stream B over it; offsets count from 0 again.
    chunks = [infer(grpc_client, sequence_id, b[:, :2], 0, start=True, new_frames=2)]
    during = ServingMetrics.read(url)
    assert during.live() == before.live(1)
    chunks.append(infer(grpc_client, sequence_id, b[:, 1:5], 1, new_frames=3))
    chunks.append(infer(grpc_client, sequence_id, b[:, 5:12], 5, end=True, new_frames=7))
    pcm = np.concatenate(chunks)
    assert_matches(pcm, moshi_streams["B"][: pcm.size], ort_streams["B"][: pcm.size], "after the barge-in")
    after = ServingMetrics.read(url)
    assert after.live() == before.live()
    assert not decoder_holds(code2wav_server.grpc_url, sequence_id)


def test_requests_for_streams_not_started_are_refused_saying_to_start(grpc_client, scenario):
    a = scenario.streams["A"]
    sequence_id = new_sequence_id()
    message = infer_error(grpc_client, sequence_id, a[:, :1], START_HINT)
    assert str(sequence_id) in message
    infer_error(grpc_client, sequence_id, code2wav_inputs(a[:, :1], 0), START_HINT)
    infer_error(grpc_client, 0, a[:, :1], "non-zero", start=True)
    assert grpc_client.is_server_ready() and grpc_client.is_model_ready(MODEL_NAME)


def _with_code(codes: np.ndarray, codebook: int, frame: int, value: int) -> np.ndarray:
    codes = np.array(codes, dtype=np.int64)
    codes[codebook, frame] = value
    return codes


# The victim stream has decoded frames [0, 3) of stream A when each of these arrives:
# (inputs built from stream A's codes, substrings of the error, the error kind code2wav counts or None
# when Triton rejects the request before the model).
BAD_REQUESTS = [
    pytest.param(lambda a: [raw_input("input_ids", np.arange(19, dtype=np.int64)[None], "INT64")],
                 ["holds 19 codes", "not a multiple of num_codebooks=8"], "length", id="length"),
    pytest.param(lambda a: code2wav_inputs(_with_code(a[:, 3:5], 2, 1, CODEBOOK_SIZE), 3),
                 ["input_ids[5] = 2048", "codebook 2, frame 1", "outside [0, 2048)"], "code_range",
                 id="code-too-large"),
    pytest.param(lambda a: code2wav_inputs(_with_code(a[:, 3:5], 0, 0, -1), 3),
                 ["input_ids[0] = -1", "outside [0, 2048)"], "code_range", id="negative-code"),
    pytest.param(lambda a: code2wav_inputs(a[:, 3:4], -1), ["frame_offset must be >= 0, got -1"],
                 "negative_offset", id="negative-offset"),
    pytest.param(lambda a: code2wav_inputs(a[:, 5:6], 5),
                 ["frame_offset 5 leaves a gap", "has decoded 3 frames", "at most 3"], "gap", id="gap"),
    pytest.param(lambda a: code2wav_inputs(_with_code(a[:, 1:5], 4, 1, (int(a[4, 2]) + 1) % CODEBOOK_SIZE), 1),
                 ["frame 2 differs", "cannot change"], "changed_frame", id="changed-frame"),
    pytest.param(lambda a: [raw_input("input_ids", a[:, 3:4].astype(np.float32).reshape(1, -1), "FP32")],
                 ["input_ids", "data-type is 'FP32'", "expects 'INT64'"], None, id="float-input-ids"),
    pytest.param(lambda a: code2wav_inputs(a[:, 3:4])[:1] + [raw_input("frame_offset", np.array([[3]], np.int32), "INT32")],
                 ["frame_offset", "data-type is 'INT32'", "expects 'INT64'"], None, id="int32-frame-offset"),
    pytest.param(lambda a: code2wav_inputs(a[:, 3:4])[:1] + [raw_input("frame_offset", np.array([[3, 4]], np.int64), "INT64")],
                 ["unexpected shape for input 'frame_offset'"], None, id="frame-offset-shape"),
    pytest.param(lambda a: [raw_input("input_ids", np.ascontiguousarray(a[:, 3:5], np.int64).reshape(2, -1), "INT64")],
                 ["batch-size 1"], None, id="two-rows"),
    pytest.param(lambda a: [raw_input("frame_offset", np.array([[3]], np.int64), "INT64")],
                 ["no input_ids"], "shape", id="no-input-ids"),
    pytest.param(lambda a: code2wav_inputs(a[:, 3:4]) + [raw_input("bogus", np.array([[3]], np.int64), "INT64")],
                 ["unexpected inference input 'bogus'"], None, id="unknown-input"),
    pytest.param(lambda a: code2wav_inputs(random_codes(MAX_NEW_FRAMES_PER_REQUEST + 1, seed=MAX_NEW_FRAMES_PER_REQUEST + 1), 3),
                 ["1501 new frames", "max_new_frames_per_request=1500"], "limit", id="too-many-new-frames"),
    pytest.param(lambda a: code2wav_inputs(np.zeros((NUM_CODEBOOKS, MAX_REQUEST_FRAMES + 1), np.int64)),
                 ["45001 frames", "max_request_frames=45000"], "limit", id="too-many-frames"),
]


@pytest.mark.parametrize("build, expected, kind", BAD_REQUESTS)
def test_bad_request_names_the_problem_and_leaves_streams_as_they_were(
    code2wav_server, grpc_client, scenario, moshi_streams, ort_streams, build, expected, kind
):
    url = code2wav_server.metrics_url
    a, b = scenario.streams["A"], scenario.streams["B"]
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
    # Rejected before any decoder call.
    assert (after.code2wav_frames, after.decoder_rows) == (before.code2wav_frames, before.decoder_rows)
    assert after.live() == before.live()

    # Both streams go on exactly where they were.
    bystander_pcm.append(infer(grpc_client, bystander, b[:, 2:5], 2, end=True, new_frames=3))
    victim_pcm.append(infer(grpc_client, victim, a[:, 3:7], 3, end=True, new_frames=4))
    victim_pcm, bystander_pcm = np.concatenate(victim_pcm), np.concatenate(bystander_pcm)
    assert_matches(victim_pcm, moshi_streams["A"][: victim_pcm.size], ort_streams["A"][: victim_pcm.size], "victim")
    assert_matches(bystander_pcm, moshi_streams["B"][: bystander_pcm.size], ort_streams["B"][: bystander_pcm.size],
                   "bystander")


# ---- 5, 6. idle expiry and the cancelled-request regression, with second-scale timeouts -----------

@pytest.fixture(scope="module")
def short_timeout_server(served_repository, triton_server_factory, tmp_path_factory):
    """The served repository with idle timeouts of 2 s (code2wav) and 4 s (mimi_decoder)."""
    repository = copy_repository(served_repository, tmp_path_factory.mktemp("short_idle") / "model_repository")
    set_idle_timeout(repository, SHORT_CODE2WAV_IDLE_S)
    return triton_server_factory(repository)




def test_a_stream_sending_within_the_timeout_outlives_it(short_timeout_server, scenario, moshi_streams, ort_streams):
    a = scenario.streams["A"]
    sequence_id = new_sequence_id()
    gap_s = 0.7 * SHORT_CODE2WAV_IDLE_S
    with grpcclient.InferenceServerClient(short_timeout_server.grpc_url) as client:
        chunks = [infer(client, sequence_id, a[:, :1], 0, start=True, new_frames=1)]
        for frame in (1, 2):
            time.sleep(gap_s)
            chunks.append(infer(client, sequence_id, a[:, frame : frame + 1], frame, end=frame == 2, new_frames=1))
    pcm = np.concatenate(chunks)
    assert_matches(pcm, moshi_streams["A"][: pcm.size], ort_streams["A"][: pcm.size], "kept alive")


def test_idle_streams_expire_everywhere_without_further_requests(
    short_timeout_server, scenario, moshi_streams, ort_streams
):
    server = short_timeout_server
    a = scenario.streams["A"]
    expiring, closing = new_sequence_id(), new_sequence_id()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        baseline = ServingMetrics.read(server.metrics_url)
        first = infer(client, expiring, a[:, :4], 0, start=True, new_frames=4)
        infer(client, closing, a[:, :2], 0, start=True, new_frames=2)
        opened = ServingMetrics.read(server.metrics_url)
        idle_started = time.monotonic()
        assert opened.live() == baseline.live(2)

        # Nothing is sent while waiting: code2wav and the decoder each drop the streams by themselves.
        expired, _ = wait_for_metrics(
            server.metrics_url, lambda m: m.live() == baseline.live(), timeout_s=20
        )
        idle_s = time.monotonic() - idle_started
        assert idle_s > SHORT_CODE2WAV_IDLE_S
        if expired.decoder_expired is not None:
            assert expired.decoder_expired - baseline.decoder_expired == 2
        else:  # the native decoder: Triton drops the implicit state once the decoder's timeout has passed
            time.sleep(max(0.0, idle_started + SHORT_CODE2WAV_IDLE_S + DECODER_IDLE_MARGIN_US / 1e6 + 2.0
                           - time.monotonic()))
            idle_s = time.monotonic() - idle_started
        assert not any(decoder_holds(server.grpc_url, sequence_id) for sequence_id in (expiring, closing))
        # Continuing an expired stream is refused, saying to START.
        infer_error(client, expiring, code2wav_inputs(a[:, 4:5], 4), START_HINT)
        # START|END with no frame on an expired stream: nothing to decode, nothing to end.
        infer(client, closing, a[:, :0], start=True, end=True, new_frames=0)
        # A new START with the same id is a fresh stream.
        again = [infer(client, expiring, a[:, :1], 0, start=True, new_frames=1),
                 infer(client, expiring, a[:, 1:8], 1, end=True, new_frames=7)]
        assert client.is_server_ready()
    again = np.concatenate(again)
    assert_matches(first, moshi_streams["A"][: first.size], ort_streams["A"][: first.size], "before expiry")
    assert_matches(again, moshi_streams["A"][: again.size], ort_streams["A"][: again.size], "restarted")
    assert ServingMetrics.read(server.metrics_url).live() == baseline.live()
    print(f"\nidle streams gone from code2wav and mimi_decoder {idle_s:.1f} s after their last request "
          f"(timeouts {SHORT_CODE2WAV_IDLE_S:g} s and {SHORT_CODE2WAV_IDLE_S + DECODER_IDLE_MARGIN_US / 1e6:g} s)")


def test_cancelled_requests_then_idle_timeout_leave_no_shared_state(
    short_timeout_server, scenario, moshi_streams, ort_streams
):
    """Regression (docs/design.md §7): a cancelled request followed by an idle timeout once released
    one sequence slot twice, so that two later sequences shared one state. code2wav's stub is stopped
    (SIGSTOP) while the unary request is sent and cancelled, so it cannot be answered first."""
    server = short_timeout_server
    a, b = scenario.streams["A"], scenario.streams["B"]
    unary_cancelled, stream_cancelled = new_sequence_id(), new_sequence_id()
    baseline = ServingMetrics.read(server.metrics_url)
    code2wav_stub = stub_pid(server.pid, "code2wav")

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        infer(client, unary_cancelled, a[:, :2], 0, start=True, new_frames=2)
        outcome, done = [], threading.Event()

        def on_done(result, error):
            outcome.append((result, error))
            done.set()

        os.kill(code2wav_stub, signal.SIGSTOP)
        try:
            call = client.async_infer(MODEL_NAME, code2wav_inputs(a[:, 2:80], 2), callback=on_done,
                                      sequence_id=unary_cancelled)
            time.sleep(0.2)  # time to reach the server; what the test asserts holds if it has not
            call.cancel()
            assert done.wait(60)
        finally:
            os.kill(code2wav_stub, signal.SIGCONT)
        (result, error), = outcome
        assert result is None and error is not None and "CANCELLED" in str(error).upper(), (result, error)

    # A stream closed with requests in flight and queued behind them.
    stream = StreamingClient(server.grpc_url)
    stream.send(stream_cancelled, b[:, :1], 0, start=True)
    stream.send(stream_cancelled, b[:, 1:60], 1)
    for frame in range(60, 64):
        stream.send(stream_cancelled, b[:, frame : frame + 1], frame)
    time.sleep(0.2)
    stream.close(cancel_requests=True)

    wait_for_metrics(server.metrics_url, lambda m: m.live() == baseline.live(), timeout_s=60)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert client.is_server_ready()
        infer_error(client, unary_cancelled, code2wav_inputs(a[:, 80:81], 80), START_HINT)

    # Three streams at once, two of them on the ids of the cancelled ones: each is its own stream.
    rng = np.random.default_rng(31)
    plans = {
        "C1": StreamPlan(unary_cancelled, scenario.streams["C1"][:, :36], chunk_bounds(rng, 36, 3)),
        "C2": StreamPlan(stream_cancelled, scenario.streams["C2"][:, :36], chunk_bounds(rng, 36, 3)),
        "A": StreamPlan(new_sequence_id(), a[:, :36], chunk_bounds(rng, 36, 3), join_round=1),
    }
    run_interleaved(server.grpc_url, list(plans.values()))
    for name, plan in plans.items():
        pcm = plan.pcm()
        assert_matches(pcm, moshi_streams[name][: pcm.size], ort_streams[name][: pcm.size],
                       f"stream {plan.sequence_id} ({name}) after the cancellations")
    final = ServingMetrics.read(server.metrics_url)
    assert final.live() == baseline.live()


# ---- 7. `make serve` ----------------------------------------------------------------------------

def test_serve_exports_into_a_clean_build_folder_serves_and_stops_cleanly(tmp_path):
    http_port, grpc_port, metrics_port = free_ports(3)
    build_dir = tmp_path / "build"
    output_path = tmp_path / "serve.out"
    command = [
        sys.executable, "-m", "mimi_code2wav.server", "serve", "--random-init", "--seed", "0",
        "--build-dir", str(build_dir), "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port), "--log-file", str(tmp_path / "tritonserver.log"),
    ]
    started = time.monotonic()
    with open(output_path, "w") as output:
        cli = subprocess.Popen(command, cwd=REPO_ROOT, stdout=output, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
    server_pid = None
    try:
        wait_http_ready(http_port, cli, timeout_s=600, output=output_path, poll_s=0.5)
        ready_s = time.monotonic() - started
        server_pid = tritonserver_child(cli)
        server_group = os.getpgid(server_pid)
        shm_prefix = shm_prefix_of(server_pid)
        assert list(SHM_DIR.glob(f"{shm_prefix}*")), "the Python stubs hold shared memory while serving"
        assert (build_dir / "model_repository" / "mimi_decoder" / "1" / "model.onnx").is_file()

        codes = random_codes(3, seed=3)
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
            pcm = infer(client, new_sequence_id(), codes, 0, start=True, end=True, new_frames=3)
        assert np.all(np.isfinite(pcm)) and np.any(pcm != 0)

        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=60) == 0, output_path.read_text()
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    text = output_path.read_text()
    assert "SIGTERM: draining and stopping tritonserver" in text
    assert wait_until(lambda: not Path(f"/proc/{server_pid}").exists() and not process_group_alive(server_group), 10), \
        "tritonserver or one of its Python stubs outlived serve"
    assert all(port_is_free(port) for port in (http_port, grpc_port, metrics_port))
    assert list(SHM_DIR.glob(f"{shm_prefix}*")) == []
    print(f"\nserve from a clean build folder: ready after {ready_s:.0f} s (export included)")


# ---- the null decoder (bench target) ----------------------------------------------------------------

@pytest.mark.server
def test_null_decoder_behind_code2wav_returns_silence_of_the_right_length(onnx_fp32, tmp_path, triton_server_factory):
    """The bench target that measures the front's ceiling: code2wav in front, silence at once behind,
    requests of several frames still one decoder call each."""
    spec = export_spec(onnx_fp32)
    repository = render_repository(spec, onnx_fp32 / "model.onnx", tmp_path / "repo", "null",
                                   DecoderServing(instance_kind="KIND_CPU"))
    assert not (repository / "mimi_decoder" / "1" / "model.onnx").exists()
    server = triton_server_factory(repository)
    codes = random_codes(11, seed=3)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        sequence_id = new_sequence_id()
        first = infer(client, sequence_id, codes[:, :1], frame_offset=0, start=True, new_frames=1)
        rest = infer(client, sequence_id, codes[:, 1:], frame_offset=1, end=True, new_frames=10)
    assert first.shape == (SAMPLES_PER_FRAME,) and rest.shape == (10 * SAMPLES_PER_FRAME,)
    assert not first.any() and not rest.any()
    samples = fetch_metrics(server.metrics_url)
    assert metric_value(samples, "nv_inference_exec_count", model="mimi_decoder", version="1") == 2


@pytest.fixture(scope="module")
def null_repository_two_fronts(onnx_fp32, tmp_path_factory):
    """The null bench target with two code2wav instances (`render --front-instances 2`)."""
    spec = export_spec(onnx_fp32)
    return render_repository(spec, onnx_fp32 / "model.onnx", tmp_path_factory.mktemp("fronts") / "repo", "null",
                             DecoderServing(instance_kind="KIND_CPU", front_instances=2))


@pytest.mark.server
def test_two_front_instances_share_the_streams_and_the_bench_profile_counts_every_process(
        null_repository_two_fronts, triton_server_factory):
    """Two code2wav processes serve 6 concurrent streams (each answered in full: the streams'
    requests stay on their instance), and the bench's point profile charges the CPU time of
    tritonserver and both stubs to the requests Triton counted, with both models' batches."""
    from benchmarks.profile import PointProfile, process_role
    from benchmarks.sweep import decode_streams
    from mimi_code2wav.client.protocol import random_codes
    from mimi_code2wav.server.processes import group_pids

    server = triton_server_factory(null_repository_two_fronts)
    roles = sorted(process_role(pid) for pid in group_pids(server.pid))
    assert roles == ["stub code2wav", "stub code2wav", "stub mimi_decoder", "tritonserver"]
    profile = PointProfile(server.pid, server.metrics_url)
    profile.start()
    report = decode_streams(server.grpc_url, [random_codes(40, seed) for seed in range(6)], chunk_frames=1)
    result = profile.finish(0)
    assert [r.pcm.shape for r in report.results] == [(40 * SAMPLES_PER_FRAME,)] * 6
    assert all(not r.pcm.any() for r in report.results)
    assert result["requests"] == 6 * 40 == result["code2wav"]["requests"] == result["mimi_decoder"]["requests"]
    assert set(result["server_cpu_ms_per_request"]) == {"tritonserver", "stub code2wav", "stub mimi_decoder"}
    assert result["server_cpu_ms_per_request_total"] > 0 and result["load_cpu_ms_per_request"] > 0
    for model in ("code2wav", "mimi_decoder"):
        assert 1 <= result[model]["mean_batch"] <= 6 and result[model]["execute_ms"] > 0


# ---- 8. shutdown under traffic, the stream cap, memory per stream ---------------------------------

def _stream_until_stopped(url: str, stop: threading.Event, outcomes: list, seed: int) -> None:
    """One client stream: START, then 4-frame requests back to back until `stop` or an error;
    appends ("ok", frames) per answered request and ("error", text) for the one that failed."""
    codes = random_codes(4000, seed)
    sequence_id = new_sequence_id()
    try:
        with grpcclient.InferenceServerClient(url) as client:
            frame = 0
            while not stop.is_set() and frame + 4 <= codes.shape[1]:
                size = 1 if frame == 0 else 4
                infer(client, sequence_id, codes[:, frame : frame + size], frame, start=frame == 0, new_frames=size)
                outcomes.append(("ok", size))
                frame += size
    except InferenceServerException as exc:
        outcomes.append(("error", str(exc)))


@pytest.mark.server
def test_sigterm_with_streams_in_flight_unloads_both_models_without_waiting_out_the_exit_timeout(
        served_repository, tmp_path):
    """SIGTERM while 8 streams keep requests in flight: every request gets its answer or an error
    saying the server is shutting down; both models unload and the server exits inside the exit
    timeout the launchers use (DEFAULT_EXIT_TIMEOUT_S), with no non-graceful-termination line, no in-flight inference
    left, no process or shared memory.

    Triton counts every live sequence as an in-flight inference and no request reaches the decoder
    while the server exits (so nothing can END a sequence there): streams the clients abandon leave
    by the idle timeouts (code2wav's, and the decoder's a margin above it); the exit takes about that."""
    from mimi_code2wav.server.supervise import running_server

    log = tmp_path / "server.log"
    with running_server(served_repository, log_path=log) as server:
        assert server.exit_timeout_s == DEFAULT_EXIT_TIMEOUT_S
        stop, outcomes = threading.Event(), [[] for _ in range(8)]
        threads = [threading.Thread(target=_stream_until_stopped, args=(server.grpc_url, stop, outcomes[i], 50 + i),
                                    daemon=True) for i in range(8)]
        for thread in threads:
            thread.start()
        assert wait_until(lambda: all(sum(1 for kind, _ in o if kind == "ok") >= 3 for o in outcomes), 120), \
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
    assert code == 0, text[-3000:]
    assert exit_s < DEFAULT_EXIT_TIMEOUT_S, f"exit took {exit_s:.1f} s:\n{text[-3000:]}"
    assert "Non-graceful termination" not in text and "Exit timeout expired" not in text, text[-3000:]
    for model in ("code2wav", "mimi_decoder"):
        assert f"successfully unloaded '{model}' version 1" in text, text[-3000:]
    counts = [int(n) for n in re.findall(r"Found (\d+) model versions that have in-flight inferences", text)]
    assert counts and counts[-1] == 0, text[-3000:]
    errors = [message for stream in outcomes for kind, message in stream if kind == "error"]
    assert len(errors) <= len(outcomes), errors
    for message in errors:
        assert "the server is shutting down" in message and "StatusCode.UNAVAILABLE" in message, message
    assert "Traceback" not in text, "a shutdown error was logged as a server fault"
    # code2wav's stub writes its threads' stacks here if it dies (faulthandler), the exit included
    assert "Fatal Python error" not in text, text[-3000:]
    assert not process_group_alive(pgid)
    assert list(SHM_DIR.glob(f"{prefix}*")) == []
    print(f"\nSIGTERM with 8 streams in flight: exited in {exit_s:.1f} s; "
          f"{sum(kind == 'ok' for o in outcomes for kind, _ in o)} requests answered, "
          f"{sum(kind == 'error' for o in outcomes for kind, _ in o)} refused")


@pytest.fixture(scope="module", params=["null", "onnxruntime"])
def capped_server(request, onnx_fp32, tmp_path_factory, triton_server_factory):
    """code2wav over the null decoder, then the native one, rendered for a capacity of 3 streams."""
    spec = export_spec(onnx_fp32)
    repository = render_repository(spec, onnx_fp32 / "model.onnx", tmp_path_factory.mktemp("capped") / "repo",
                                   require_target(request.param),
                                   DecoderServing(instance_kind="KIND_CPU", max_candidate_sequences=3))
    server = triton_server_factory(repository)
    server.decoder_target = request.param
    return server


def decoder_start_is_queued(grpc_url: str, sequence_id: int) -> bool:
    """A START|END step sent straight to the decoder is neither answered nor refused within 2 s: with
    every candidate slot taken, Triton's `oldest` batcher keeps a new sequence in its backlog until a
    slot frees (docs/design.md §7); the step runs then and ends at once."""
    with grpcclient.InferenceServerClient(grpc_url) as client:
        try:
            client.infer("mimi_decoder", decoder_step_inputs(), sequence_id=sequence_id, sequence_start=True,
                         sequence_end=True, client_timeout=2.0)
        except InferenceServerException as error:
            return "Deadline" in str(error) or "DEADLINE_EXCEEDED" in str(error)
    return False


@pytest.mark.server
def test_a_start_past_the_stream_cap_is_refused_and_harms_no_live_stream(capped_server):
    codes = random_codes(3, seed=3)
    url = capped_server.grpc_url
    with grpcclient.InferenceServerClient(url) as client:
        live = [new_sequence_id() for _ in range(3)]
        for sequence_id in live:
            infer(client, sequence_id, codes[:, :1], 0, start=True, new_frames=1)
        if capped_server.decoder_target == "onnxruntime":
            # What a START past max_candidate_sequences gets from the native decoder itself: a place in
            # the backlog, not an answer; hence code2wav refuses first.
            assert decoder_start_is_queued(url, new_sequence_id())
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
    samples = fetch_metrics(capped_server.metrics_url)
    assert metric_value(samples, "code2wav_errors_total", kind="stream_cap") == 1


@pytest.mark.server
def test_memory_per_live_stream_and_after_expiry(decoder_target, served_repository, tmp_path):
    """32 streams opened and abandoned, three times (docs/design.md §5.1), the server's memory (PSS
    of the whole process group) read idle, with them live and after both models expired them.

    The native decoder's state is Triton's: one buffer per state and
    sequence slot (use_same_buffer_for_input_output), held by the slot until a new sequence takes it,
    plus ONNX Runtime's arena for the largest batch; so memory stays at the peak after expiry, and
    later rounds of as many streams reuse it: each stays within 2% of the first. Here the decoder
    batches each step of a round's 32 streams as one (preferred batch size 32, a long queue delay), so
    that every round runs the same batch shapes: with the served config a round's batches vary, and a
    round whose batch is the largest yet grows ONNX Runtime's arena once. So this checks that slots and
    their buffers are reused, not the memory patterns the config turns off (test_configs checks the
    setting; `python -m benchmarks memory` measures its effect)."""
    from benchmarks.memory import open_streams, snapshot, wait_expired
    from mimi_code2wav.server.supervise import running_server

    if decoder_target == "python-ort":
        pytest.skip("python-ort, the development decoder, leaves its memory to ONNX Runtime's arena "
                    "(docs/design.md §5.1): memory is measured on the native decoder")
    repository = copy_repository(served_repository, tmp_path / "model_repository")
    set_idle_timeout(repository, 4.0)
    config = repository / "mimi_decoder" / "config.pbtxt"
    text, count = re.subn(r"preferred_batch_size: \[[^\]]*\]\s*max_queue_delay_microseconds: \d+",
                          "preferred_batch_size: [ 32 ] max_queue_delay_microseconds: 1000000", config.read_text())
    assert count == 1, "the decoder config's batching block changed"
    config.write_text(text)
    state_mib = 8177156 / 2**20
    with running_server(repository, log_path=tmp_path / "server.log") as server:

        def expire() -> None:  # both models' timeouts (the native decoder's waited out), then python-ort's scratch
            wait_expired(server.metrics_url, 60, DECODER_IDLE_MARGIN_US / 1e6 + 0.5)
            time.sleep(2)

        open_streams(server.grpc_url, 1, 1, [1, 4], 0)  # warm-up: one stream, then idle
        expire()
        idle = snapshot(server.pid, "idle", {})
        open_streams(server.grpc_url, 100, 32, [1, 4, 4], 100)
        peak = snapshot(server.pid, "32 live", {})
        expire()
        after = snapshot(server.pid, "expired", {})
        # code2wav counts what it forgot without an END: the warm-up stream and the 32.
        assert metric_value(fetch_metrics(server.metrics_url), "code2wav_expired_streams_total") == 33
        open_streams(server.grpc_url, 200, 32, [1, 4, 4], 200)
        peak_again = snapshot(server.pid, "32 live again", {})
        expire()
        after_again = snapshot(server.pid, "expired again", {})
        open_streams(server.grpc_url, 300, 32, [1, 4, 4], 300)
        peak_third = snapshot(server.pid, "32 live, third round", {})
        expire()
        after_third = snapshot(server.pid, "expired, third round", {})
    per_stream = (peak["pss_mib"] - idle["pss_mib"]) / 32
    print(f"\n{decoder_target}: PSS idle {idle['pss_mib']:.0f} MiB, 32 live {peak['pss_mib']:.0f} MiB "
          f"({per_stream:.1f} MiB per stream, state {state_mib:.2f}), after expiry "
          f"{after['pss_mib']:.0f} MiB; again {peak_again['pss_mib']:.0f} MiB live, {after_again['pss_mib']:.0f} MiB expired; "
          f"third round {peak_third['pss_mib']:.0f} MiB live, {after_third['pss_mib']:.0f} MiB expired")
    # The state once per stream, plus ONNX Runtime's scratch for batches of up to 32 rows.
    assert per_stream <= 5 * state_mib, f"{per_stream:.1f} MiB per live stream"
    for later in (after, peak_again, after_again, peak_third, after_third):
        assert later["pss_mib"] <= 1.02 * peak["pss_mib"], \
            f"a later round of streams added to the memory: {later['pss_mib']:.0f} MiB ({later['label']}) after {peak['pss_mib']:.0f}"
