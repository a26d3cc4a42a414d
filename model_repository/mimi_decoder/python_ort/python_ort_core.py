"""Core of the python-ort `mimi_decoder`: a streaming ONNX step whose per-sequence state this model keeps
itself (the Python backend ignores `sequence_batching { state [...] }`). Pure numpy + stdlib.

- per correlation id, one row of each state tensor (a row of the arrays its last run wrote,
  `StateRows`, not a copy); START (also on a live sequence) sets it to zeros, END drops it after the
  step, and a sequence idle past the idle timeout is dropped (Triton frees it without telling the model);
- the valid requests of one `execute()` run as batched session runs of equal input shapes, at most
  `max_rows_per_run` rows each, the outputs split back per request;
- a request that fails validation gets its own error and changes nothing (but an END still ends its
  sequence: Triton has already released it); a START beyond `max_live_streams` is refused.
"""

from __future__ import annotations

import collections
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from model_errors import ModelError
from python_ort_config import DecoderConfig
from python_ort_memory import StateBuffers, StateRows, StreamStateRow, reuse_order, state_buffer_limit


@dataclass
class StepRequest:
    """One request as the core sees it: its sequence (correlation id), its flags, its non-state
    inputs as received (`[1, *dims]`)."""

    sequence_id: int
    start: bool
    end: bool
    inputs: Mapping[str, np.ndarray | None]


def _format_dims(dims: Sequence[int]) -> str:
    return "[" + ", ".join("-1" if dim == -1 else str(dim) for dim in dims) + "]"


def _waves(requests: Sequence[StepRequest]) -> list[list[int]]:
    """Request indices in waves: each sequence's first request in the first wave, its second in the
    second, and so on, so a wave holds a sequence at most once and its steps run in order."""
    waves: list[list[int]] = []
    seen: dict = {}
    for index, request in enumerate(requests):
        wave = seen.get(request.sequence_id, 0)
        seen[request.sequence_id] = wave + 1
        if wave == len(waves):
            waves.append([])
        waves[wave].append(index)
    return waves


