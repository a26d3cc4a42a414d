"""Triton Python-backend decoder: a streaming step in ONNX Runtime, keeping the streaming state itself.

This file is copied as `model.py` into a rendered `mimi_decoder/1/`, next to `model.onnx`. The native
ONNX Runtime backend keeps per-sequence state itself (`sequence_batching { state [...] }`); the Python
backend ignores that block, so this model does the same work by hand:

- per correlation id, one numpy array per state tensor; START (also on a live sequence) sets it to
  zeros, each step feeds it to the model and keeps the step's output state, END drops it after the
  step, and a sequence idle longer than `max_sequence_idle_microseconds` is dropped (Triton frees its
  slot without telling the model, so a background thread expires entries on the same clock);
- all valid requests of one `execute()` (steps of different sequences, gathered by the `oldest`
  sequence batcher) run as one batched `session.run`, rows concatenated along the batch dimension,
  and the outputs are split back per request;
- a request that fails validation gets its own error and changes nothing (but an END still ends its
  sequence: Triton has already released it); a request without START for a sequence with no state
  gets an error telling to START the sequence.

Configuration (`config.pbtxt`): `input` / `output` list the non-state tensors (with `max_batch_size` > 0
every request carries a leading batch dimension of 1); `sequence_batching` has the `oldest` strategy,
START/END/CORRID control inputs and `max_sequence_idle_microseconds`; there is no `state` block. The
`parameters` (string values):

| key | default | meaning |
|---|---|---|
| `state_spec` | required | JSON list of `{"input", "output", "dtype", "shape"}`, shape per stream |
| `onnx_file` | `model.onnx` | ONNX file, relative to the version folder |
| `intra_op_threads` | `0` | ONNX Runtime intra-op threads (0: its default) |

In `state_spec` the shape excludes the batch dimension, dtype is one of float32, float16, int32,
int64, and an optional `description` per entry is ignored.

Metrics (labels `model`, `version`, `instance`): gauge `mimi_decoder_live_streams`; counters
`mimi_decoder_batches_total` (session runs), `mimi_decoder_batched_requests_total` (rows run),
`mimi_decoder_expired_streams_total`; histogram `mimi_decoder_batch_size` (rows per run).

The configuration parsing and `StreamingDecoderCore` are plain numpy, unit-tested without a server;
the classes after them are the thin Triton glue.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton: the core below is tested on its own
    pb_utils = None

DEFAULT_IDLE_TIMEOUT_US = 1_000_000  # Triton's default when the config leaves it at 0
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
BATCH_SIZE_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


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
    onnx_file: str = "model.onnx"
    intra_op_threads: int = 0
    codebook_size: int = 0  # > 0: codes of the `codes` input must lie in [0, codebook_size)

    @property
    def batched(self) -> bool:
        """With max_batch_size > 0 each request carries a leading batch dimension (of 1)."""
        return self.max_batch_size > 0


def parse_state_spec(text: str) -> tuple[StateTensor, ...]:
    """Parse the `state_spec` parameter strictly; raises ValueError naming what is wrong."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"state_spec is not valid JSON: {exc}") from None
    if not isinstance(entries, list) or not entries:
        raise ValueError("state_spec must be a non-empty JSON list")
    states = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"state_spec[{index}] must be an object")
        keys = set(entry) - {"description"}
        if keys != STATE_SPEC_KEYS:
            raise ValueError(
                f"state_spec[{index}] must have exactly the keys {sorted(STATE_SPEC_KEYS)} "
                f"(and optionally 'description'), got {sorted(entry)}"
            )
        if entry["dtype"] not in STATE_DTYPES:
            raise ValueError(
                f"state_spec[{index}] dtype {entry['dtype']!r} is not one of {sorted(STATE_DTYPES)}"
            )
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(
            isinstance(dim, int) and not isinstance(dim, bool) and dim > 0 for dim in shape
        ):
            raise ValueError(
                f"state_spec[{index}] shape must be a list of positive ints, got {shape!r}"
            )
        for key in ("input", "output"):
            if not isinstance(entry[key], str) or not entry[key]:
                raise ValueError(f"state_spec[{index}] {key} must be a non-empty string")
        states.append(
            StateTensor(entry["input"], entry["output"], STATE_DTYPES[entry["dtype"]], tuple(shape))
        )
    names = [s.input for s in states] + [s.output for s in states]
    if len(set(names)) != len(names):
        raise ValueError(f"state_spec reuses a tensor name: {names}")
    return tuple(states)


