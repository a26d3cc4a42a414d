"""Resume by replay through real tritonservers: code2wav's `history_frames` contract, and the
resumable client (`client.Code2WavStream`) carrying a stream over the loss of its server.

The served decoder is the real-architecture ONNX export with seeded random weights (`onnx_fp32`).
References: moshi's streaming decode of the scenario streams, and the same ONNX step run alone in
ONNX Runtime for longer streams. A stream resumed with its whole history is "equal" (docs/design.md
§2.3: max abs 1e-4, >= 100 dB) to the uninterrupted decode; with the last R frames as history it is
close, by how much depends on R (`python -m benchmarks resume` measures it).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from mimi_code2wav.client.protocol import SAMPLES_PER_FRAME, StreamOptions, random_codes
from mimi_code2wav.client.sync import Code2WavClient
from mimi_code2wav.export.reference import snr_db
from mimi_code2wav.server.triton import fetch_metrics, metric_value

from helpers import code2wav_inputs, frames_of, infer, infer_error, send_in_chunks, sequence_ids, wait_until
from mimi_fixtures import assert_equal_audio, fixtures_on_each_target

pytestmark = [pytest.mark.server, pytest.mark.slow]

# Resume runs on both decoder targets (python-ort, then the native onnxruntime backend).
decoder_target, served_repository, code2wav_server = fixtures_on_each_target()

FRAMES_PER_SECOND = 12.5
# After a resume with R = 250 frames of history, the resumed audio stays this close to the
# uninterrupted decode (SNR, whole tail and first second). Measured on this test's stream: ~86 dB
# over the first second (see test_failover_after_sigkill_with_a_request_in_flight's output); the
# bound leaves a margin of over 20 dB.
RESUMED_R250_MIN_SNR_DB = 60.0
FAILOVER_RESUME_FRAME = 300
FAILOVER_FRAMES = 340

# Sequence ids of their own, far from those of the other test modules on the shared server.
new_sequence_id = sequence_ids(9_100_001)


# ---- the contract on a real server -----------------------------------------------------------------

RESUME_AT = 70  # stream A (168 frames) resumes here


def resumed_decode(client, codes, resume_at, history_frames, first_new_frames=16) -> np.ndarray:
    """Decode frames [0, resume_at) in one sequence, then a new sequence START at resume_at -
    history_frames with that much history and `first_new_frames` new frames, then the rest (both
    sequences ENDed). Returns the PCM of every frame, once."""
    before = send_in_chunks(client, new_sequence_id(), codes, 0, resume_at, start=True)
    sequence_id = new_sequence_id()
    history_from = resume_at - history_frames
    stop = resume_at + first_new_frames
    after = [infer(client, sequence_id, codes[:, history_from:stop], history_from, start=True,
                   new_frames=first_new_frames, history_frames=history_frames)]
    after += send_in_chunks(client, sequence_id, codes, stop, codes.shape[1])
    return np.concatenate(before + after)


def test_a_stream_resumed_with_its_whole_history_equals_the_uninterrupted_one(grpc_client, scenario, moshi_streams):
    codes = scenario.streams["A"]
    pcm = resumed_decode(grpc_client, codes, RESUME_AT, history_frames=RESUME_AT)
    assert pcm.shape == (codes.shape[1] * SAMPLES_PER_FRAME,)
    assert_equal_audio(pcm, moshi_streams["A"], what="resumed at frame 70 with frames [0, 70) as history, vs moshi")


def test_a_stream_resumed_with_25_frames_of_history_returns_only_new_frames(grpc_client, scenario, moshi_streams):
    codes, reference = scenario.streams["A"], moshi_streams["A"]
    pcm = resumed_decode(grpc_client, codes, RESUME_AT, history_frames=25)
    assert pcm.shape == reference.shape  # every frame once: no history audio came back
    assert_equal_audio(frames_of(pcm, 0, RESUME_AT), frames_of(reference, 0, RESUME_AT), what="before the resume")
    first_second = int(np.ceil(FRAMES_PER_SECOND))
    snr_first_s = snr_db(frames_of(pcm, RESUME_AT, RESUME_AT + first_second),
                         frames_of(reference, RESUME_AT, RESUME_AT + first_second))
    snr_tail = snr_db(frames_of(pcm, RESUME_AT), frames_of(reference, RESUME_AT))
    print(f"\nresumed at frame {RESUME_AT} with 25 frames of history: SNR vs uninterrupted {snr_first_s:.1f} dB "
          f"(first second), {snr_tail:.1f} dB (frames {RESUME_AT}-{codes.shape[1]})")
    # Related to the uninterrupted audio (measured: 28 dB over the first second), but far from equal:
    # 2 s of history do not rebuild the state.
    assert 10.0 < snr_first_s < 60.0


def _counters(server) -> dict[str, float]:
    samples = fetch_metrics(server.metrics_url)
    counters = {kind: metric_value(samples, "code2wav_errors_total", kind=kind) or 0.0
                for kind in ("history", "history_offset", "before_resume")}
    counters["resumed"] = metric_value(samples, "code2wav_resumed_streams_total") or 0.0
    return counters


def test_a_resumed_stream_refuses_offsets_before_its_resume_point_and_misplaced_history(
        code2wav_server, grpc_client, scenario):
    codes = scenario.streams["B"]
    sequence_id = new_sequence_id()
    before = _counters(code2wav_server)
    pcm = infer(grpc_client, sequence_id, codes[:, 20:30], 20, start=True, new_frames=4, history_frames=6)
    assert pcm.size == 4 * SAMPLES_PER_FRAME
    infer_error(grpc_client, sequence_id, code2wav_inputs(codes[:, 19:32], 19),
                f"frame_offset 19 is before frame 20, where stream {sequence_id} was resumed on this server",
                "frames before 20 are not held here", kind="before_resume")
    infer_error(grpc_client, sequence_id, code2wav_inputs(codes[:, 29:31], 29, 1),
                "history_frames=1 on a continuing stream needs frame_offset=30, the stream's next frame (got 29)",
                kind="history_offset")
    infer_error(grpc_client, new_sequence_id(), code2wav_inputs(codes[:, :3], 0, 4),
                "history_frames=4 must lie in [0, 3]", start=True, kind="history")
    infer_error(grpc_client, new_sequence_id(), code2wav_inputs(codes[:, :3], None, 2),
                "history_frames=2 needs frame_offset", start=True, kind="history")
    # The stream is still there: offsets are absolute, an overlap with the decoded frames decodes the rest.
    pcm = infer(grpc_client, sequence_id, codes[:, 28:33], 28, end=True, new_frames=3)
    assert pcm.size == 3 * SAMPLES_PER_FRAME
    after = _counters(code2wav_server)
    assert {name: after[name] - before[name] for name in after} == {"history": 2, "history_offset": 1, "before_resume": 1, "resumed": 1}


# ---- the resumable client ----------------------------------------------------------------------------

def test_a_stream_its_server_forgot_is_resumed_on_the_same_server(code2wav_server, grpc_client, ort_decode):
    """The server loses the stream (here: someone else ENDs the sequence; a restart or an idle timeout
    forgets it the same way): Triton answers the next request that it must carry the START flag, and
    the client STARTs the sequence again with its whole history (fewer than R frames): exact."""
    codes = random_codes(60, seed=41)
    stream = Code2WavClient(code2wav_server.grpc_url, StreamOptions(resume_history_frames=250)).stream(sequence_id=new_sequence_id(), stream_key="forgotten")
    with stream:
        pcm = [stream.decode(codes[:, :1]), stream.decode(codes[:, 1:24])]
        infer(grpc_client, stream.sequence_id, codes[:, 24:25], 24, end=True, new_frames=1)  # not the client
        pcm += [stream.decode(codes[:, 24:40]), stream.decode(codes[:, 40:60], end=True)]
    (resume,) = stream.resumes
    assert (resume.frame, resume.history_frames, resume.attempts) == (24, 24, 1)
    assert resume.error == (f"INVALID_ARGUMENT: inference request for sequence {stream.sequence_id} to model "
                            "'code2wav' must specify the START flag on the first request of the sequence")
    assert_equal_audio(np.concatenate(pcm), ort_decode(codes, frames_per_call=16),
                       what="resumed with the whole history vs ONNX step")


def test_failover_after_sigkill_with_a_request_in_flight(served_repository, code2wav_server, ort_decode, tmp_path):
    """Two plain servers, A (started here) and B (the session's). A stream decodes 300 frames on A;
    then A is frozen (SIGSTOP), the next request is sent, and A is killed (SIGKILL) with that request
    in flight. The client resumes on B with 250 frames of history and the lost request's frames as
    new ones: every frame's PCM once, the audio before the failure equal to the solo decode, the
    audio after it within RESUMED_R250_MIN_SNR_DB of the uninterrupted decode."""
    from mimi_code2wav.server.supervise import running_server

    codes = random_codes(FAILOVER_FRAMES, seed=43)
    reference = ort_decode(codes, frames_per_call=16)
    t = FAILOVER_RESUME_FRAME
    with running_server(served_repository, log_path=tmp_path / "server-a.log") as server_a:
        stream = Code2WavClient([server_a.grpc_url, code2wav_server.grpc_url], StreamOptions(resume_history_frames=250, response_timeout_s=30.0)).stream(sequence_id=new_sequence_id(), stream_key="failover")
        with stream:
            pcm = [stream.decode(codes[:, :1])]
            pcm += [stream.decode(codes[:, first : min(first + 16, t)]) for first in range(1, t, 16)]
            assert stream.url == server_a.grpc_url and stream.resumes == []
            os.killpg(server_a.pid, signal.SIGSTOP)  # A and its stubs: the request will not be answered
            answer: list = []

            def send_the_request_that_gets_lost():
                try:
                    answer.append(stream.decode(codes[:, t : t + 16]))
                except BaseException as exc:  # reported below, in the test's thread
                    answer.append(exc)

            sender = threading.Thread(target=send_the_request_that_gets_lost, daemon=True)
            sent_s = time.monotonic()
            sender.start()
            time.sleep(0.5)
            os.killpg(server_a.pid, signal.SIGKILL)
            sender.join(timeout=120)
            assert answer, "the request in flight was never answered"
            assert not isinstance(answer[0], BaseException), f"the stream did not resume: {answer[0]}"
            pcm += answer
            pcm.append(stream.decode(codes[:, t + 16 :], end=True))
            done_s = time.monotonic() - sent_s
        assert wait_until(lambda: not server_a.is_alive(), 10)
    pcm = np.concatenate(pcm)
    assert pcm.shape == reference.shape, "a frame's audio is missing or repeated"
    (resume,) = stream.resumes
    assert (resume.frame, resume.url, resume.history_frames) == (t, code2wav_server.grpc_url, 250)
    assert resume.error.startswith("UNAVAILABLE"), resume.error
    assert_equal_audio(frames_of(pcm, 0, t), frames_of(reference, 0, t), what="before the failure vs solo")
    first_second = int(np.ceil(FRAMES_PER_SECOND))
    snr_first_s = snr_db(frames_of(pcm, t, t + first_second), frames_of(reference, t, t + first_second))
    snr_tail = snr_db(frames_of(pcm, t), frames_of(reference, t))
    print(f"\nfailover at frame {t} with 250 frames of history: SNR vs uninterrupted {snr_first_s:.1f} dB (first "
          f"second), {snr_tail:.1f} dB (frames {t}-{FAILOVER_FRAMES}); {resume.describe()}; "
          f"{done_s:.2f} s from the lost request to the end of the stream")
    assert snr_first_s >= RESUMED_R250_MIN_SNR_DB and snr_tail >= RESUMED_R250_MIN_SNR_DB
