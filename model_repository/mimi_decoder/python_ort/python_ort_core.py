"""Core of the python-ort `mimi_decoder`: a streaming ONNX step whose state this model keeps itself.

Pure numpy + stdlib (no `triton_python_backend_utils`, no onnxruntime: `model.py` owns the session),
so it is unit-tested without a server. It imports `triton_streams`, which `export/render.py` copies
beside it from model_repository/common/.

The native ONNX Runtime backend keeps per-sequence state itself (`sequence_batching { state [...] }`);
the Python backend ignores that block, so this model does the same work by hand:

- per correlation id (a uint64), one numpy array per state tensor; START (also on a live sequence)
  sets it to zeros, each step feeds it to the model and keeps the step's output state, END drops it
  after the step, and a sequence idle longer than `max_sequence_idle_microseconds` is dropped (Triton
  frees its slot without telling the model, so a background thread expires entries on the same
  clock);
- all valid requests of one `execute()` (steps of different sequences, gathered by the `oldest`
  sequence batcher) run as one batched `session.run`, rows concatenated along the batch dimension,
  and the outputs are split back per request;
- a request that fails validation gets its own error and changes nothing (but an END still ends its
  sequence: Triton has already released it); a request without START for a sequence with no state
  gets an error telling to START the sequence.

Configuration (`config.pbtxt`, rendered from `config.pbtxt.tmpl`): `input` / `output` list the
non-state tensors; `max_batch_size` > 0 (every request carries a leading batch dimension of 1);
`sequence_batching` has the `oldest` strategy, START/END/CORRID (TYPE_UINT64) control inputs and a
positive `max_sequence_idle_microseconds`; there is no `state` block. The `parameters` (string values,
all required, no other accepted: `triton_streams.read_parameters`):

| key | meaning |
|---|---|
| `onnx_file` | ONNX file, relative to the version folder |
| `intra_op_threads` | ONNX Runtime intra-op threads (0: its default) |
| `intra_op_spinning` | `on` or `off`: whether those threads spin while waiting for work (ONNX Runtime's default is on; off leaves the cores to other processes, such as other replicas on the host) |
| `state_spec` | JSON list of `{"input", "output", "dtype", "shape"}`, shape per stream (no batch) |
| `value_ranges` | JSON object: input name -> `[low, high]`, its values must lie in [low, high) (`{}`: none) |
| `max_dims` | JSON object: input name -> its largest dims per request (bounds the config's -1 dims; `{}`: none) |
| `max_live_streams` | streams this instance holds state for at most, or `auto` (see `auto_stream_cap`); a START beyond it is refused with UNAVAILABLE, live streams unharmed |
| `max_rows_per_run` | the most rows one session run takes; larger batches run in pieces (bounds the run's scratch memory) |

In `state_spec` dtype is one of float32, float16, int32, int64, and an optional `description` per
entry is ignored. `value_ranges` and `max_dims` are checked per request, so a bad row fails alone
instead of failing the batched run. Requests whose inputs differ in shape (e.g. a different number of
frames) run in different session runs: rows of one run have equal shapes.

Memory. A live stream costs its state (one row of each state tensor) and nothing else: output states
are written by the session straight into arrays this model allocates (`BoundRunner`, IO binding),
so ONNX Runtime's arena only ever holds one run's scratch, bounded by `max_rows_per_run`, and is
handed back to the system once the instance has been idle for a while (`release_idle_memory`).
State arrays no stream holds any more are kept for the next runs (`StateBuffers`, at most
`state_buffer_limit` bytes, let go with the arena when idle): a fresh array of a few MiB costs the
kernel a page fault per 4 KiB on its first write.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from triton_streams import ConfigError, ModelError, read_parameters

STATE_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}
STATE_SPEC_KEYS = {"input", "output", "dtype", "shape"}
ORT_TYPES = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(double)": np.dtype(np.float64),
    "tensor(int8)": np.dtype(np.int8),
    "tensor(int16)": np.dtype(np.int16),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(uint8)": np.dtype(np.uint8),
    "tensor(bool)": np.dtype(np.bool_),
}


# --- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateTensor:
    """One state: fed as `input`, returned updated as `output`; `shape` is per stream (no batch)."""

    input: str
    output: str
    dtype: np.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class IOTensor:
    """A non-state input or output; `dims` is per request row, -1 for any size."""

    name: str
    dtype: np.dtype
    dims: tuple[int, ...]


@dataclass(frozen=True)
class DecoderConfig:
    inputs: tuple[IOTensor, ...]
    outputs: tuple[IOTensor, ...]
    states: tuple[StateTensor, ...]
    max_batch_size: int
    idle_timeout_s: float
    onnx_file: str
    intra_op_threads: int
    # Input name -> (low, high): its values must lie in [low, high).
    value_ranges: Mapping[str, tuple[int, int]]
    # Input name -> the largest dims (no batch) one request may have.
    max_dims: Mapping[str, tuple[int, ...]]
    # Live streams this instance holds at most (None: `auto`, resolved at load by `auto_stream_cap`).
    max_live_streams: int | None = None
    # The most rows in one session run.
    max_rows_per_run: int = 8
    # Instances of the model (instance_group counts, summed): they share the host's memory.
    instance_count: int = 1
    # sequence_batching.oldest.max_candidate_sequences: more live sequences never reach the model.
    max_candidate_sequences: int | None = None
    # ONNX Runtime's intra-op threads spin while waiting for work.
    intra_op_spinning: bool = True

    @property
    def state_bytes_per_stream(self) -> int:
        return sum(math.prod(s.shape) * s.dtype.itemsize for s in self.states)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None


def parse_state_spec(text: str) -> tuple[StateTensor, ...]:
    """Parse the `state_spec` parameter strictly; raises ValueError saying what is wrong."""
    entries = _json(text)
    if not isinstance(entries, list) or not entries:
        raise ValueError("must be a non-empty JSON list")
    states = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"entry {index} must be an object")
        keys = set(entry) - {"description"}
        if keys != STATE_SPEC_KEYS:
            raise ValueError(
                f"entry {index} must have exactly the keys {sorted(STATE_SPEC_KEYS)} "
                f"(and optionally 'description'), got {sorted(entry)}"
            )
        if entry["dtype"] not in STATE_DTYPES:
            raise ValueError(f"entry {index} dtype {entry['dtype']!r} is not one of {sorted(STATE_DTYPES)}")
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(_is_int(dim) and dim > 0 for dim in shape):
            raise ValueError(f"entry {index} shape must be a list of positive ints, got {shape!r}")
        for key in ("input", "output"):
            if not isinstance(entry[key], str) or not entry[key]:
                raise ValueError(f"entry {index} {key} must be a non-empty string")
        states.append(
            StateTensor(entry["input"], entry["output"], STATE_DTYPES[entry["dtype"]], tuple(shape))
        )
    names = [s.input for s in states] + [s.output for s in states]
    if len(set(names)) != len(names):
        raise ValueError(f"reuses a tensor name: {names}")
    return tuple(states)


def parse_value_ranges(text: str) -> dict[str, tuple[int, int]]:
    """Parse the `value_ranges` parameter: {"input name": [low, high], ...}, values in [low, high)."""
    ranges = _json(text)
    if not isinstance(ranges, dict):
        raise ValueError(f'must be a JSON object {{"input name": [low, high], ...}}, got {text!r}')
    parsed = {}
    for name, bounds in ranges.items():
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(map(_is_int, bounds))
                and bounds[0] < bounds[1]):
            raise ValueError(f"input '{name}': expected [low, high] with integers low < high, got {bounds!r}")
        parsed[name] = (bounds[0], bounds[1])
    return parsed


def parse_max_dims(text: str) -> dict[str, tuple[int, ...]]:
    """Parse the `max_dims` parameter: {"input name": [dim, ...], ...}, positive ints, no batch dim."""
    limits = _json(text)
    if not isinstance(limits, dict):
        raise ValueError(f'must be a JSON object {{"input name": [dim, ...], ...}}, got {text!r}')
    parsed = {}
    for name, dims in limits.items():
        if not (isinstance(dims, list) and dims and all(_is_int(dim) and dim > 0 for dim in dims)):
            raise ValueError(f"input '{name}': expected a list of positive integers, got {dims!r}")
        parsed[name] = tuple(dims)
    return parsed


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None
    if value < 1:
        raise ValueError(f"must be a positive integer, got {value}")
    return value


def parse_stream_cap(text: str) -> int | None:
    """Parse `max_live_streams`: a positive integer, or `auto` (None)."""
    if text == "auto":
        return None
    try:
        return _positive_int(text)
    except ValueError:
        raise ValueError(f"must be a positive integer or 'auto', got {text!r}") from None


def parse_on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise ValueError(f"must be 'on' or 'off', got {text!r}")
    return text == "on"


# The config's `parameters`: name -> parser of its string value (all required).
PARAMETER_TYPES = {
    "onnx_file": str,
    "intra_op_threads": int,
    "intra_op_spinning": parse_on_off,
    "state_spec": parse_state_spec,
    "value_ranges": parse_value_ranges,
    "max_dims": parse_max_dims,
    "max_live_streams": parse_stream_cap,
    "max_rows_per_run": _positive_int,
}

def state_buffer_limit(config: DecoderConfig) -> int:
    """Bytes of free state arrays an instance keeps for reuse (StateBuffers): four full runs' worth.
    Runs of changing groups and sizes (live streams) free and need arrays of every row class; with
    random groups of 1-8 streams, 2 runs' worth reused about half, 4 runs' worth 7 in 8."""
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
    """`max_live_streams: auto` for one instance: AUTO_MEMORY_SHARE of the available memory, split
    over the instances, less the free state arrays an instance may keep (`state_buffer_limit`), at
    MEMORY_PER_STREAM_FACTOR x the state per stream; never above max_candidate_sequences. Returns
    (cap, a sentence saying how it was derived)."""
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


def parse_model_config(
    config: Mapping, triton_string_to_numpy: Callable[[str], type]
) -> DecoderConfig:
    """Read everything the model needs from its config (the JSON Triton hands to initialize).
    Raises ValueError (ConfigError for a parameter) on anything missing, malformed or unsupported."""

    def io_tensors(section: str) -> tuple[IOTensor, ...]:
        tensors = []
        for entry in config.get(section, []):
            tensors.append(
                IOTensor(
                    entry["name"],
                    np.dtype(triton_string_to_numpy(entry["data_type"])),
                    tuple(int(dim) for dim in entry.get("dims", [])),
                )
            )
        if not tensors:
            raise ValueError(f"the config lists no {section}")
        return tuple(tensors)

    sequence_batching = config.get("sequence_batching")
    if sequence_batching is None:
        raise ValueError("this model keeps per-sequence state: the config needs sequence_batching")
    if sequence_batching.get("state"):
        raise ValueError(
            "remove sequence_batching.state: the Python backend ignores it; the state is described "
            "by the state_spec parameter"
        )
    max_batch_size = int(config.get("max_batch_size", 0))
    if max_batch_size < 1:
        raise ValueError(
            f"max_batch_size must be > 0 (requests of different sequences are batched, each with a "
            f"leading batch dimension of 1), got {max_batch_size}"
        )
    values, idle_timeout_s = read_parameters(config, PARAMETER_TYPES)
    if values["intra_op_threads"] < 0:
        raise ConfigError("intra_op_threads", f"must be >= 0 (0: ONNX Runtime's default), got {values['intra_op_threads']}")
    decoder = DecoderConfig(
        inputs=io_tensors("input"),
        outputs=io_tensors("output"),
        states=values["state_spec"],
        max_batch_size=max_batch_size,
        idle_timeout_s=idle_timeout_s,
        onnx_file=values["onnx_file"],
        intra_op_threads=values["intra_op_threads"],
        intra_op_spinning=values["intra_op_spinning"],
        value_ranges=values["value_ranges"],
        max_dims=values["max_dims"],
        max_live_streams=values["max_live_streams"],
        max_rows_per_run=values["max_rows_per_run"],
        instance_count=max(1, sum(int(group.get("count", 1)) for group in config.get("instance_group") or [{}])),
        max_candidate_sequences=_max_candidate_sequences(sequence_batching),
    )
    io_names = [t.name for t in decoder.inputs + decoder.outputs]
    state_names = [s.input for s in decoder.states] + [s.output for s in decoder.states]
    clash = set(io_names) & set(state_names)
    if clash:
        raise ValueError(f"state tensors must not be listed as config inputs/outputs: {sorted(clash)}")
    inputs = {t.name: t for t in decoder.inputs}
    for parameter, names in (("value_ranges", decoder.value_ranges), ("max_dims", decoder.max_dims)):
        unknown = sorted(set(names) - set(inputs))
        if unknown:
            raise ConfigError(parameter, f"{unknown} are not config inputs ({list(inputs)})")
    for name, dims in decoder.max_dims.items():
        declared = inputs[name].dims
        if len(dims) != len(declared) or any(want not in (-1, limit) for want, limit in zip(declared, dims)):
            raise ConfigError("max_dims", f"input '{name}': {list(dims)} does not fit its dims {list(declared)}")
    return decoder


def _max_candidate_sequences(sequence_batching: Mapping) -> int | None:
    value = (sequence_batching.get("oldest") or {}).get("max_candidate_sequences")
    try:
        return int(value) if value is not None and int(value) > 0 else None
    except (TypeError, ValueError):
        return None


def _onnx_dims(shape) -> tuple[int | None, ...]:
    """ONNX Runtime reports a dynamic dimension as a name or None: both become None."""
    return tuple(dim if isinstance(dim, int) and dim >= 0 else None for dim in shape)


def check_against_onnx(config: DecoderConfig, session_inputs, session_outputs) -> DecoderConfig:
    """Check the config and state spec against the ONNX graph (`session.get_inputs()` /
    `get_outputs()`: objects with `.name`, `.type`, `.shape`). Returns the config with input dims
    that the graph fixes (where the config says -1) made fixed, so requests are checked here rather
    than failing inside ONNX Runtime. Raises ValueError on any mismatch."""
    graph_inputs = {arg.name: arg for arg in session_inputs}
    graph_outputs = {arg.name: arg for arg in session_outputs}
    expected_inputs = [t.name for t in config.inputs] + [s.input for s in config.states]
    missing = [name for name in expected_inputs if name not in graph_inputs]
    unfed = [name for name in graph_inputs if name not in expected_inputs]
    if missing or unfed:
        raise ValueError(
            f"ONNX inputs {sorted(graph_inputs)} do not match config inputs + state inputs "
            f"{expected_inputs} (missing from the graph: {missing}, not fed: {unfed})"
        )
    expected_outputs = [t.name for t in config.outputs] + [s.output for s in config.states]
    missing = [name for name in expected_outputs if name not in graph_outputs]
    if missing:
        raise ValueError(f"ONNX outputs {sorted(graph_outputs)} lack {missing}")

    def check(arg, dtype: np.dtype, dims: tuple[int, ...], what: str) -> tuple[int, ...]:
        graph_dtype = ORT_TYPES.get(arg.type)
        if graph_dtype != dtype:
            raise ValueError(f"{what} '{arg.name}': ONNX type {arg.type}, expected {dtype}")
        graph_dims = _onnx_dims(arg.shape)
        if len(graph_dims) != len(dims) + 1:
            raise ValueError(
                f"{what} '{arg.name}': ONNX shape {list(arg.shape)} is not [batch] + {list(dims)}"
            )
        batch = graph_dims[0]
        if batch is not None and batch < config.max_batch_size:
            raise ValueError(
                f"{what} '{arg.name}': ONNX batch dimension is fixed to {batch}, below "
                f"max_batch_size {config.max_batch_size}"
            )
        merged = []
        for graph_dim, dim in zip(graph_dims[1:], dims):
            if graph_dim is not None and dim not in (-1, graph_dim):
                raise ValueError(
                    f"{what} '{arg.name}': ONNX shape {list(arg.shape)} does not match {list(dims)}"
                )
            merged.append(graph_dim if dim == -1 and graph_dim is not None else dim)
        return tuple(merged)

    inputs = tuple(
        IOTensor(t.name, t.dtype, check(graph_inputs[t.name], t.dtype, t.dims, "input"))
        for t in config.inputs
    )
    for t in config.outputs:
        check(graph_outputs[t.name], t.dtype, t.dims, "output")
    for s in config.states:
        check(graph_inputs[s.input], s.dtype, s.shape, "state input")
        check(graph_outputs[s.output], s.dtype, s.shape, "state output")
    return dataclasses.replace(config, inputs=inputs)


# --- the streaming core ---------------------------------------------------------------------------
@dataclass
class StepRequest:
    """One request as the core sees it: its sequence (correlation id), its flags, its non-state
    inputs as received (`[1, *dims]`)."""

    sequence_id: int
    start: bool
    end: bool
    inputs: Mapping[str, np.ndarray | None]


class StateBuffers:
    """State arrays no stream holds any more, kept to be handed out again.

    A new array of a few MiB is a new mmap (the model pins glibc's mmap threshold at 1 MiB so that
    freed state goes back to the system): the kernel zeroes and maps every page on its first write,
    for each run's output states and for every gathered input. Reusing arrays that were written
    before skips that. Runs vary in rows, so arrays are kept in classes of a power of two rows: a
    run of 5 rows gets the first 5 rows of an 8-row array (a view; `give` takes views back as their
    whole array). At most `limit_bytes` are kept (the oldest go first); `clear()` lets them all go,
    which the core does once the instance is idle. Only arrays that `take` made are ever kept.
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