def _parameter(config: Mapping, key: str, default: str | None = None) -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    if value is None:
        if default is None:
            raise ValueError(f"config parameter '{key}' is required")
        return default
    return value


def parse_model_config(
    config: Mapping, triton_string_to_numpy: Callable[[str], type]
) -> DecoderConfig:
    """Read everything the model needs from its config (the JSON Triton hands to initialize).
    Raises ValueError on a missing or malformed parameter or an unsupported config."""

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
    idle_us = int(sequence_batching.get("max_sequence_idle_microseconds", 0) or 0)
    idle_us = idle_us or DEFAULT_IDLE_TIMEOUT_US
    try:
        intra_op_threads = int(_parameter(config, "intra_op_threads", "0"))
    except ValueError:
        raise ValueError("config parameter 'intra_op_threads' must be an integer") from None
    if intra_op_threads < 0:
        raise ValueError("config parameter 'intra_op_threads' must be >= 0")
    try:
        codebook_size = int(_parameter(config, "codebook_size", "0"))
    except ValueError:
        raise ValueError("config parameter 'codebook_size' must be an integer") from None
    decoder = DecoderConfig(
        inputs=io_tensors("input"),
        outputs=io_tensors("output"),
        states=parse_state_spec(_parameter(config, "state_spec")),
        max_batch_size=int(config.get("max_batch_size", 0)),
        idle_timeout_s=idle_us / 1e6,
        onnx_file=_parameter(config, "onnx_file", "model.onnx"),
        intra_op_threads=intra_op_threads,
        codebook_size=codebook_size,
    )
    io_names = [t.name for t in decoder.inputs + decoder.outputs]
    state_names = [s.input for s in decoder.states] + [s.output for s in decoder.states]
    clash = set(io_names) & set(state_names)
    if clash:
        raise ValueError(f"state tensors must not be listed as config inputs/outputs: {sorted(clash)}")
    return decoder


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
        if batch is not None and batch < max(config.max_batch_size, 1):
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
class StepError(Exception):
    """One request's failure; the message goes to its client. `internal` marks a decoder failure
    (not the client's fault)."""

    def __init__(self, message: str, internal: bool = False):
        super().__init__(message)
        self.internal = internal


@dataclass
class StepRequest:
    """One request as the core sees it: the sequence, its flags, its non-state inputs as received
    (`[1, *dims]` with max_batch_size > 0, `[*dims]` otherwise)."""

    sequence_id: int | str
    start: bool
    end: bool
    inputs: Mapping[str, np.ndarray | None]


