"""Core of the python-ort `mimi_decoder`: a streaming ONNX step whose per-sequence state (the Python backend ignores
a `state` block) the model keeps: zeros on START, dropped on END and after the idle timeout. One session run per
input shape of a batch; a bad request fails alone. Pure numpy + stdlib."""

from __future__ import annotations

import collections
import time
import traceback
from typing import Callable, Sequence

import numpy as np

from model_errors import ModelError
from python_ort_config import DecoderConfig

# One request: its sequence (correlation id), flags and inputs by name (`[1, *dims]`, as Triton checked them).
StepRequest = collections.namedtuple("StepRequest", "sequence_id start end inputs")


def _waves(requests: Sequence[StepRequest]) -> list[list[int]]:
    """Request indices in waves, a sequence's n-th request in the n-th: its steps run in order."""
    waves, seen = collections.defaultdict(list), collections.Counter()
    for index, request in enumerate(requests):
        waves[seen[request.sequence_id]].append(index)
        seen[request.sequence_id] += 1
    return list(waves.values())


def _stack(parts: list[np.ndarray]) -> np.ndarray:  # one row as it is: a stream's state is megabytes
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class StreamingDecoderCore:
    """Per-sequence state and batched steps; not thread-safe. `run(feeds)` runs one batched step: inputs and
    state inputs by name, `[rows, ...]` each -> the outputs in the order of `config.output_names`."""

    def __init__(self, config: DecoderConfig, run: Callable[[dict[str, np.ndarray]], Sequence[np.ndarray]],
                 clock: Callable[[], float] = time.monotonic, model_name: str = "decoder",
                 log_error: Callable[[str], None] = lambda message: None):
        self.config = config
        self._run, self._clock, self._model_name, self._log_error = run, clock, model_name, log_error
        self._zeros = tuple(np.zeros((1, *state.shape), state.dtype) for state in config.states)
        # sequence id -> (its state: one `[1, *shape]` row per state tensor, the end of its last step)
        self._streams: dict[int, tuple[tuple[np.ndarray, ...], float]] = {}
        self.runs_total = self.rows_total = self.expired_total = self.refused_total = 0  # read by METRIC_FAMILIES
        self.run_sizes: collections.deque[int] = collections.deque(maxlen=4096)  # emptied by the metrics

    @property
    def live_streams(self) -> int:
        return len(self._streams)

    def expire_idle(self, keep: frozenset = frozenset()) -> int:
        """Drop the streams idle past the timeout since their last step, but those in `keep`; returns how many."""
        now = self._clock()
        idle = [sid for sid, (_, last_used) in self._streams.items()
                if now - last_used > self.config.idle_timeout_s and sid not in keep]
        for sid in idle:
            del self._streams[sid]
        self.expired_total += len(idle)
        return len(idle)

    def _row_inputs(self, request: StepRequest) -> dict[str, np.ndarray]:
        """One request's inputs, checked past what Triton checks (dtype, dims and batch 1)."""
        sequence_id = request.sequence_id
        if not isinstance(sequence_id, int) or isinstance(sequence_id, bool) or sequence_id <= 0:
            raise ModelError("correlation_id",
                             f"this model needs a sequence: send a non-zero uint64 correlation id, got {sequence_id!r}")
        rows = {}
        for spec in self.config.inputs:
            array = request.inputs[spec.name]
            limit = self.config.max_dims.get(spec.name, ())
            if any(got > most for got, most in zip(array.shape[1:], limit)):
                raise ModelError("shape", f"input '{spec.name}' has shape {list(array.shape)}, at most "
                                 f"{[1, *limit]} per request (parameter max_dims)")
            bounds = self.config.value_ranges.get(spec.name)
            if bounds is not None and array.size and (array.min() < bounds[0] or array.max() >= bounds[1]):
                # Checked here so that a bad row fails alone instead of failing the batched run.
                raise ModelError("value_range", f"input '{spec.name}' holds values in [{array.min()}, {array.max()}], "
                                 f"outside [{bounds[0]}, {bounds[1]}) (parameter value_ranges)")
            rows[spec.name] = array
        return rows

    def _admit(self, request: StepRequest, new_streams: int) -> bool:
        """Whether the request opens a stream (`new_streams`: opened earlier in this wave); ModelError if refused."""
        timeout_s, known = self.config.idle_timeout_s, request.sequence_id in self._streams
        if not request.start and not known:
            raise ModelError("unknown_sequence", f"sequence {request.sequence_id} has no decoder state in model "
                             f"'{self._model_name}': send its first request with the START flag (it was never "
                             f"started, has ended, or was idle for more than {timeout_s:g} s)")
        if not request.start or request.end or known:
            return False
        live = len(self._streams) + new_streams
        if live >= self.config.max_live_streams:
            self.refused_total += 1
            raise ModelError("stream_cap", f"resource exhausted: model '{self._model_name}' already holds {live} live "
                             f"streams, its limit (max_live_streams={self.config.max_live_streams} per instance); this "
                             "START was refused and no stream was affected. Retry later, or END streams that are done "
                             f"(an abandoned stream is freed after {timeout_s:g} s idle)", "UNAVAILABLE")
        return True

    def step(self, requests: Sequence[StepRequest]) -> list[dict[str, np.ndarray] | ModelError]:
        """Run a step per request; returns per request its outputs (`[1, *dims]`) or a ModelError."""
        results: list = [None] * len(requests)
        self.expire_idle(keep=frozenset(r.sequence_id for r in requests))
        for wave in _waves(requests):
            groups: dict[tuple, list] = {}
            new_streams = 0
            for index in wave:
                request = requests[index]
                try:
                    rows = self._row_inputs(request)
                    new_streams += self._admit(request, new_streams)
                except ModelError as error:
                    results[index] = error
                    if request.end:  # Triton has already released the sequence: nothing can reach this state
                        self._streams.pop(request.sequence_id, None)
                    continue
                groups.setdefault(tuple(array.shape for array in rows.values()), []).append((index, request, rows))
            for members in groups.values():
                self._run_group(members, results)
        return results

    def _run_group(self, members: list, results: list) -> None:
        """One session run of `members` ((index, request, inputs) of equal shapes), results into `results`."""
        states = [self._zeros if request.start else self._streams[request.sequence_id][0] for _, request, _ in members]
        feeds = {spec.name: _stack([rows[spec.name] for *_, rows in members]) for spec in self.config.inputs}
        for position, state in enumerate(self.config.states):
            feeds[state.input] = _stack([rows[position] for rows in states])
        count = len(members)
        try:
            outputs = list(self._run(feeds))
            if len(outputs) != len(self.config.output_names) or any(out.shape[0] != count for out in outputs):
                raise RuntimeError(f"the step returned shapes {[list(out.shape) for out in outputs]} for {count} rows")
        except Exception as exc:
            # The members' state is unknown now: their sequences end.
            for index, request, _ in members:
                results[index] = ModelError("decoder", f"decoder step failed ({type(exc).__name__}: {exc}); the "
                                            "sequence was ended, START it again", "INTERNAL")
                self._streams.pop(request.sequence_id, None)
            self._log_error(f"{self._model_name}: batched step of {count} rows failed:\n{traceback.format_exc()}")
            return
        now, num_outputs = self._clock(), len(self.config.outputs)
        own = (lambda rows: rows) if count == 1 else np.copy  # a view would keep the whole run's state alive
        for row, (index, request, _) in enumerate(members):
            results[index] = {spec.name: outputs[k][row : row + 1] for k, spec in enumerate(self.config.outputs)}
            if request.end:
                self._streams.pop(request.sequence_id, None)
            else:
                self._streams[request.sequence_id] = tuple(own(out[row : row + 1]) for out in outputs[num_outputs:]), now
        self.runs_total += 1
        self.rows_total += count
        self.run_sizes.append(count)
