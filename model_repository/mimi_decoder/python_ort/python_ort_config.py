"""The python-ort `mimi_decoder`'s config, read strictly (`ConfigError` names a bad parameter) and checked against
the ONNX graph: anything wrong raises ValueError, a failed load. `input` / `output` list the non-state tensors."""

from __future__ import annotations

import json
from collections import namedtuple
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from model_errors import ConfigError, read_parameters

STATE_DTYPES = ("float32", "float16", "int32", "int64")
STATE_SPEC_KEYS = {"input", "output", "dtype", "shape"}
# ONNX Runtime's type strings -> numpy dtypes.
ORT_TYPES = {f"tensor({name})": np.dtype({"float": "float32", "double": "float64"}.get(name, name))
             for name in ("float", "float16", "double", "int8", "int16", "int32", "int64", "uint8", "bool")}


# A state tensor, fed as `input` and returned updated as `output`; `shape` is per stream (no batch).
StateTensor = namedtuple("StateTensor", "input output dtype shape")
# A non-state input or output; `dims` is per request row, -1 for any size.
IOTensor = namedtuple("IOTensor", "name dtype dims")


@dataclass(frozen=True)
class DecoderConfig:  # the tensors (state_spec: `states`), the idle timeout, the other parameters
    inputs: tuple[IOTensor, ...]
    outputs: tuple[IOTensor, ...]
    states: tuple[StateTensor, ...]
    idle_timeout_s: float
    onnx_file: str
    intra_op_threads: int
    value_ranges: Mapping[str, tuple[int, int]]
    max_dims: Mapping[str, tuple[int, ...]]
    max_live_streams: int

    @property
    def output_names(self) -> list[str]:  # what one session run returns, in order
        return [t.name for t in self.outputs] + [s.output for s in self.states]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_state_spec(text: str) -> tuple[StateTensor, ...]:
    entries = json.loads(text)
    if not isinstance(entries, list) or not entries:
        raise ValueError("must be a non-empty JSON list")
    states = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - {"description"} != STATE_SPEC_KEYS:
            raise ValueError(f"entry {index} must have exactly the keys {sorted(STATE_SPEC_KEYS)} "
                             f"(and optionally 'description'), got {entry!r}")
        if entry["dtype"] not in STATE_DTYPES:
            raise ValueError(f"entry {index} dtype {entry['dtype']!r} is not one of {list(STATE_DTYPES)}")
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(_is_int(dim) and dim > 0 for dim in shape):
            raise ValueError(f"entry {index} shape must be a list of positive ints, got {shape!r}")
        states.append(StateTensor(entry["input"], entry["output"], np.dtype(entry["dtype"]), tuple(shape)))
    names = [s.input for s in states] + [s.output for s in states]
    if len(set(names)) != len(names):
        raise ValueError(f"reuses a tensor name: {names}")
    return tuple(states)


def _per_input(valid: Callable[[list], Any], expected: str) -> Callable[[str], dict]:
    """A parser of a JSON object {"input name": a list that `valid` accepts, ...}; lists become tuples."""

    def parse(text: str) -> dict:
        table = json.loads(text)
        if not isinstance(table, dict):
            raise ValueError(f'must be a JSON object {{"input name": {expected}, ...}}, got {text!r}')
        for name, value in table.items():
            if not (isinstance(value, list) and valid(value)):
                raise ValueError(f"input '{name}': expected {expected}, got {value!r}")
        return {name: tuple(value) for name, value in table.items()}

    return parse


# The config's `parameters` (strings, all required, no other accepted): name -> parser of its value.
# value_ranges and max_dims are checked per request by the core, so that a bad row fails alone.
PARAMETER_TYPES = {
    "onnx_file": str,  # the ONNX file, relative to the version folder
    "intra_op_threads": int,  # ONNX Runtime intra-op threads (0: its default)
    # JSON list of {"input", "output", "dtype" (STATE_DTYPES), "shape" (per stream)}; a "description" is ignored
    "state_spec": parse_state_spec,
    # JSON object, input name -> [low, high]: its values must lie in [low, high)
    "value_ranges": _per_input(lambda b: len(b) == 2 and all(map(_is_int, b)) and b[0] < b[1],
                               "[low, high] with integers low < high"),
    # JSON object, input name -> its largest dims per request (bounds the config's -1 dims)
    "max_dims": _per_input(lambda dims: dims and all(_is_int(dim) and dim > 0 for dim in dims),
                           "a list of positive integers"),
    "max_live_streams": int,  # streams this instance holds state for; a START beyond is refused (UNAVAILABLE)
}