class _StateRows:
    """The output states of one session run: one `[rows, ...]` array per state tensor. Each stream
    of that run holds a row index into it, so no copy is made after a run; a later run whose rows are
    exactly the same streams feeds these arrays back as they are. The price: the arrays live until
    every stream of that run has stepped again or gone, so one idle stream can hold a whole batch's
    state until it steps, ends or expires."""

    __slots__ = ("arrays",)

    def __init__(self, arrays: Sequence[np.ndarray]):
        self.arrays = tuple(arrays)


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
    then state outputs), each `[rows, ...]`. Not thread-safe: callers serialise `step()` and
    `expire_idle()`.
    """

    def __init__(
        self,
        config: DecoderConfig,
        run: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]],
        clock: Callable[[], float] = time.monotonic,
        model_name: str = "decoder",
        log_error: Callable[[str], None] = lambda message: None,
    ):
        self.config = config
        self._run = run
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
        self._streams: dict[int | str, _Stream] = {}
        # Statistics since creation, read by the metrics publisher.
        self.runs_total = 0
        self.rows_total = 0
        self.expired_total = 0
        # Sizes of runs not yet published; the publisher drains it (bounded: metrics may be off).
        self.run_sizes: collections.deque[int] = collections.deque(maxlen=4096)

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
            del self._streams[sid]
        self.expired_total += len(idle)
        return len(idle)

    def _unknown_sequence(self, sequence_id) -> StepError:
        return StepError(
            f"sequence {sequence_id} has no decoder state in model '{self._model_name}': send its "
            "first request with the START flag (it was never started, has ended, or was idle for "
            f"more than {self.config.idle_timeout_s:g} s)"
        )

    def _row_inputs(self, request: StepRequest) -> dict[str, np.ndarray]:
        """Validate one request's inputs; return them as `[1, *dims]` arrays (views, no copy)."""
        if request.sequence_id in (0, "", None):
            raise StepError("this model needs a sequence: send a non-zero correlation id")
        rows = {}
        for spec in self.config.inputs:
            array = request.inputs.get(spec.name)
            if array is None:
                raise StepError(f"input '{spec.name}' is missing")
            if array.dtype != spec.dtype:
                raise StepError(f"input '{spec.name}' has dtype {array.dtype}, expected {spec.dtype}")
            if self.config.batched:
                expected = (1, *spec.dims)
                row_shape = array.shape[1:]
                batch_ok = array.ndim == len(spec.dims) + 1 and array.shape[0] == 1
            else:
                expected = spec.dims
                row_shape = array.shape
                batch_ok = array.ndim == len(spec.dims)
            if not batch_ok or any(
                want not in (-1, got) for want, got in zip(spec.dims, row_shape)
            ):
                raise StepError(
                    f"input '{spec.name}' has shape {list(array.shape)}, expected "
                    f"{_format_dims(expected)} (one request is one step of one sequence)"
                )
            if spec.name == "codes" and self.config.codebook_size and array.size and (
                array.min() < 0 or array.max() >= self.config.codebook_size
            ):
                # Checked here so a bad row fails alone instead of failing the batched run.
                raise StepError(
                    f"input 'codes' holds values in [{array.min()}, {array.max()}], outside "
                    f"[0, {self.config.codebook_size})"
                )
            rows[spec.name] = array if self.config.batched else array[np.newaxis]
        return rows

    def step(self, requests: Sequence[StepRequest]) -> list[dict[str, np.ndarray] | StepError]:
        """Run one step for each request; returns, per request, its outputs (`[1, *dims]`, or
        `[*dims]` without batching) or a StepError. Requests of one sequence run in order (each
        later one in a following run); all others run together, grouped by input shapes."""
        results: list[dict[str, np.ndarray] | StepError | None] = [None] * len(requests)
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

        for wave in waves:
            groups: dict[tuple, list[tuple[int, dict[str, np.ndarray]]]] = {}
            for index in wave:
                request = requests[index]
                try:
                    rows = self._row_inputs(request)
                    if not request.start and request.sequence_id not in self._streams:
                        raise self._unknown_sequence(request.sequence_id)
                except StepError as error:
                    results[index] = error
                    if request.end:
                        # Triton has already released the sequence: nothing can reach this state.
                        self._streams.pop(request.sequence_id, None)
                    continue
                signature = tuple(rows[spec.name].shape for spec in self.config.inputs)
                groups.setdefault(signature, []).append((index, rows))
            for members in groups.values():
                self._run_group(requests, members, results)
        return results  # type: ignore[return-value]

    def _run_group(self, requests, members, results) -> None:
        # Previous state of each member: (rows, row), rows None for a fresh or restarted stream.
        previous = []
        for index, _ in members:
            request = requests[index]
            stream = None if request.start else self._streams[request.sequence_id]
            previous.append((stream.rows, stream.row) if stream is not None else (None, 0))

        count = len(members)
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
                state_feeds.append(parts[0] if count == 1 else np.concatenate(parts))

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
                results[index] = StepError(
                    f"decoder step failed ({type(exc).__name__}: {exc}); the sequence was ended, "
                    "START it again",
                    internal=True,
                )
                self._streams.pop(requests[index].sequence_id, None)
            self._log_error(
                f"{self._model_name}: batched step of {count} rows failed:\n{traceback.format_exc()}"
            )
            return

        now = self._clock()
        num_outputs = len(self.config.outputs)
        new_rows = _StateRows(outputs[num_outputs:])
        for row, (index, _) in enumerate(members):
            request = requests[index]
            if self.config.batched:
                results[index] = {
                    spec.name: outputs[k][row : row + 1] for k, spec in enumerate(self.config.outputs)
                }
            else:
                results[index] = {
                    spec.name: outputs[k][row] for k, spec in enumerate(self.config.outputs)
                }
            if request.end:
                self._streams.pop(request.sequence_id, None)
                continue
            stream = self._streams.get(request.sequence_id)
            if stream is None:
                self._streams[request.sequence_id] = _Stream(new_rows, row, now)
            else:
                stream.rows, stream.row, stream.last_used = new_rows, row, now
        self._release_shared_rows(previous, reused)
        self.runs_total += 1
        self.rows_total += count
        self.run_sizes.append(count)

    def _release_shared_rows(self, previous, reused) -> None:
        """Streams left behind in a multi-row state array that this run's streams moved away from
        get their own row, so one idle stream never keeps a whole batch's arrays alive."""
        left = {id(rows): rows for rows, _ in previous
                if rows is not None and rows is not reused and rows.arrays[0].shape[0] > 1}
        if not left:
            return
        for stream in self._streams.values():
            if stream.rows is not None and id(stream.rows) in left:
                old = stream.rows
                stream.rows = _StateRows([array[stream.row : stream.row + 1].copy() for array in old.arrays])
                stream.row = 0


