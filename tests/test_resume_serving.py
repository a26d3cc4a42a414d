"""Resume by replay on real tritonservers: the `history_frames` contract and the resumable client over a lost server.
With its whole history a resumed stream equals the uninterrupted decode (docs/design.md §2.3); with R frames, close."""

from __future__ import annotations

import concurrent.futures
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from mimi_code2wav.client.protocol import StreamOptions, random_codes
from mimi_code2wav.client.sync import Code2WavClient

from helpers import (
    code2wav_inputs,
    frames_of,
    infer,
    infer_error,
    metric,
    send_in_chunks,
    sequence_ids,
    snr_after,
    wait_until,
)
from mimi_fixtures import assert_equal_audio, fixtures_on_each_target

pytestmark = [pytest.mark.server, pytest.mark.slow]

decoder_target, served_repository, code2wav_server = fixtures_on_each_target()

# The resumed audio vs the uninterrupted decode with R = 250 frames of history (the failover test prints it).
RESUMED_R250_MIN_SNR_DB = 60.0
RESUME_AT = 70  # stream A (168 frames) resumes here

new_sequence_id = sequence_ids(9_100_001)


def resumed_decode(client, codes, resume_at, history_frames, first_new_frames=16) -> np.ndarray:
    """Frames [0, resume_at) in one sequence, the rest in a new one STARTed with `history_frames` of history (both
    ENDed); returns the PCM of every frame, once."""
    before = send_in_chunks(client, new_sequence_id(), codes, 0, resume_at, start=True)
    sequence_id, history_from, stop = new_sequence_id(), resume_at - history_frames, resume_at + first_new_frames
    after = [infer(client, sequence_id, codes[:, history_from:stop], history_from, start=True,
                   new_frames=first_new_frames, history_frames=history_frames)]
    after += send_in_chunks(client, sequence_id, codes, stop, codes.shape[1])
    return np.concatenate(before + after)


def test_a_resumed_stream_returns_only_new_frames_and_refuses_misplaced_offsets_and_history(
        code2wav_server, grpc_client, scenario, moshi_streams):
    codes, reference = scenario.streams["A"], moshi_streams["A"]
    whole = resumed_decode(grpc_client, codes, RESUME_AT, history_frames=RESUME_AT)
    assert_equal_audio(whole, reference, what=f"resumed at frame {RESUME_AT} with its whole history, vs moshi")
    pcm = resumed_decode(grpc_client, codes, RESUME_AT, history_frames=25)
    assert pcm.shape == reference.shape  # every frame once: no history audio came back
    assert_equal_audio(frames_of(pcm, 0, RESUME_AT), frames_of(reference, 0, RESUME_AT), what="before the resume")
    snr_first_s, snr_tail = snr_after(pcm, reference, RESUME_AT)
    print(f"\nresumed at frame {RESUME_AT} with 25 frames of history: SNR vs uninterrupted {snr_first_s:.1f} dB "
          f"(first second), {snr_tail:.1f} dB (the rest)")
    # Related to the uninterrupted audio, but far from equal: 2 s of history do not rebuild the state.
    assert 10.0 < snr_first_s < 60.0

    codes, sequence_id = scenario.streams["B"], new_sequence_id()
    kinds = ("history", "history_offset", "before_resume")

    def counters() -> list[float]:
        return [metric(code2wav_server, "code2wav_errors_total", kind=kind) for kind in kinds] + [
            metric(code2wav_server, "code2wav_resumed_streams_total")]

    before = counters()
    infer(grpc_client, sequence_id, codes[:, 20:30], 20, start=True, new_frames=4, history_frames=6)
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
    infer(grpc_client, sequence_id, codes[:, 28:33], 28, end=True, new_frames=3)
    assert [a - b for a, b in zip(counters(), before)] == [2, 1, 1, 1]  # the three error kinds, then resumed streams


