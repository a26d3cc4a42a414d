"""The asyncio client: its queueing over a fake server; against real tritonservers, many conversations on one
channel, cancellation and a lost server resumed by replay, each equal to moshi's streaming decode."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import types

import numpy as np
import pytest

from mimi_code2wav.client import protocol
from mimi_code2wav.client.aio import Code2WavClient
from mimi_code2wav.client.protocol import SAMPLES_PER_FRAME, ClientError, StreamOptions

from helpers import metric
from mimi_fixtures import assert_equal_audio

# Sequence ids of their own, far from those of the other test modules on the shared server.
_SEQUENCE_IDS = itertools.count(9_300_001)


async def decode_stream(client: Code2WavClient, codes: np.ndarray, calls: list[tuple[int, int]]) -> np.ndarray:
    """One conversation: the calls in order, then END; its PCM, checked call by call."""
    pcm = []
    async with client.stream(sequence_id=next(_SEQUENCE_IDS)) as stream:
        for first, stop in calls:
            pcm.append(await stream.decode(codes[:, first:stop]))
            assert pcm[-1].shape == ((stop - first) * SAMPLES_PER_FRAME,) and pcm[-1].dtype == np.float32
    assert stream.ended and stream.next_frame == codes.shape[1]
    return np.concatenate(pcm)


# ---- units ------------------------------------------------------------------------------------------

def test_the_client_refuses_offsetless_requests_and_empty_url_lists():
    with pytest.raises(ClientError, match="sends frame_offset with every request"):
        Code2WavClient("a:1", StreamOptions(send_frame_offset=False))
    with pytest.raises(ClientError, match="at least one server URL"):
        Code2WavClient([])


def test_calls_waiting_behind_a_request_go_together_each_getting_its_own_frames_up_to_max_pending_calls():
    """Calls piled up behind the request in flight go as one request (at most COALESCE_MAX_FRAMES frames),
    each returning exactly its frames' PCM; a call past max_pending_calls is refused, handing nothing over."""
    from mimi_code2wav.client.aio import COALESCE_MAX_FRAMES

    async def scenario():
        frames = 2 + COALESCE_MAX_FRAMES + 3
        client = Code2WavClient("a:1", max_pending_calls=frames - 1)
        sent, answer = [], asyncio.Event()

        async def infer(stream, request):  # a server whose PCM of frame f is all f, answering when told to
            sent.append((request.first_new_frame, request.new_frames))
            await answer.wait()
            pcm = np.repeat(np.arange(request.first_new_frame, request.first_new_frame + request.new_frames,
                                      dtype=np.float32), SAMPLES_PER_FRAME)
            return types.SimpleNamespace(as_numpy={"model_outputs": pcm}.get)

        client._infer = infer
        stream = client.stream(sequence_id=7)
        codes = np.zeros((8, frames + 1), np.int64)
        calls = [asyncio.ensure_future(stream.decode(codes[:, f : f + 1], end=f == frames - 1)) for f in range(frames)]
        await asyncio.sleep(0)
        with pytest.raises(ClientError, match=rf"{frames - 1} calls already wait .* \(max_pending_calls={frames - 1}\)"):
            await stream.decode(codes[:, frames:])
        assert stream._plan.handed_frames == frames  # the refused call handed nothing over
        answer.set()
        pcm = await asyncio.gather(*calls)
        assert [p.tolist() for p in pcm] == [[float(f)] * SAMPLES_PER_FRAME for f in range(frames)]
        assert stream.ended and stream.next_frame == frames
        await stream.close()  # ended: nothing more is sent
        await client.stream().close()  # a stream that sent nothing sends nothing
        assert sent == [(0, 1), (1, COALESCE_MAX_FRAMES), (1 + COALESCE_MAX_FRAMES, 4)]

    asyncio.run(scenario())


# ---- against a real server --------------------------------------------------------------------------

@pytest.mark.server
def test_check_ready_passes_on_a_ready_server_and_checks_every_url(code2wav_server):
    """(What it says about a server down or a model not ready: test_client.py's CLI tests.)"""
    from mimi_code2wav.server.triton import free_ports

    async def check(*urls):
        async with Code2WavClient(list(urls)) as client:
            await client.check_ready(timeout_s=5)

    asyncio.run(check(code2wav_server.grpc_url))
    with pytest.raises(ClientError, match=r"cannot reach Triton \(gRPC\) at 127.0.0.1:\d+: .*is the server running\?"):
        asyncio.run(check(code2wav_server.grpc_url, f"127.0.0.1:{free_ports(1)[0]}"))


@pytest.mark.server
def test_many_streams_share_one_client_and_channel_and_equal_moshi(code2wav_server, scenario, moshi_streams):
    """Eight conversations at once over one client: each equal to moshi's, all ENDed by their close."""
    names = [*scenario.streams] * 2

    async def run():
        async with Code2WavClient(code2wav_server.grpc_url) as client:
            codes = [scenario.streams[name] for name in names]
            pcm = await asyncio.gather(*(decode_stream(client, c, protocol.chunk_bounds(c.shape[1], 5)) for c in codes))
            assert list(client._channels) == [code2wav_server.grpc_url]
        return pcm

    for name, pcm in zip(names, asyncio.run(run())):
        assert_equal_audio(pcm, moshi_streams[name], what=f"stream {name} over the asyncio client vs moshi")
    assert metric(code2wav_server, "code2wav_live_streams") == 0


