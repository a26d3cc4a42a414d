"""The two ends of a Python model's stub, the same for every model (docs/design.md §5.2).

- `on_initialize()`: a fatal signal in the stub writes every thread's Python stack to stderr, which
  is the server's log, where a dead stub otherwise leaves only a line in the kernel's log.
- `on_finalize()`: collects the model's garbage while the stub's shared memory is still mapped. Every
  Python backend object (a request, a response, a sender, a tensor) frees its part of that memory
  when it goes, and the stub unmaps it before the interpreter's final garbage collection; an object
  in a reference cycle (a failed request's traceback holds its request) would be freed only then, and
  crash the stub on a mutex in unmapped memory. Call it last, once the model has dropped what it holds.

`export/render.py` copies model_repository/common/ beside each Python model's `model.py`. Pure stdlib.
"""

from __future__ import annotations

import faulthandler
import gc


def on_initialize() -> None:
    faulthandler.enable(all_threads=True)


def on_finalize() -> int:
    """Collect every generation now; returns the number of unreachable objects found."""
    return gc.collect()