class _StateRows:
    """The output states of one session run: one `[rows, ...]` array per state tensor. Each stream
    of that run holds a row index into it, so no copy is made after a run; a later run whose rows are
    exactly the same streams feeds these arrays back as they are. The price: the arrays live until
    every stream of that run has stepped again or gone, or until `_release_shared_rows` gives the
    streams left behind their own rows. `holders` counts the streams that hold a row: at 0 the
    arrays go back to the core's StateBuffers."""

    __slots__ = ("arrays", "holders")

    def __init__(self, arrays: Sequence[np.ndarray]):
        self.arrays = tuple(arrays)
        self.holders = 0


class _Stream:
    __slots__ = ("rows", "row", "last_used")

    def __init__(self, rows: _StateRows | None, row: int, last_used: float):
        self.rows = rows  # None: all-zero state (a fresh START)
        self.row = row
        self.last_used = last_used


def _format_dims(dims: Sequence[int]) -> str:
    return "[" + ", ".join("-1" if dim == -1 else str(dim) for dim in dims) + "]"


class StreamingDecoderCore:
    """Per-sequence state and batched stepping, independent of Triton.

    `run(feeds)` runs one batched step: `feeds` maps every input and state-input name to a
    `[rows, ...]` array; it returns the outputs in the order of `output_names` (config outputs,
    then state outputs), each `[rows, ...]`; its state outputs must be new arrays (the core keeps
    them as the streams' state and hands them back to `buffers` once no stream holds them).
    `release(feeds)`, when given, runs one step whose scratch memory is handed back to the system
    afterwards (`release_idle_memory`). `buffers` (default: one of its own, sized by
    `state_buffer_limit`) is where gathered inputs come from and where state arrays go back to;
    pass the one `run` allocates its state outputs from. Not thread-safe: callers serialise
    `step()`, `expire_idle()` and `release_idle_memory()`. Request failures are `ModelError`s (kind,
    message, TritonError code name).
    """

    def __init__(
        self,
        config: DecoderConfig,
        run: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]],
        clock: Callable[[], float] = time.monotonic,
        model_name: str = "decoder",
        log_error: Callable[[str], None] = lambda message: None,
        release: Callable[[dict[str, np.ndarray]], object] | None = None,
        buffers: StateBuffers | None = None,
    ):
        if config.max_live_streams is None:
            raise ValueError("max_live_streams must be resolved to a number first (auto_stream_cap)")
        self.config = config
        self._run = run
        self._release = release
        self._clock = clock
        self._model_name = model_name
        self._log_error = log_error
        self.output_names = [t.name for t in config.outputs] + [s.output for s in config.states]
        # One shared, read-only zero row per state: what a fresh stream feeds on its first step.
        self._zero_rows = []
        for state in config.states:
            zero = np.zeros((1, *state.shape), dtype=state.dtype)
            zero.flags.writeable = False
            self._zero_rows.append(zero)
        self._streams: dict[int, _Stream] = {}
        self.buffers = buffers if buffers is not None else StateBuffers(state_buffer_limit(config))
        # Statistics since creation, read by the metrics publisher.
        self.runs_total = 0
        self.rows_total = 0
        self.expired_total = 0
        self.refused_total = 0
        # Sizes of runs not yet published; the publisher drains it (bounded: metrics may be off).
        self.run_sizes: collections.deque[int] = collections.deque(maxlen=4096)
        self._last_run_s = self._clock()
        self._runs_since_release = 0

    @property
    def live_streams(self) -> int:
        return len(self._streams)

    def has_stream(self, sequence_id) -> bool:
        return sequence_id in self._streams

    def expire_idle(self, now: float | None = None, keep: frozenset = frozenset()) -> int:
        """Drop streams idle for longer than the idle timeout (measured from the end of their last
        step), except those in `keep`. Returns how many were dropped."""
        now = self._clock() if now is None else now
        limit = self.config.idle_timeout_s
        idle = [
            sid
            for sid, stream in self._streams.items()
            if now - stream.last_used > limit and sid not in keep
        ]
        for sid in idle:
            self._remove(sid, keep_arrays=False)
        self.expired_total += len(idle)
        return len(idle)

    def release_idle_memory(self, idle_s: float = 1.0, now: float | None = None) -> bool:
        """After `idle_s` without a run, let the kept state arrays go and run one throw-away step of
        one zero row through `release`, which hands the session's scratch memory back (once per idle
        period). Returns whether anything was let go."""
        now = self._clock() if now is None else now
        if now - self._last_run_s < idle_s:
            return False
        held = self.buffers.held_bytes
        self.buffers.clear()
        if self._release is None or not self._runs_since_release:
            return held > 0
        feeds = {spec.name: np.zeros((1, *(1 if dim == -1 else dim for dim in spec.dims)), spec.dtype)
                 for spec in self.config.inputs}
        for state, zero in zip(self.config.states, self._zero_rows):
            feeds[state.input] = zero
        self._release(feeds)
        self._runs_since_release = 0
        return True

    def _stream_cap_reached(self, live: int) -> ModelError:
        self.refused_total += 1
        return ModelError(
            "stream_cap",
            f"resource exhausted: model '{self._model_name}' already holds {live} live streams, its "
            f"limit (max_live_streams={self.config.max_live_streams} per instance); this START was refused "
            "and no stream was affected. Retry later, or END streams that are done (an abandoned stream "
            f"is freed after {self.config.idle_timeout_s:g} s idle)",
            "UNAVAILABLE",
        )

    def _unknown_sequence(self, sequence_id) -> ModelError:
        return ModelError(
            "unknown_sequence",
            f"sequence {sequence_id} has no decoder state in model '{self._model_name}': send its "
            "first request with the START flag (it was never started, has ended, or was idle for "
            f"more than {self.config.idle_timeout_s:g} s)"
        )

    def _row_inputs(self, request: StepRequest) -> dict[str, np.ndarray]:
        """Validate one request's inputs; return them as `[1, *dims]` arrays (views, no copy)."""
        sequence_id = request.sequence_id
        if not _is_int(sequence_id) or sequence_id <= 0:
            raise ModelError(
                "correlation_id",
                f"this model needs a sequence: send a non-zero uint64 correlation id, got {sequence_id!r}",
            )
        rows = {}
        for spec in self.config.inputs:
            array = request.inputs.get(spec.name)
            if array is None:
                raise ModelError("missing_input", f"input '{spec.name}' is missing")
            if array.dtype != spec.dtype:
                raise ModelError("dtype", f"input '{spec.name}' has dtype {array.dtype}, expected {spec.dtype}")
            if not (array.ndim == len(spec.dims) + 1 and array.shape[0] == 1) or any(
                want not in (-1, got) for want, got in zip(spec.dims, array.shape[1:])
            ):
                raise ModelError(
                    "shape",
                    f"input '{spec.name}' has shape {list(array.shape)}, expected "
                    f"{_format_dims((1, *spec.dims))} (one request is one step of one sequence)",
                )
            limit = self.config.max_dims.get(spec.name)
            if limit is not None and any(got > most for got, most in zip(array.shape[1:], limit)):
                raise ModelError(
                    "shape",
                    f"input '{spec.name}' has shape {list(array.shape)}, at most {[1, *limit]} per request "
                    "(parameter max_dims)",
                )
            bounds = self.config.value_ranges.get(spec.name)
            if bounds is not None and array.size and (array.min() < bounds[0] or array.max() >= bounds[1]):
                # Checked here so a bad row fails alone instead of failing the batched run.
                raise ModelError(
                    "value_range",
                    f"input '{spec.name}' holds values in [{array.min()}, {array.max()}], outside "
                    f"[{bounds[0]}, {bounds[1]}) (parameter value_ranges)",
                )
            rows[spec.name] = array
        return rows

    def step(self, requests: Sequence[StepRequest]) -> list[dict[str, np.ndarray] | ModelError]:
        """Run one step for each request; returns, per request, its outputs (`[1, *dims]`) or a
        ModelError. Requests of one sequence run in order (each later one in a following run); all
        others run together, grouped by input shapes."""
        results: list[dict[str, np.ndarray] | ModelError | None] = [None] * len(requests)
        in_this_batch = frozenset(r.sequence_id for r in requests)
        self.expire_idle(keep=in_this_batch)

        waves: list[list[int]] = []
        seen: dict = {}
        for index, request in enumerate(requests):
            wave = seen.get(request.sequence_id, 0)
            seen[request.sequence_id] = wave + 1
            if wave == len(waves):
                waves.append([])
            waves[wave].append(index)

        admitted: set = set()  # new streams this call lets in, before their state exists
        for wave in waves:
            groups: dict[tuple, list[tuple[int, dict[str, np.ndarray]]]] = {}
            for index in wave:
                request = requests[index]
                try:
                    rows = self._row_inputs(request)
                    if not request.start and request.sequence_id not in self._streams:
                        raise self._unknown_sequence(request.sequence_id)
                    if (request.start and not request.end and request.sequence_id not in self._streams
                            and request.sequence_id not in admitted):
                        live = len(self._streams) + len(admitted)
                        if live >= self.config.max_live_streams:
                            raise self._stream_cap_reached(live)
                        admitted.add(request.sequence_id)
                except ModelError as error:
                    results[index] = error
                    if request.end:
                        # Triton has already released the sequence: nothing can reach this state.
                        self._remove(request.sequence_id)
                    continue
                signature = tuple(rows[spec.name].shape for spec in self.config.inputs)
                groups.setdefault(signature, []).append((index, rows))
            most = self.config.max_rows_per_run
            for members in groups.values():
                for first in range(0, len(members), most):
                    self._run_group(requests, members[first : first + most], results)
        return results  # type: ignore[return-value]

    def _run_group(self, requests, members, results) -> None:
        # Previous state of each member: (rows, row), rows None for a fresh or restarted stream.
        previous = []
        for index, _ in members:
            request = requests[index]
            stream = None if request.start else self._streams[request.sequence_id]
            previous.append((stream.rows, stream.row) if stream is not None else (None, 0))

        count = len(members)
        gathered_arrays: list[np.ndarray] = []  # inputs gathered here: back to the buffers after the run
        reuse = previous[0][0]
        if (
            count > 1
            and reuse is not None
            and all(rows is reuse for rows, _ in previous)
            and reuse.arrays[0].shape[0] == count
            and sorted(row for _, row in previous) == list(range(count))
        ):
            # Exactly the streams of one earlier run: feed its output states back without a copy,
            # with this run's rows in that run's order.
            order = sorted(range(count), key=lambda k: previous[k][1])
            members = [members[k] for k in order]
            previous = [previous[k] for k in order]
            state_feeds = list(reuse.arrays)
            reused = reuse
        else:
            reused = None
            state_feeds = []
            for position, zero in enumerate(self._zero_rows):
                parts = [
                    rows.arrays[position][row : row + 1] if rows is not None else zero
                    for rows, row in previous
                ]
                if count == 1:
                    state_feeds.append(parts[0])
                else:
                    gathered = self.buffers.take((count, *zero.shape[1:]), zero.dtype)
                    state_feeds.append(np.concatenate(parts, out=gathered))
                    gathered_arrays.append(gathered)

        feeds = {}
        for spec in self.config.inputs:
            parts = [rows[spec.name] for _, rows in members]
            feeds[spec.name] = parts[0] if count == 1 else np.concatenate(parts)
        for state, array in zip(self.config.states, state_feeds):
            feeds[state.input] = array

        try:
            outputs = list(self._run(feeds))
            if len(outputs) != len(self.output_names) or any(
                out.shape[0] != count for out in outputs
            ):
                raise RuntimeError(
                    f"the step returned shapes {[list(o.shape) for o in outputs]} for {count} rows"
                )
        except Exception as exc:
            for index, _ in members:
                results[index] = ModelError(
                    "decoder",
                    f"decoder step failed ({type(exc).__name__}: {exc}); the sequence was ended, "
                    "START it again",
                    "INTERNAL",
                )
                self._remove(requests[index].sequence_id)
            self.buffers.give(gathered_arrays)
            self._log_error(
                f"{self._model_name}: batched step of {count} rows failed:\n{traceback.format_exc()}"
            )
            return

        now = self._clock()
        num_outputs = len(self.config.outputs)
        fed = {id(array) for array in feeds.values()}
        # A state output that is one of the inputs (a run may hand one back unchanged) becomes an
        # array of its own: the input's array may go back to the buffers below.
        new_rows = _StateRows([np.array(out) if id(out) in fed else out for out in outputs[num_outputs:]])
        for row, (index, _) in enumerate(members):
            request = requests[index]
            results[index] = {
                spec.name: outputs[k][row : row + 1] for k, spec in enumerate(self.config.outputs)
            }
            if request.end:
                self._remove(request.sequence_id)
                continue
            stream = self._streams.get(request.sequence_id)
            if stream is None:
                stream = self._streams[request.sequence_id] = _Stream(None, 0, now)
            self._hold(stream, new_rows, row)
            stream.last_used = now
        self.buffers.give(gathered_arrays)
        self._release_shared_rows(previous, reused)
        self.runs_total += 1
        self._runs_since_release += 1
        self._last_run_s = now
        self.rows_total += count
        self.run_sizes.append(count)

    def _hold(self, stream: _Stream, rows: _StateRows, row: int) -> None:
        """Point `stream` at row `row` of `rows`, letting go of the rows it held."""
        rows.holders += 1
        old, stream.rows, stream.row = stream.rows, rows, row
        if old is not None:
            self._let_go(old)

    def _let_go(self, rows: _StateRows, keep_arrays: bool = True) -> None:
        rows.holders -= 1
        if rows.holders == 0 and keep_arrays:
            self.buffers.give(rows.arrays)

    def _remove(self, sequence_id, keep_arrays: bool = True) -> None:
        """Forget a stream; its arrays go back to the buffers unless `keep_arrays` is false (an
        expired stream: its instance is likely idle, and idle memory goes back to the system)."""
        stream = self._streams.pop(sequence_id, None)
        if stream is not None and stream.rows is not None:
            self._let_go(stream.rows, keep_arrays)

    def _release_shared_rows(self, previous, reused) -> None:
        """Streams left behind in a multi-row state array that this run's streams moved away from
        get their own row, so one idle stream never keeps a whole batch's arrays alive."""
        left = {id(rows): rows for rows, _ in previous
                if rows is not None and rows is not reused and rows.holders and rows.arrays[0].shape[0] > 1}
        if not left:
            return
        for stream in self._streams.values():
            if stream.rows is not None and id(stream.rows) in left:
                own = []
                for array in stream.rows.arrays:
                    copy = self.buffers.take((1, *array.shape[1:]), array.dtype)
                    copy[...] = array[stream.row : stream.row + 1]
                    own.append(copy)
                self._hold(stream, _StateRows(own), 0)


class BoundRunner:
    """`run(feeds)` for StreamingDecoderCore over an ONNX Runtime session, through IO binding: the
    output states are written straight into numpy arrays allocated here (one per state per run),
    which the core keeps as the streams' state; the other outputs (small) come back as copies. ONNX
    Runtime's arena then only holds one run's scratch. `allocate(shape, dtype)` makes those arrays
    (pass the core's `StateBuffers.take` to reuse them). `release(feeds)` runs with the run option
    that shrinks the arena afterwards (`release_options`, made by the caller, which owns the
    onnxruntime import), giving that scratch back to the system.
    """

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
