"""Where the python-ort `mimi_decoder`'s state arrays come from: `StateBuffers` keeps the arrays no
stream holds any more for the next runs, `BoundRunner` has ONNX Runtime write a run's output states
straight into such arrays, and `auto_stream_cap` sizes `max_live_streams: auto` by the memory available.

A live stream costs its state (one row of each state tensor) and nothing else: ONNX Runtime's arena
only holds one run's scratch (bounded by `max_rows_per_run`), handed back to the system once the
instance is idle (`StreamingDecoderCore.release_idle_memory`). numpy and stdlib; onnxruntime is
imported only inside `arena_release_options`, and `model.py` hands the session in.
"""

from __future__ import annotations

import collections
import ctypes
import weakref
from typing import Callable, Mapping, Sequence

import numpy as np

from python_ort_config import DecoderConfig


class StateRows:
    """The output states of one session run: one `[rows, ...]` array per state tensor. Each stream of
    that run holds a row index into it (no copy; a later run of exactly the same streams feeds them back
    as they are). `holders` counts the streams that hold a row: at 0 the arrays go back to the core's
    StateBuffers."""

    __slots__ = ("arrays", "holders")

    def __init__(self, arrays: Sequence[np.ndarray]):
        self.arrays = tuple(arrays)
        self.holders = 0


class StreamStateRow:
    """A live stream in the core's table: its state is row `row` of `rows` (None: all zeros, a
    fresh START), and `last_used` is when its last step ended (idle expiry)."""

    __slots__ = ("rows", "row", "last_used")

    def __init__(self, rows: StateRows | None, row: int, last_used: float):
        self.rows, self.row, self.last_used = rows, row, last_used


def reuse_order(previous) -> list[int] | None:
    """When the previous states are all the rows of one earlier run (more than one), the order of
    this run's members that matches that run's rows; else None."""
    count, shared = len(previous), previous[0][0]
    if (count > 1 and shared is not None and all(rows is shared for rows, _ in previous)
            and shared.arrays[0].shape[0] == count and sorted(row for _, row in previous) == list(range(count))):
        return sorted(range(count), key=lambda k: previous[k][1])
    return None


