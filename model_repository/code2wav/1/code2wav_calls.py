"""Blocking calls (code2wav's BLS requests to the decoder: `request.exec` blocks its thread) run on
threads of their own, their results handed to the asyncio event loop in bursts. Pure stdlib (unit-tested
without a server; Python 3.10 and 3.11); docs/design.md §5 says why.
"""

from __future__ import annotations

import asyncio
import threading
import time
from queue import SimpleQueue
from typing import Any, Callable, List, Optional, Tuple


class BlockingCalls:
    """`call(loop, function)` runs `function()` on one of at most `max_threads` threads (started as
    calls need them) and returns an asyncio future of its result or exception. Results that arrive
    while the loop is busy are handed over together: one wake-up of the loop for all of them, not one
    per call as `run_in_executor` makes. Call `call` from the event loop only."""

    def __init__(self, max_threads: int, thread_name: str = "code2wav-bls"):
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self._max_threads = max_threads
        self._thread_name = thread_name
        self._threads: List[threading.Thread] = []
        self._calls: SimpleQueue = SimpleQueue()  # (future, function); None stops a thread
        self._results: List[Tuple[asyncio.Future, Any, Optional[BaseException]]] = []  # guarded by _lock
        self._lock = threading.Lock()
        self._in_flight = 0  # calls whose results are not yet handed over (event loop only)
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def threads(self) -> int:
        """Threads started so far."""
        return len(self._threads)

    def call(self, loop: asyncio.AbstractEventLoop, function: Callable[[], Any]) -> asyncio.Future:
        self._loop = loop
        future = loop.create_future()
        self._in_flight += 1
        if self._in_flight > len(self._threads) and len(self._threads) < self._max_threads:
            thread = threading.Thread(target=self._work, name=f"{self._thread_name}-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
            thread.start()
        self._calls.put((future, function))
        return future

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            future, blocking_call = call
            result = exception = None
            try:
                result = blocking_call()
            except BaseException as exc:  # handed to the caller's future, as an executor would
                exception = exc
            with self._lock:
                self._results.append((future, result, exception))
                first = len(self._results) == 1
            # The thread keeps nothing of a finished call: a BLS request and its response hold the
            # Python backend's shared memory, and one kept past the stub's teardown (freed when this
            # thread ends) crashes the stub on a mutex in memory already unmapped.
            call = future = blocking_call = result = exception = None
            if first:
                self._loop.call_soon_threadsafe(self._hand_over)

    def _hand_over(self) -> None:
        with self._lock:
            results, self._results = self._results, []
        self._in_flight -= len(results)
        for future, result, exception in results:
            if future.cancelled():
                continue
            if exception is not None:
                future.set_exception(exception)
            else:
                future.set_result(result)

    def close(self, timeout_s: float = 5.0) -> List[str]:
        """Stop the threads once the calls already queued are done, and wait up to `timeout_s` for
        them to end; returns the names of those still running (each blocked in a call)."""
        for _ in self._threads:
            self._calls.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:  # results the event loop will not take any more
            self._results = []
        return [thread.name for thread in self._threads if thread.is_alive()]
