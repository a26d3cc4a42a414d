"""The replay lane: decoder steps of replayed history (resumes, docs/design.md §2.4) as background
work beside the live steps of one code2wav instance. Stdlib only."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Optional

# A replay step waits up to this long for the live steps in the decoder to finish.
REPLAY_WAIT_FOR_IDLE_S = 0.1
# Replay steps in flight while no live step has run for LIVE_QUIET_S: a full run of the python-ort
# decoder, for an instance whose streams are all resuming (a restarted server).
REPLAY_STEPS_WHEN_IDLE = 8
LIVE_QUIET_S = 1.0


class ReplayLane:
    """Decoder steps of replayed history as background work.

    Live steps (new frames) go straight to the decoder; `live()` only counts them. A replay step
    (`replay()`) waits for its turn, in arrival order: at most `steps_in_flight` at a time while the
    instance has live traffic, up to REPLAY_STEPS_WHEN_IDLE once no live step has run for LIVE_QUIET_S;
    then it waits up to REPLAY_WAIT_FOR_IDLE_S for the live steps in the decoder to finish, so that it
    fills the gaps between them: a live step finds at most `steps_in_flight` replay rows beside it."""

    def __init__(self, steps_in_flight: int, clock: Callable[[], float] = time.monotonic):
        self.steps_in_flight = steps_in_flight
        self.live_steps = 0
        self.replay_steps = 0
        self.replays_waiting = 0
        self._clock = clock
        self._last_live_s = -LIVE_QUIET_S
        self._condition: Optional[asyncio.Condition] = None  # made in the event loop that uses it

    def _lock(self) -> asyncio.Condition:
        if self._condition is None:
            self._condition = asyncio.Condition()
        return self._condition

    def _replay_may_start(self) -> bool:
        # Waiters are woken whenever a replay step or the last live step ends, so the quiet time is
        # looked at again as it passes.
        quiet = not self.live_steps and self._clock() - self._last_live_s >= LIVE_QUIET_S
        return self.replay_steps < (max(self.steps_in_flight, REPLAY_STEPS_WHEN_IDLE) if quiet else self.steps_in_flight)

    @contextlib.asynccontextmanager
    async def live(self):
        self.live_steps += 1
        try:
            yield
        finally:
            self.live_steps -= 1
            self._last_live_s = self._clock()
            if not self.live_steps and self.replays_waiting:  # live steps cost no lock otherwise
                condition = self._lock()
                async with condition:
                    condition.notify_all()

    @contextlib.asynccontextmanager
    async def replay(self):
        condition = self._lock()
        async with condition:
            self.replays_waiting += 1
            try:
                await condition.wait_for(self._replay_may_start)
                self.replay_steps += 1
                if self.live_steps:
                    try:
                        await asyncio.wait_for(condition.wait_for(lambda: not self.live_steps), REPLAY_WAIT_FOR_IDLE_S)
                    except asyncio.TimeoutError:
                        pass
            finally:
                self.replays_waiting -= 1
        try:
            yield
        finally:
            self.replay_steps -= 1
            async with condition:
                condition.notify_all()