# --- Triton glue ----------------------------------------------------------------------------------
def create_session(path: Path, intra_op_threads: int, instance_kind: str, device_id: int):
    """An ONNX Runtime session: CUDA for a GPU instance (onnxruntime-gpu), else CPU."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if intra_op_threads > 0:
        options.intra_op_num_threads = intra_op_threads
    if instance_kind.upper() == "GPU":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ValueError("a GPU instance needs onnxruntime-gpu (no CUDAExecutionProvider here)")
        providers = [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    return ort.InferenceSession(str(path), sess_options=options, providers=providers)


class _Metrics:
    """The model's Prometheus metrics; every call is an IPC round trip to the server, so values are
    only sent when they change."""

    def __init__(self, labels: dict[str, str]):
        family = pb_utils.MetricFamily
        # The families must outlive their metrics: a metric of a collected family stops working.
        self._families = []

        def metric(name, description, kind, **kwargs):
            self._families.append(family(name=name, description=description, kind=kind))
            return self._families[-1].Metric(labels=labels, **kwargs)

        self.live = metric(
            "mimi_decoder_live_streams",
            "Sequences with decoder state held by this instance",
            family.GAUGE,
        )
        self.batches = metric(
            "mimi_decoder_batches_total",
            "Batched decoder steps run (one session run each)",
            family.COUNTER,
        )
        self.batched_requests = metric(
            "mimi_decoder_batched_requests_total",
            "Requests run in batched decoder steps (rows over all runs)",
            family.COUNTER,
        )
        self.expired = metric(
            "mimi_decoder_expired_streams_total",
            "Sequences whose decoder state was dropped after the idle timeout",
            family.COUNTER,
        )
        self.batch_size = metric(
            "mimi_decoder_batch_size",
            "Rows per decoder session run",
            family.HISTOGRAM,
            buckets=BATCH_SIZE_BUCKETS,
        )
        self._sent = {"live": 0, "runs": 0, "rows": 0, "expired": 0}

    def publish(self, core: StreamingDecoderCore) -> None:
        sent = self._sent
        if core.live_streams != sent["live"]:
            self.live.set(core.live_streams)
            sent["live"] = core.live_streams
        if core.runs_total != sent["runs"]:
            self.batches.increment(core.runs_total - sent["runs"])
            sent["runs"] = core.runs_total
        if core.rows_total != sent["rows"]:
            self.batched_requests.increment(core.rows_total - sent["rows"])
            sent["rows"] = core.rows_total
        if core.expired_total != sent["expired"]:
            self.expired.increment(core.expired_total - sent["expired"])
            sent["expired"] = core.expired_total
        for size in core.run_sizes:
            self.batch_size.observe(size)
        core.run_sizes.clear()


class TritonPythonModel:
    def initialize(self, args):
        self._name = args["model_name"]
        model_config = json.loads(args["model_config"])
        try:
            config = parse_model_config(model_config, pb_utils.triton_string_to_numpy)
            onnx_path = Path(args["model_repository"]) / args["model_version"] / config.onnx_file
            if not onnx_path.is_file():
                raise ValueError(f"ONNX file {onnx_path} does not exist (parameter onnx_file)")
            session = create_session(
                onnx_path,
                config.intra_op_threads,
                args.get("model_instance_kind", "CPU"),
                int(args.get("model_instance_device_id", "0")),
            )
            config = check_against_onnx(config, session.get_inputs(), session.get_outputs())
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"model '{self._name}': {exc}") from None

        core_outputs = [t.name for t in config.outputs] + [s.output for s in config.states]
        self._core = StreamingDecoderCore(
            config,
            lambda feeds: session.run(core_outputs, feeds),
            model_name=self._name,
            log_error=pb_utils.Logger.log_error,
        )
        self._input_names = [t.name for t in config.inputs]
        self._start_flag = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
        self._end_flag = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
        labels = {
            "model": self._name,
            "version": args["model_version"],
            "instance": args.get("model_instance_name", ""),
        }
        try:
            self._metrics = _Metrics(labels)
        except Exception as exc:  # metrics disabled on this server, or no MetricFamily
            pb_utils.Logger.log_warn(f"{self._name}: metrics unavailable ({exc})")
            self._metrics = None
        # Serialises the core between execute() and the idle sweeper.
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sweeper = threading.Thread(
            target=self._sweep_idle, name=f"{self._name}-idle-expiry", daemon=True
        )
        self._sweeper.start()
        pb_utils.Logger.log_info(
            f"{self._name}: {len(config.states)} state tensors, idle timeout "
            f"{config.idle_timeout_s:g} s, ONNX {onnx_path.name}, providers "
            f"{session.get_providers()}"
        )

    def _publish_metrics(self) -> None:
        if self._metrics is not None:
            try:
                self._metrics.publish(self._core)
            except Exception as exc:
                pb_utils.Logger.log_warn(f"{self._name}: metrics update failed, metrics off ({exc})")
                self._metrics = None

    def _sweep_idle(self) -> None:
        """Expire idle sequences even when no request comes, so their memory (and the live-streams
        gauge) does not wait for traffic."""
        interval_s = min(max(self._core.config.idle_timeout_s / 4, 0.05), 1.0)
        while not self._stopping.wait(interval_s):
            with self._lock:
                if self._core.expire_idle():
                    self._publish_metrics()

    def execute(self, requests):
        step_requests = []
        for request in requests:
            tensors = {tensor.name(): tensor for tensor in request.inputs()}
            inputs = {
                name: tensors[name].as_numpy() if name in tensors else None
                for name in self._input_names
            }
            flags = request.flags()
            step_requests.append(
                StepRequest(
                    request.correlation_id(),
                    bool(flags & self._start_flag),
                    bool(flags & self._end_flag),
                    inputs,
                )
            )
        with self._lock:
            results = self._core.step(step_requests)
            self._publish_metrics()

        responses = []
        for result in results:
            if isinstance(result, StepError):
                if result.internal:
                    code = pb_utils.TritonError.INTERNAL
                else:
                    pb_utils.Logger.log_verbose(f"{self._name}: rejected: {result}")
                    code = pb_utils.TritonError.INVALID_ARG
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[], error=pb_utils.TritonError(str(result), code)
                    )
                )
            else:
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(name, array) for name, array in result.items()]
                    )
                )
        return responses

    def finalize(self):
        self._stopping.set()
        self._sweeper.join(timeout=5)
