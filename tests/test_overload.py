"""`code2wav-server serve` of the null decoder under more paced conversations than two cores carry (192, then 32,
64, 96): slow answers or clear refusals, never a dead stub; every answer holds the frames sent, nothing restarts."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from mimi_code2wav.client.aio import Code2WavClient
from mimi_code2wav.client.protocol import FRAME_DURATION_S, NUM_CODEBOOKS, SAMPLES_PER_FRAME, StreamOptions

from helpers import serve_cli, stop_cli

pytestmark = pytest.mark.server

TICKS = 40


async def _conversation(client: Code2WavClient, index: int, errors: list[str], answers: list[int]) -> None:
    codes = np.random.default_rng(index).integers(0, 2048, (NUM_CODEBOOKS, TICKS))
    started, sent = time.perf_counter(), 0
    try:
        async with client.stream() as stream:
            while sent < TICKS:
                produced = min(TICKS, int((time.perf_counter() - started) / FRAME_DURATION_S) + 1)
                if produced <= sent:
                    await asyncio.sleep(started + sent * FRAME_DURATION_S - time.perf_counter())
                    continue
                pcm = await stream.decode(codes[:, sent:produced])
                assert pcm.size == (produced - sent) * SAMPLES_PER_FRAME, (index, sent, produced, pcm.size)
                answers.append(produced - sent)
                sent = produced
    except Exception as error:  # counted and shown by the test
        errors.append(" ".join(str(error).split())[:300])


async def _round(url: str, conversations: int) -> tuple[list[str], list[int]]:
    errors, answers = [], []
    async with Code2WavClient(url, StreamOptions(response_timeout_s=30.0, resume=False)) as client:
        await asyncio.gather(*(_conversation(client, i, errors, answers) for i in range(conversations)))
    return errors, answers


def test_an_overload_ends_in_answers_or_refusals_never_a_dead_stub(repository_for, tmp_path):
    log = tmp_path / "server.log"
    with serve_cli(repository_for("null"), log) as (cli, (_, grpc_port, _), out):
        url = f"127.0.0.1:{grpc_port}"
        for conversations in (192, 32, 64, 96):
            errors, answers = asyncio.run(_round(url, conversations))
            print(f"{conversations} conversations: {len(answers)} answers ({sum(answers)} frames), "
                  f"{len(errors)} errors {sorted(set(errors))[:3]}")
            # Refusals are allowed under overload, but each must say what happened.
            assert all(error.strip() and "is not healthy" not in error for error in errors), errors
        fresh_errors, fresh = asyncio.run(_round(url, 1))
        assert not fresh_errors and sum(fresh) == TICKS, fresh_errors
        output = stop_cli(cli, out)
    assert cli.returncode == 0, output
    assert "Python stub is dead" not in output and "tritonserver restarted" not in output, output
    text = log.read_text()
    # A stub that crashed, or code2wav's stub's stacks written as it died (the exit included).
    for fault in ("Stub process", "Signal (11)", "Fatal Python error"):
        assert fault not in text, text[-3000:]