class StateBuffers:
    """State arrays no stream holds any more, kept to be handed out again: a new array of a few MiB is
    a new mmap, whose every page the kernel zeroes and maps on its first write.

    Arrays are kept in classes of a power of two rows: a run of 5 rows gets the first 5 rows of an
    8-row array (a view; `give` takes views back as their whole array). At most `limit_bytes` are kept
    (the oldest go first); `clear()` lets them all go. Only arrays that `take` made are ever kept.
    """

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._free: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._made: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()
        self.held_bytes = 0
        self.reused_total = 0
        self.allocated_total = 0

    @staticmethod
    def rows_class(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def take(self, shape: Sequence[int], dtype) -> np.ndarray:
        """A C-contiguous array of this shape and dtype (maybe a view of the first rows of a larger
        one), contents undefined."""
        rows, rest, dtype = shape[0], tuple(shape[1:]), np.dtype(dtype)
        whole = (self.rows_class(rows), *rest)
        for ident, array in self._free.items():
            if array.shape == whole and array.dtype == dtype:
                del self._free[ident]
                self.held_bytes -= array.nbytes
                self.reused_total += 1
                return array[:rows]
        self.allocated_total += 1
        array = np.empty(whole, dtype)
        self._made[id(array)] = array
        return array[:rows]

    def give(self, arrays: Sequence[np.ndarray]) -> None:
        """Arrays (or views that `take` made) nothing will read or write again."""
        for array in arrays:
            whole = array if array.base is None else array.base
            if self._made.get(id(whole)) is not whole or id(whole) in self._free or whole.nbytes > self.limit_bytes:
                continue
            while self.held_bytes + whole.nbytes > self.limit_bytes:
                _, oldest = self._free.popitem(last=False)
                self.held_bytes -= oldest.nbytes
            self._free[id(whole)] = whole
            self.held_bytes += whole.nbytes

    def clear(self) -> None:
        self._free.clear()
        self.held_bytes = 0


class BoundRunner:
    """`run(feeds)` for StreamingDecoderCore over an ONNX Runtime session, through IO binding: the
    output states are written straight into arrays from `allocate(shape, dtype)` (pass the core's
    `StateBuffers.take`), which the core keeps as the streams' state; the other outputs (small) come
    back as copies. `release(feeds)` runs with `release_options` (`arena_release_options`)."""

    def __init__(self, session, config: DecoderConfig, release_options=None,
                 allocate: Callable[[Sequence[int], np.dtype], np.ndarray] = np.empty):
        self._session = session
        self._release_options = release_options
        self._allocate = allocate
        self._outputs = [t.name for t in config.outputs]
        self._states = [(s.input, s.output) for s in config.states]

    def __call__(self, feeds: Mapping[str, np.ndarray], run_options=None) -> list[np.ndarray]:
        binding = self._session.io_binding()
        inputs = {name: np.ascontiguousarray(array) for name, array in feeds.items()}  # alive until the run ends
        for name, array in inputs.items():
            binding.bind_cpu_input(name, array)
        for name in self._outputs:
            binding.bind_output(name, "cpu")
        states = []
        for input_name, output_name in self._states:
            source = inputs[input_name]
            state = self._allocate(source.shape, source.dtype)
            binding.bind_output(output_name, "cpu", 0, state.dtype, list(state.shape), state.ctypes.data)
            states.append(state)
        self._session.run_with_iobinding(binding, run_options)
        values = binding.get_outputs()
        # Copies: a view would pin its arena chunk for as long as the response holds it.
        return [np.array(values[k].numpy()) for k in range(len(self._outputs))] + states

    def release(self, feeds: Mapping[str, np.ndarray]) -> None:
        self(feeds, self._release_options)


def arena_release_options(instance_kind: str = "CPU", device_id: int = 0):
    """Run options that shrink the session's memory arena after the run: `BoundRunner.release`'s."""
    import onnxruntime as ort

    options = ort.RunOptions()
    device = f"gpu:{device_id}" if instance_kind.upper() == "GPU" else "cpu:0"
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", device)
    return options


# glibc serves allocations of at least this many bytes with their own mmap, and unmaps them when
# freed. Its default threshold rises with every such free (up to 32 MiB), after which a stream's
# state lands on the heap and stays there after the stream is gone. A stream's smallest state array
# of note is one layer's keys or values: 496 KiB, 248 KiB with an fp16 cache.
MMAP_THRESHOLD_BYTES = 1 << 17
_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def fix_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at MMAP_THRESHOLD_BYTES for this process; False where it cannot."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # not glibc
        return False


def state_buffer_limit(config: DecoderConfig) -> int:
    """Bytes of free state arrays an instance keeps for reuse (StateBuffers): four full runs' worth
    (runs of changing groups and sizes free and need arrays of every row class; docs/design.md §5.1)."""
    return 4 * config.max_rows_per_run * config.state_bytes_per_stream


# `max_live_streams: auto`: the streams' state may take this share of the memory available at load,
# counting MEMORY_PER_STREAM_FACTOR x the state per stream (the state, plus the input copy a run of
# streams that did not step together makes).
AUTO_MEMORY_SHARE = 0.5
MEMORY_PER_STREAM_FACTOR = 2


def available_memory_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Memory this process can still use: MemAvailable, or less where a cgroup (v2 `memory.max`, v1
    `memory.limit_in_bytes`) limits the container. None when nothing can be read."""
    candidates = []
    try:
        for line in open(meminfo):
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            with open(f"{cgroup}/{limit_file}") as limit, open(f"{cgroup}/{usage_file}") as usage:
                text = limit.read().strip()
                if text != "max" and int(text) < 2**60:
                    candidates.append(max(0, int(text) - int(usage.read().strip())))
        except (OSError, ValueError):
            continue
    return min(candidates) if candidates else None


def auto_stream_cap(config: DecoderConfig, available_bytes: int | None) -> tuple[int, str]:
    """`max_live_streams: auto` for one instance: AUTO_MEMORY_SHARE of the available memory over the
    instances, less `state_buffer_limit`, at MEMORY_PER_STREAM_FACTOR x the state per stream; never
    above max_candidate_sequences. Returns (cap, a sentence saying how it was derived)."""
    per_stream = MEMORY_PER_STREAM_FACTOR * config.state_bytes_per_stream
    candidates = config.max_candidate_sequences
    if available_bytes is None:
        if candidates is None:
            raise ValueError("max_live_streams is 'auto' but neither the available memory nor "
                             "max_candidate_sequences is known: set a number")
        return candidates, f"{candidates} (max_candidate_sequences; available memory unknown)"
    kept = state_buffer_limit(config)
    cap = max(1, int((AUTO_MEMORY_SHARE * available_bytes / config.instance_count - kept) // per_stream))
    reason = (f"({AUTO_MEMORY_SHARE:g} x {available_bytes / 2**30:.1f} GiB available / {config.instance_count} "
              f"instance(s) - {kept / 2**20:.0f} MiB of kept state arrays) / {per_stream / 2**20:.1f} MiB per "
              f"stream ({MEMORY_PER_STREAM_FACTOR}x its state)")
    if candidates is not None and candidates < cap:
        return candidates, f"{candidates} (max_candidate_sequences; memory would allow {cap}: {reason})"
    return cap, f"{cap} ({reason})"
