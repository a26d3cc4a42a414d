"""code2wav's blocking BLS calls on threads of their own, their results handed to the event loop in bursts
(docs/design.md §5 says why). Pure stdlib."""

from __future__ import annotations

import asyncio
import threading
import time
from queue import SimpleQueue
from typing import Any, Callable, List, Optional, Tuple


class BlockingCalls:
    """`call(loop, function)` (from the event loop) runs `function()` on one of at most `max_threads` threads,
    started as needed, and returns a future of its result. Results that arrive while the loop is busy are handed
    over together: one wake-up of the loop for all, not one per call as `run_in_executor` makes."""

    def __init__(self, max_threads: int):
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self._max_threads = max_threads
        self._threads: List[threading.Thread] = []
        self._calls: SimpleQueue = SimpleQueue()  # (future, function); None stops a thread
        self._results: List[Tuple[asyncio.Future, Any, Optional[BaseException]]] = []  # guarded by _lock
        self._lock = threading.Lock()
        self._in_flight = 0  # calls whose results are not yet handed over (event loop only)
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def call(self, loop: asyncio.AbstractEventLoop, function: Callable[[], Any]) -> asyncio.Future:
        self._loop = loop
        future = loop.create_future()
        self._in_flight += 1
        if self._in_flight > len(self._threads) and len(self._threads) < self._max_threads:
            thread = threading.Thread(target=self._work, name=f"code2wav-bls-{len(self._threads)}", daemon=True)
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
            # Keep nothing of a finished call: a BLS request or response freed after the stub unmapped its
            # shared memory (when this thread ends) crashes the stub (docs/design.md §5.2).
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
        """Stop the threads once the queued calls are done, waiting up to `timeout_s`; returns the names of
        those still running (each blocked in a call)."""
        for _ in self._threads:
            self._calls.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:  # results the event loop will not take any more
            self._results = []
        return [thread.name for thread in self._threads if thread.is_alive()]
