"""The two ends of every Python model's stub (why: docs/design.md §5.2). Pure stdlib."""

from __future__ import annotations

import faulthandler
import gc


def on_initialize() -> None:
    """A fatal signal in the stub writes every thread's stack to the server's log."""
    faulthandler.enable(all_threads=True)


def on_finalize() -> int:
    """Collect the model's garbage while the stub's shared memory is still mapped (call it last)."""
    return gc.collect()