def parse_model_config(config: Mapping, triton_string_to_numpy: Callable[[str], type]) -> DecoderConfig:
    """Read everything the model needs from its config (the JSON Triton hands to initialize)."""
    sequence_batching = config.get("sequence_batching")
    if sequence_batching is None:
        raise ValueError("this model keeps per-sequence state: the config needs sequence_batching")
    if sequence_batching.get("state"):
        raise ValueError("remove sequence_batching.state: the Python backend ignores it; the state is described "
                         "by the state_spec parameter")
    if int(config.get("max_batch_size", 0)) < 1:
        raise ValueError(f"max_batch_size must be > 0 (requests of different sequences are batched, each with a "
                         f"leading batch dimension of 1), got {config.get('max_batch_size', 0)}")
    values, idle_timeout_s = read_parameters(config, PARAMETER_TYPES)
    for name, low in (("intra_op_threads", 0), ("max_live_streams", 1)):
        if values[name] < low:
            raise ConfigError(name, f"must be >= {low}, got {values[name]}")

    def tensors(section: str) -> tuple[IOTensor, ...]:
        found = tuple(IOTensor(entry["name"], np.dtype(triton_string_to_numpy(entry["data_type"])),
                               tuple(int(dim) for dim in entry.get("dims", []))) for entry in config.get(section, []))
        if not found:
            raise ValueError(f"the config lists no {section}")
        return found

    decoder = DecoderConfig(inputs=tensors("input"), outputs=tensors("output"), states=values.pop("state_spec"),
                            idle_timeout_s=idle_timeout_s, **values)
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


def check_against_onnx(config: DecoderConfig, session_inputs, session_outputs) -> None:
    """Check the config against the ONNX graph (`session.get_inputs()` / `get_outputs()`): the same tensors,
    dtypes and ranks, a dynamic batch and the config's fixed dims (a config -1 may meet a fixed graph dim)."""
    graph_inputs = {arg.name: arg for arg in session_inputs}
    graph_outputs = {arg.name: arg for arg in session_outputs}
    input_names = [t.name for t in config.inputs] + [s.input for s in config.states]
    for what, graph, names in (("inputs", graph_inputs, input_names), ("outputs", graph_outputs, config.output_names)):
        if sorted(graph) != sorted(names):
            raise ValueError(f"ONNX {what} {sorted(graph)} are not the config's {what} and state {what} {names}")
    checks = [(graph_inputs[t.name], t.dtype, t.dims, "input") for t in config.inputs]
    checks += [(graph_outputs[t.name], t.dtype, t.dims, "output") for t in config.outputs]
    checks += [(graph[name], s.dtype, s.shape, f"state {what}") for s in config.states
               for graph, name, what in ((graph_inputs, s.input, "input"), (graph_outputs, s.output, "output"))]
    for arg, dtype, dims, what in checks:
        if ORT_TYPES.get(arg.type) != dtype:
            raise ValueError(f"{what} '{arg.name}': ONNX type {arg.type}, expected {dtype}")
        # ONNX Runtime reports a dynamic dimension as a name or None.
        shape = [dim if _is_int(dim) and dim >= 0 else -1 for dim in arg.shape]
        if len(shape) != len(dims) + 1 or shape[0] != -1 or any(-1 not in (g, d) and g != d
                                                                for g, d in zip(shape[1:], dims)):
            raise ValueError(f"{what} '{arg.name}': ONNX shape {list(arg.shape)} is not [batch] + {list(dims)} "
                             "with a dynamic batch")