@pytest.mark.server
def test_a_cancelled_call_leaves_the_stream_consistent(code2wav_server, scenario, moshi_streams):
    """Cancelled: a call waiting behind another (never sent), a call whose answer was abandoned once decoded,
    a call in flight. Each next call carries the owed frames again and returns its own, equal to moshi's."""
    codes, reference = scenario.streams["A"], moshi_streams["A"]

    async def run():
        async with Code2WavClient(code2wav_server.grpc_url) as client:
            infer, abandon = client._infer, set()

            async def infer_then_maybe_abandon(stream, request):
                outcome = await infer(stream, request)
                if request.first_new_frame in abandon:  # decoded; the caller is cancelled now
                    abandon.discard(request.first_new_frame)
                    asyncio.current_task().cancel()
                    await asyncio.sleep(0)
                return outcome

            client._infer = infer_then_maybe_abandon
            stream = client.stream(sequence_id=next(_SEQUENCE_IDS))
            heard = {}  # first frame -> PCM of the calls that returned
            heard[0] = await stream.decode(codes[:, :10])
            # Waiting behind the request in flight, cancelled before it is sent.
            in_flight = asyncio.ensure_future(stream.decode(codes[:, 10:20]))
            waiting = asyncio.ensure_future(stream.decode(codes[:, 20:24]))
            await asyncio.sleep(0)
            waiting.cancel()
            heard[10] = await in_flight
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert (stream.next_frame, stream._plan.handed_frames) == (20, 24)
            heard[24] = await stream.decode(codes[:, 24:30])  # carries 20-23 again: decoded now, not returned
            # Decoded by the server, the answer abandoned.
            abandon.add(30)
            with pytest.raises(asyncio.CancelledError):
                await stream.decode(codes[:, 30:40])
            assert (stream.next_frame, stream._plan.handed_frames) == (30, 40)
            heard[40] = await stream.decode(codes[:, 40:45])  # carries 30-39 again: the server has them
            # Cancelled while its request is in flight (decoded or not: either is consistent).
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(stream.decode(codes[:, 45:61]), timeout=0.001)
            heard[61] = await stream.decode(codes[:, 61:80], end=True)
            assert stream.ended and stream.resumes == []
        return heard

    heard = asyncio.run(run())
    for first, pcm in heard.items():
        stop = first + len(pcm) // SAMPLES_PER_FRAME
        assert_equal_audio(pcm, reference[first * SAMPLES_PER_FRAME : stop * SAMPLES_PER_FRAME],
                           what=f"frames [{first}, {stop}) vs moshi")
    assert sorted(heard) == [0, 10, 24, 40, 61] and len(heard[61]) == 19 * SAMPLES_PER_FRAME
    assert metric(code2wav_server, "code2wav_live_streams") == 0


@pytest.mark.server
@pytest.mark.slow
def test_streams_of_a_lost_server_resume_on_the_next_one(served_repository, code2wav_server, scenario, moshi_streams,
                                                         tmp_path):
    """Four conversations decode 40 frames on A; A freezes (a request misses its deadline), then is killed
    with their next requests in flight. Each resumes on B with its whole history: every frame once, = moshi."""
    from mimi_code2wav.server.supervise import running_server

    names = list(scenario.streams)
    with running_server(served_repository, log_path=tmp_path / "server-a.log") as server_a:

        async def conversation(client, codes, at_frame_40: list, frozen: asyncio.Event):
            stream = client.stream(stream_key=f"aio-{next(_SEQUENCE_IDS)}")
            pcm = [await stream.decode(codes[:, :1])]
            pcm += [await stream.decode(codes[:, first : first + 13]) for first in range(1, 40, 13)]
            at_frame_40.append(stream)
            await frozen.wait()
            pcm += [await stream.decode(codes[:, 40:56])]
            pcm += [await stream.decode(codes[:, 56:], end=True)]
            return stream, np.concatenate(pcm)

        async def run():
            urls = [server_a.grpc_url, code2wav_server.grpc_url]
            async with Code2WavClient(urls, StreamOptions(response_timeout_s=60.0)) as client:
                at_frame_40, frozen = [], asyncio.Event()
                conversations = asyncio.gather(*(conversation(client, scenario.streams[name], at_frame_40, frozen)
                                                 for name in names))
                while len(at_frame_40) < len(names):
                    await asyncio.sleep(0.01)
                assert {stream.url for stream in at_frame_40} == {server_a.grpc_url}
                os.killpg(server_a.pid, signal.SIGSTOP)  # A and its stubs: no request will be answered
                # The per-request deadline: a stream with nowhere else to go gives up, saying why.
                options = StreamOptions(response_timeout_s=0.5, resume_timeout_s=1.0)
                async with Code2WavClient(server_a.grpc_url, options) as frozen_only:
                    with pytest.raises(ClientError, match=r"could not resume .*DEADLINE_EXCEEDED: no answer in time"):
                        await frozen_only.stream().decode(scenario.streams["A"][:, :1])
                frozen.set()
                while any(stream._plan.handed_frames < 56 for stream in at_frame_40):  # their requests are out
                    await asyncio.sleep(0.01)
                os.killpg(server_a.pid, signal.SIGKILL)
                return await conversations

        try:
            results = asyncio.run(run())
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server_a.pid, signal.SIGKILL)
    for name, (stream, pcm) in zip(names, results):
        (resume,) = stream.resumes
        assert (resume.frame, resume.history_frames, resume.url) == (40, 40, code2wav_server.grpc_url)
        assert resume.error.startswith("UNAVAILABLE"), resume.error
        assert_equal_audio(pcm, moshi_streams[name], what=f"stream {name} resumed on B vs moshi")
