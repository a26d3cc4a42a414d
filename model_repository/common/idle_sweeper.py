"""Idle expiry for the Python models on a background thread (`IdleSweeper`).

`export/render.py` copies model_repository/common/ beside each Python model's `model.py`, which imports
these files as siblings. Pure stdlib: unit-tested without a server, and runs on the NGC image's Python 3.10.
"""

from __future__ import annotations

import threading
import traceback
from typing import Callable


def sweep_interval_s(idle_timeout_s: float) -> float:
    """How often to look for idle streams: a quarter of the timeout, within [50 ms, 1 s]."""
    return min(max(idle_timeout_s / 4, 0.05), 1.0)


class IdleSweeper:
    """Calls `expire()` every `sweep_interval_s(idle_timeout_s)` on a background thread, under `lock`.

    Triton drops an idle sequence without telling the model, so a model expires its own streams; this
    thread does it when no request comes, so their memory (and the live-streams gauge) does not wait
    for traffic. The model's execute holds `lock` while it touches its stream table.
    """

    def __init__(self, idle_timeout_s: float, expire: Callable[[], object], name: str,
                 log_error: Callable[[str], None] = lambda message: None):
        self.lock = threading.Lock()
        self.interval_s = sweep_interval_s(idle_timeout_s)
        self._expire = expire
        self._log_error = log_error
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @classmethod
    def started(cls, model_name: str, idle_timeout_s: float, expire: Callable[[], object],
                log_error: Callable[[str], None]) -> IdleSweeper:
        """A model instance's sweeper, already running on a thread named `<model_name>-idle-expiry`."""
        sweeper = cls(idle_timeout_s, expire, name=f"{model_name}-idle-expiry", log_error=log_error)
        sweeper.start()
        return sweeper

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread and wait for it at most `timeout_s`; returns whether it has ended."""
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def close(self, log_warn: Callable[[str], None], timeout_s: float = 5.0) -> None:
        """Stop the thread (a model's finalize); a thread still running after `timeout_s` is logged."""
        if not self.stop(timeout_s):
            log_warn(f"{self._thread.name}: the idle sweeper did not stop in {timeout_s:g} s")

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            with self.lock:
                try:
                    self._expire()
                except Exception:  # the thread must outlive one failed sweep
                    self._log_error(f"{self._thread.name}: idle expiry failed:\n{traceback.format_exc()}")
