"""Idle expiry for the Python models on a background thread. Pure stdlib (Python 3.10); render copies
model_repository/common/ beside each Python model's model.py, which imports these files as siblings."""

from __future__ import annotations

import threading
import traceback
from typing import Callable


class IdleSweeper:
    """Calls `expire()` under `lock` (a model's execute may hold it too) every quarter of the idle timeout, within
    [50 ms, 1 s], on a thread `<model_name>-idle-expiry`: Triton drops an idle sequence silently, and its memory
    must not wait for traffic."""

    def __init__(self, model_name: str, idle_timeout_s: float, expire: Callable[[], object],
                 log_error: Callable[[str], None]):
        self.lock = threading.Lock()
        self.interval_s = min(max(idle_timeout_s / 4, 0.05), 1.0)
        self._expire, self._log_error = expire, log_error
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{model_name}-idle-expiry", daemon=True)
        self._thread.start()

    def close(self, log_warn: Callable[[str], None], timeout_s: float = 5.0) -> bool:
        """Stop the thread (a model's finalize), waiting at most `timeout_s`; returns whether it ended."""
        self._stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log_warn(f"{self._thread.name}: the idle sweeper did not stop in {timeout_s:g} s")
            return False
        return True

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            with self.lock:
                try:
                    self._expire()
                except Exception:  # the thread must outlive one failed sweep
                    self._log_error(f"{self._thread.name}: idle expiry failed:\n{traceback.format_exc()}")