def test_a_stream_its_server_forgot_is_resumed_on_the_same_server(code2wav_server, grpc_client, ort_decode):
    """Another client ENDs the sequence (as a restart or idle timeout would forget it): Triton asks for START, and the
    client STARTs again with its whole history (fewer than R frames): exact."""
    codes = random_codes(60, seed=41)
    client = Code2WavClient(code2wav_server.grpc_url, StreamOptions(resume_history_frames=250))
    stream = client.stream(sequence_id=new_sequence_id(), stream_key="forgotten")
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


def tcp_sockets(port: int) -> list[tuple[str, int, str]]:
    """(state, bytes received and not read, remote address) of each TCP socket on local `port`."""
    rows = [line.split() for table in ("/proc/net/tcp", "/proc/net/tcp6") if Path(table).exists()
            for line in Path(table).read_text().splitlines()[1:]]
    return [(row[3], int(row[4].split(":")[1], 16), row[2]) for row in rows if int(row[1].rsplit(":", 1)[1], 16) == port]


def unread_bytes(port: int) -> int:
    """Bytes that reached connections to local `port` (established, or closed by the peer) that no process read."""
    return sum(unread for state, unread, _ in tcp_sockets(port) if state in ("01", "08"))


def test_failover_after_sigkill_with_a_request_in_flight(served_repository, code2wav_server, ort_decode, tmp_path):
    """300 frames on server A, which is frozen (SIGSTOP), sent a request (unread in its socket) and killed: the client
    resumes on B with 250 frames of history; every frame once, equal before the failure, close after it."""
    from mimi_code2wav.server.supervise import running_server

    codes, t = random_codes(340, seed=43), 300
    reference = ort_decode(codes, frames_per_call=16)
    with running_server(served_repository, log_path=tmp_path / "server-a.log") as server_a:
        client = Code2WavClient([server_a.grpc_url, code2wav_server.grpc_url],
                                StreamOptions(resume_history_frames=250, response_timeout_s=30.0))
        stream = client.stream(sequence_id=new_sequence_id(), stream_key="failover")
        with stream:
            pcm = [stream.decode(codes[:, :1])]
            pcm += [stream.decode(codes[:, first : min(first + 16, t)]) for first in range(1, t, 16)]
            assert stream.url == server_a.grpc_url and stream.resumes == []
            os.killpg(server_a.pid, signal.SIGSTOP)  # A and its stubs: the request will not be answered
            unread_before = unread_bytes(server_a.grpc_port)
            with concurrent.futures.ThreadPoolExecutor(1) as sender:
                lost = sender.submit(stream.decode, codes[:, t : t + 16])
                # The request holds 16 frames of 8 int64 codes.
                assert wait_until(lambda: unread_bytes(server_a.grpc_port) > unread_before + 16 * 8 * 8, 60), (
                    f"the request did not reach A: sockets {tcp_sockets(server_a.grpc_port)} (before: {unread_before} B"
                    f" unread), the call {lost.exception() if lost.done() else 'waiting'}, {stream.resumes}")
                os.killpg(server_a.pid, signal.SIGKILL)
                pcm.append(lost.result(timeout=120))  # raises the stream's error if it did not resume
            pcm.append(stream.decode(codes[:, t + 16 :], end=True))
        assert wait_until(lambda: not server_a.is_alive(), 60)
    pcm = np.concatenate(pcm)
    assert pcm.shape == reference.shape, "a frame's audio is missing or repeated"
    (resume,) = stream.resumes
    assert (resume.frame, resume.url, resume.history_frames) == (t, code2wav_server.grpc_url, 250)
    assert resume.error.startswith("UNAVAILABLE"), resume.error
    assert_equal_audio(frames_of(pcm, 0, t), frames_of(reference, 0, t), what="before the failure vs solo")
    snr_first_s, snr_tail = snr_after(pcm, reference, t)
    print(f"\nfailover at frame {t} with 250 frames of history: SNR vs uninterrupted {snr_first_s:.1f} dB (first "
          f"second), {snr_tail:.1f} dB (the rest); {resume.describe()}")
    assert snr_first_s >= RESUMED_R250_MIN_SNR_DB and snr_tail >= RESUMED_R250_MIN_SNR_DB
