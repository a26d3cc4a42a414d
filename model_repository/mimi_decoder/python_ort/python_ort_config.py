"""Configuration of the python-ort `mimi_decoder`: its model config read strictly and checked against the
ONNX graph (`max_live_streams: auto` is resolved in `python_ort_memory`). Pure numpy + stdlib; a wrong
or missing value raises ValueError (`ConfigError` for a parameter), which `model.py` turns into a
failed load.

The config: `input` / `output` list the non-state tensors; `max_batch_size` > 0 (every request has a
leading batch dimension of 1); `sequence_batching` has the `oldest` strategy, START/END/CORRID
(TYPE_UINT64) control inputs, a positive `max_sequence_idle_microseconds` and no `state` block. The
`parameters` (string values, all required, no other accepted: `model_errors.read_parameters`):

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

In `state_spec` dtype is one of float32, float16, int32, int64 (an optional `description` per entry is
ignored). `value_ranges` and `max_dims` are checked per request (by the core), so a bad row fails alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from model_errors import ConfigError, read_parameters

STATE_DTYPES = {name: np.dtype(name) for name in ("float32", "float16", "int32", "int64")}
STATE_SPEC_KEYS = {"input", "output", "dtype", "shape"}
# ONNX Runtime's type strings -> numpy dtypes ("float", "double": float32, float64; the rest by name).
ORT_TYPES = {f"tensor({name})": np.dtype({"float": "float32", "double": "float64"}.get(name, name))
             for name in ("float", "float16", "double", "int8", "int16", "int32", "int64", "uint8", "bool")}


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
    value_ranges: Mapping[str, tuple[int, int]]  # input name -> (low, high): its values lie in [low, high)
    max_dims: Mapping[str, tuple[int, ...]]  # input name -> the largest dims (no batch) of one request
    max_live_streams: int | None = None  # per instance (None: `auto`, resolved at load by `auto_stream_cap`)
    max_rows_per_run: int = 8  # the most rows in one session run
    instance_count: int = 1  # instance_group counts, summed: the instances share the host's memory
    # sequence_batching.oldest.max_candidate_sequences: more live sequences never reach the model.
    max_candidate_sequences: int | None = None
    intra_op_spinning: bool = True  # ONNX Runtime's intra-op threads spin while waiting for work

    @property
    def state_bytes_per_stream(self) -> int:
        return sum(math.prod(s.shape) * s.dtype.itemsize for s in self.states)

    @property
    def output_names(self) -> list[str]:
        """What one session run returns, in order: the config's outputs, then each state's output."""
        return [t.name for t in self.outputs] + [s.output for s in self.states]


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
        if set(entry) - {"description"} != STATE_SPEC_KEYS:
            raise ValueError(f"entry {index} must have exactly the keys {sorted(STATE_SPEC_KEYS)} "
                             f"(and optionally 'description'), got {sorted(entry)}")
        if entry["dtype"] not in STATE_DTYPES:
            raise ValueError(f"entry {index} dtype {entry['dtype']!r} is not one of {sorted(STATE_DTYPES)}")
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(_is_int(dim) and dim > 0 for dim in shape):
            raise ValueError(f"entry {index} shape must be a list of positive ints, got {shape!r}")
        for key in ("input", "output"):
            if not isinstance(entry[key], str) or not entry[key]:
                raise ValueError(f"entry {index} {key} must be a non-empty string")
        states.append(StateTensor(entry["input"], entry["output"], STATE_DTYPES[entry["dtype"]], tuple(shape)))
    names = [s.input for s in states] + [s.output for s in states]
    if len(set(names)) != len(names):
        raise ValueError(f"reuses a tensor name: {names}")
    return tuple(states)


def parse_value_ranges(text: str) -> dict[str, tuple[int, int]]:
    """Parse the `value_ranges` parameter: {"input name": [low, high], ...}, values in [low, high)."""
    ranges = _json(text)
    if not isinstance(ranges, dict):
        raise ValueError(f'must be a JSON object {{"input name": [low, high], ...}}, got {text!r}')
    for name, bounds in ranges.items():
        if not (isinstance(bounds, list) and len(bounds) == 2 and all(map(_is_int, bounds))
                and bounds[0] < bounds[1]):
            raise ValueError(f"input '{name}': expected [low, high] with integers low < high, got {bounds!r}")
    return {name: (low, high) for name, (low, high) in ranges.items()}


def parse_max_dims(text: str) -> dict[str, tuple[int, ...]]:
    """Parse the `max_dims` parameter: {"input name": [dim, ...], ...}, positive ints, no batch dim."""
    limits = _json(text)
    if not isinstance(limits, dict):
        raise ValueError(f'must be a JSON object {{"input name": [dim, ...], ...}}, got {text!r}')
    for name, dims in limits.items():
        if not (isinstance(dims, list) and dims and all(_is_int(dim) and dim > 0 for dim in dims)):
            raise ValueError(f"input '{name}': expected a list of positive integers, got {dims!r}")
    return {name: tuple(dims) for name, dims in limits.items()}


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


def parse_model_config(config: Mapping, triton_string_to_numpy: Callable[[str], type]) -> DecoderConfig:
    """Read everything the model needs from its config (the JSON Triton hands to initialize).
    Raises ValueError (ConfigError for a parameter) on anything missing, malformed or unsupported."""
    sequence_batching = _sequence_batching(config)
    max_batch_size = int(config.get("max_batch_size", 0))
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be > 0 (requests of different sequences are batched, each with a "
                         f"leading batch dimension of 1), got {max_batch_size}")
    values, idle_timeout_s = read_parameters(config, PARAMETER_TYPES)
    if values["intra_op_threads"] < 0:
        raise ConfigError("intra_op_threads", f"must be >= 0 (0: ONNX Runtime's default), got {values['intra_op_threads']}")
    # Every other parameter is the DecoderConfig field of the same name.
    decoder = DecoderConfig(
        inputs=_io_tensors(config, "input", triton_string_to_numpy),
        outputs=_io_tensors(config, "output", triton_string_to_numpy),
        states=values.pop("state_spec"),
        max_batch_size=max_batch_size,
        idle_timeout_s=idle_timeout_s,
        instance_count=max(1, sum(int(group.get("count", 1)) for group in config.get("instance_group") or [{}])),
        max_candidate_sequences=_max_candidate_sequences(sequence_batching),
        **values,
    )
    _check_tensor_names(decoder)
    return decoder


def _sequence_batching(config: Mapping) -> Mapping:
    sequence_batching = config.get("sequence_batching")
    if sequence_batching is None:
        raise ValueError("this model keeps per-sequence state: the config needs sequence_batching")
    if sequence_batching.get("state"):
        raise ValueError("remove sequence_batching.state: the Python backend ignores it; the state is described "
                         "by the state_spec parameter")
    return sequence_batching


def _io_tensors(config: Mapping, section: str, triton_string_to_numpy: Callable[[str], type]) -> tuple[IOTensor, ...]:
    """The config's `input` or `output` list (the non-state tensors); at least one."""
    tensors = tuple(
        IOTensor(entry["name"], np.dtype(triton_string_to_numpy(entry["data_type"])),
                 tuple(int(dim) for dim in entry.get("dims", [])))
        for entry in config.get(section, [])
    )
    if not tensors:
        raise ValueError(f"the config lists no {section}")
    return tensors