class StreamingDecoderCore:
    """Per-sequence state and batched stepping, independent of Triton. Not thread-safe.

    `run(feeds)` runs one batched step: `feeds` maps every input and state-input name to a
    `[rows, ...]` array; it returns the outputs in the order of `config.output_names`, each
    `[rows, ...]`, its state outputs new arrays (kept as the streams' state, then given back to
    `buffers`). `release(feeds)`, when given, runs one step whose scratch memory goes back to the
    system afterwards. `buffers` (default: its own, of `state_buffer_limit`) should be the one `run`
    allocates its state outputs from. Request failures are `ModelError`s."""

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
        # One shared, read-only zero row per state: what a fresh stream feeds on its first step.
        self._zero_rows = [np.zeros((1, *state.shape), dtype=state.dtype) for state in config.states]
        for zero in self._zero_rows:
            zero.flags.writeable = False
        self._streams: dict[int, StreamStateRow] = {}
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

    def expire_idle(self, now: float | None = None, keep: frozenset = frozenset()) -> int:
        """Drop streams idle for longer than the idle timeout (measured from the end of their last
        step), except those in `keep`. Returns how many were dropped."""
        now = self._clock() if now is None else now
        limit = self.config.idle_timeout_s
        idle = [sid for sid, stream in self._streams.items() if now - stream.last_used > limit and sid not in keep]
        for sid in idle:
            self._remove(sid, keep_arrays=False)
        self.expired_total += len(idle)
        return len(idle)

    def release_idle_memory(self, idle_s: float = 1.0, now: float | None = None) -> bool:
        """After `idle_s` without a run, let the kept state arrays go and run one throw-away zero row
        through `release` (once per idle period). Returns whether anything was let go."""
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
        return ModelError("stream_cap", f"resource exhausted: model '{self._model_name}' already holds {live} live "
                          f"streams, its limit (max_live_streams={self.config.max_live_streams} per instance); this "
                          "START was refused and no stream was affected. Retry later, or END streams that are done (an "
                          f"abandoned stream is freed after {self.config.idle_timeout_s:g} s idle)", "UNAVAILABLE")

    def _unknown_sequence(self, sequence_id) -> ModelError:
        return ModelError("unknown_sequence", f"sequence {sequence_id} has no decoder state in model "
                          f"'{self._model_name}': send its first request with the START flag (it was never started, "
                          f"has ended, or was idle for more than {self.config.idle_timeout_s:g} s)")

    def _row_inputs(self, request: StepRequest) -> dict[str, np.ndarray]:
        """Validate one request's inputs; return them as `[1, *dims]` arrays (views, no copy)."""
        sequence_id = request.sequence_id
        if not isinstance(sequence_id, int) or isinstance(sequence_id, bool) or sequence_id <= 0:
            raise ModelError("correlation_id",
                             f"this model needs a sequence: send a non-zero uint64 correlation id, got {sequence_id!r}")
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
                raise ModelError("shape", f"input '{spec.name}' has shape {list(array.shape)}, expected "
                                 f"{_format_dims((1, *spec.dims))} (one request is one step of one sequence)")
            limit = self.config.max_dims.get(spec.name)
            if limit is not None and any(got > most for got, most in zip(array.shape[1:], limit)):
                raise ModelError("shape", f"input '{spec.name}' has shape {list(array.shape)}, at most "
                                 f"{[1, *limit]} per request (parameter max_dims)")
            bounds = self.config.value_ranges.get(spec.name)
            if bounds is not None and array.size and (array.min() < bounds[0] or array.max() >= bounds[1]):
                # Checked here so a bad row fails alone instead of failing the batched run.
                raise ModelError("value_range", f"input '{spec.name}' holds values in [{array.min()}, {array.max()}], "
                                 f"outside [{bounds[0]}, {bounds[1]}) (parameter value_ranges)")
            rows[spec.name] = array
        return rows

    def _admitted_inputs(self, request: StepRequest, admitted: set) -> dict[str, np.ndarray]:
        """Validate one request and let its stream in; raises ModelError for a step of a sequence
        without state or a START beyond max_live_streams. `admitted`: new streams of this step()."""
        rows = self._row_inputs(request)
        if not request.start and request.sequence_id not in self._streams:
            raise self._unknown_sequence(request.sequence_id)
        if (request.start and not request.end and request.sequence_id not in self._streams
                and request.sequence_id not in admitted):
            live = len(self._streams) + len(admitted)
            if live >= self.config.max_live_streams:
                raise self._stream_cap_reached(live)
            admitted.add(request.sequence_id)
        return rows

    def step(self, requests: Sequence[StepRequest]) -> list[dict[str, np.ndarray] | ModelError]:
        """Run one step for each request; returns, per request, its outputs (`[1, *dims]`) or a
        ModelError. Requests of one sequence run in order, each in a following run."""
        results: list[dict[str, np.ndarray] | ModelError | None] = [None] * len(requests)
        self.expire_idle(keep=frozenset(r.sequence_id for r in requests))
        admitted: set = set()
        for wave in _waves(requests):
            groups: dict[tuple, list[tuple[int, dict[str, np.ndarray]]]] = {}
            for index in wave:
                request = requests[index]
                try:
                    rows = self._admitted_inputs(request, admitted)
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
        """One session run for `members` ((request index, inputs) pairs of equal input shapes, at
        most max_rows_per_run): each member's result goes into `results`, its new state is kept."""
        previous = [self._previous_state(requests[index]) for index, _ in members]
        order = reuse_order(previous)
        if order is not None:
            # Exactly the streams of one earlier run: feed its output states back without a copy,
            # with this run's rows in that run's order.
            members = [members[k] for k in order]
            previous = [previous[k] for k in order]
            reused = previous[0][0]
            state_feeds, gathered = list(reused.arrays), []
        else:
            reused = None
            state_feeds, gathered = self._gather_states(previous)
        feeds = self._feeds(members, state_feeds)
        try:
            outputs = self._run_checked(feeds, len(members))
        except Exception as exc:
            self._fail_group(requests, members, results, exc)
            self.buffers.give(gathered)  # inputs gathered here: back to the buffers after the run
            return
        now = self._clock()
        self._keep_results(requests, members, outputs, feeds, results, now)
        self.buffers.give(gathered)
        self._release_shared_rows(previous, reused)
        self.runs_total += 1
        self._runs_since_release += 1
        self._last_run_s = now
        self.rows_total += len(members)
        self.run_sizes.append(len(members))

    def _previous_state(self, request: StepRequest) -> tuple[StateRows | None, int]:
        stream = None if request.start else self._streams[request.sequence_id]
        return (stream.rows, stream.row) if stream is not None else (None, 0)

    def _gather_states(self, previous) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The run's state feeds, one `[rows, ...]` array per state (zeros for a fresh stream), and the
        arrays taken from the buffers for them (to give back after the run)."""
        state_feeds, gathered = [], []
        for position, zero in enumerate(self._zero_rows):
            parts = [rows.arrays[position][row : row + 1] if rows is not None else zero for rows, row in previous]
            if len(parts) == 1:
                state_feeds.append(parts[0])
            else:
                array = self.buffers.take((len(parts), *zero.shape[1:]), zero.dtype)
                state_feeds.append(np.concatenate(parts, out=array))
                gathered.append(array)
        return state_feeds, gathered

    def _feeds(self, members, state_feeds: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """The run's feeds: the members' inputs concatenated along the batch, then the state feeds."""
        feeds = {}
        for spec in self.config.inputs:
            parts = [rows[spec.name] for _, rows in members]
            feeds[spec.name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        for state, array in zip(self.config.states, state_feeds):
            feeds[state.input] = array
        return feeds

    def _run_checked(self, feeds: dict[str, np.ndarray], count: int) -> list[np.ndarray]:
        outputs = list(self._run(feeds))
        if len(outputs) != len(self.config.output_names) or any(out.shape[0] != count for out in outputs):
            raise RuntimeError(f"the step returned shapes {[list(o.shape) for o in outputs]} for {count} rows")
        return outputs

    def _fail_group(self, requests, members, results, exc: Exception) -> None:
        """A failed run ends its members' sequences (their state is unknown now); call it in the
        `except` block, whose traceback goes to the log."""
        for index, _ in members:
            results[index] = ModelError("decoder", f"decoder step failed ({type(exc).__name__}: {exc}); the "
                                        "sequence was ended, START it again", "INTERNAL")
            self._remove(requests[index].sequence_id)
        self._log_error(f"{self._model_name}: batched step of {len(members)} rows failed:\n{traceback.format_exc()}")

    def _keep_results(self, requests, members, outputs, feeds, results, now: float) -> None:
        """Each member's outputs (`[1, *dims]` views) into `results`; its stream now holds its row
        of the run's output states (an END drops the stream instead)."""
        fed = {id(array) for array in feeds.values()}
        # A state output that is one of the inputs (a run may hand one back unchanged) becomes an
        # array of its own: the input's array may go back to the buffers after the run.
        num_outputs = len(self.config.outputs)
        new_rows = StateRows([np.array(out) if id(out) in fed else out for out in outputs[num_outputs:]])
        for row, (index, _) in enumerate(members):
            request = requests[index]
            results[index] = {spec.name: outputs[k][row : row + 1] for k, spec in enumerate(self.config.outputs)}
            if request.end:
                self._remove(request.sequence_id)
                continue
            stream = self._streams.get(request.sequence_id)
            if stream is None:
                stream = self._streams[request.sequence_id] = StreamStateRow(None, 0, now)
            self._hold(stream, new_rows, row)
            stream.last_used = now

    def _hold(self, stream: StreamStateRow, rows: StateRows, row: int) -> None:
        """Point `stream` at row `row` of `rows`, letting go of the rows it held."""
        rows.holders += 1
        old, stream.rows, stream.row = stream.rows, rows, row
        if old is not None:
            self._let_go(old)

    def _let_go(self, rows: StateRows, keep_arrays: bool = True) -> None:
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
                self._hold(stream, StateRows(own), 0)
