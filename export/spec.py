"""The decoder step's tensor spec: the one source of names, dtypes and per-stream shapes for the ONNX export,
the TensorRT profile and every rendered config. Standard library only: the serving side reads it from JSON."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass

TRITON_DTYPES = {"int32": "TYPE_INT32", "int64": "TYPE_INT64", "float32": "TYPE_FP32", "float16": "TYPE_FP16"}
ONNX_ELEM_TYPES = {"int32": 6, "int64": 7, "float32": 1, "float16": 10}
DTYPE_BYTES = {"int32": 4, "int64": 8, "float32": 4, "float16": 2}


@dataclass(frozen=True)
class TensorSpec:
    """`shape` is per stream (without the leading batch dimension); -1 is the frame dimension."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StateSpec:
    """A streaming state tensor: fed as `input`, returned updated as `output`, all-zero on START."""

    input: str
    output: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class DecoderSpec:
    """Everything a server needs to know about one exported decoder step."""

    num_codebooks: int
    codebook_size: int
    max_frames_per_step: int
    samples_per_frame: int
    sample_rate_hz: int
    window: str
    kv_cache_dtype: str
    states: tuple[StateSpec, ...]

    @property
    def codes(self) -> TensorSpec:
        return TensorSpec("codes", "int32", (self.num_codebooks, -1))

    pcm = TensorSpec("pcm", "float32", (-1,))

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return (self.codes, *(TensorSpec(s.input, s.dtype, s.shape) for s in self.states))

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return (self.pcm, *(TensorSpec(s.output, s.dtype, s.shape) for s in self.states))

    def state_bytes_per_stream(self) -> int:
        return sum(DTYPE_BYTES[s.dtype] * math.prod(s.shape) for s in self.states)

    def validate(self) -> None:
        """Triton pairs states by position in the sorted input and output names (so names carry an index)."""
        pairs = {s.input: s.output for s in self.states}
        if [pairs[name] for name in sorted(pairs)] != sorted(pairs.values()):
            raise ValueError(f"state names sort differently on the input and output side: {sorted(pairs.items())}")
        names = [t.name for t in (*self.inputs, *self.outputs)]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tensor names in spec: {names}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DecoderSpec:
        states = tuple(StateSpec(**{**state, "shape": tuple(state["shape"])}) for state in data["states"])
        return cls(**{**data, "states": states})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()