def _check_tensor_names(decoder: DecoderConfig) -> None:
    """State tensors stay out of the config's inputs/outputs; `value_ranges` and `max_dims` name
    config inputs, and `max_dims` fits each one's dims."""
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


def _max_candidate_sequences(sequence_batching: Mapping) -> int | None:
    value = (sequence_batching.get("oldest") or {}).get("max_candidate_sequences")
    try:
        return int(value) if value is not None and int(value) > 0 else None
    except (TypeError, ValueError):
        return None


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
        raise ValueError(f"ONNX inputs {sorted(graph_inputs)} do not match config inputs + state inputs "
                         f"{expected_inputs} (missing from the graph: {missing}, not fed: {unfed})")
    missing = [name for name in config.output_names if name not in graph_outputs]
    if missing:
        raise ValueError(f"ONNX outputs {sorted(graph_outputs)} lack {missing}")

    def check(arg, dtype: np.dtype, dims: tuple[int, ...], what: str) -> tuple[int, ...]:
        return _check_graph_tensor(arg, dtype, dims, what, config.max_batch_size)

    inputs = tuple(IOTensor(t.name, t.dtype, check(graph_inputs[t.name], t.dtype, t.dims, "input"))
                   for t in config.inputs)
    for t in config.outputs:
        check(graph_outputs[t.name], t.dtype, t.dims, "output")
    for s in config.states:
        check(graph_inputs[s.input], s.dtype, s.shape, "state input")
        check(graph_outputs[s.output], s.dtype, s.shape, "state output")
    return dataclasses.replace(config, inputs=inputs)


def _check_graph_tensor(arg, dtype: np.dtype, dims: tuple[int, ...], what: str, max_batch_size: int) -> tuple[int, ...]:
    """Check one graph tensor against the config's dtype and per-row `dims` (batch first, wide
    enough for `max_batch_size`); returns `dims` with the -1s the graph fixes made fixed."""
    if ORT_TYPES.get(arg.type) != dtype:
        raise ValueError(f"{what} '{arg.name}': ONNX type {arg.type}, expected {dtype}")
    # ONNX Runtime reports a dynamic dimension as a name or None: both become None.
    graph_dims = tuple(dim if isinstance(dim, int) and dim >= 0 else None for dim in arg.shape)
    if len(graph_dims) != len(dims) + 1:
        raise ValueError(f"{what} '{arg.name}': ONNX shape {list(arg.shape)} is not [batch] + {list(dims)}")
    batch = graph_dims[0]
    if batch is not None and batch < max_batch_size:
        raise ValueError(f"{what} '{arg.name}': ONNX batch dimension is fixed to {batch}, below "
                         f"max_batch_size {max_batch_size}")
    merged = []
    for graph_dim, dim in zip(graph_dims[1:], dims):
        if graph_dim is not None and dim not in (-1, graph_dim):
            raise ValueError(f"{what} '{arg.name}': ONNX shape {list(arg.shape)} does not match {list(dims)}")
        merged.append(graph_dim if dim == -1 and graph_dim is not None else dim)
    return tuple(merged)
