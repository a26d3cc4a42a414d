"""Triton Python-backend `mimi_decoder` (the python-ort target): the streaming ONNX step in ONNX Runtime,
with the per-sequence state kept by the model.

Thin on purpose: it reads the config, builds the ONNX Runtime session, turns tensors into numpy and
back and publishes the metrics; the rest is pure numpy beside it (`python_ort_config`, `_memory`,
`_core`) and in model_repository/common/. `export/render.py` copies these files into a rendered
`mimi_decoder/1/` next to `model.onnx` (Triton never loads them from here).
"""

import dataclasses
import json
import operator
import os
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

# The Python backend appends this version directory to sys.path before importing model.py
# (python_backend r24.10, ModelContext::StubSetup); keep the sibling imports working if it ever stops.
_MODEL_DIR = os.path.dirname(os.path.abspath(__file__))
if _MODEL_DIR not in sys.path:
    sys.path.insert(0, _MODEL_DIR)

import idle_sweeper  # noqa: E402
import model_errors  # noqa: E402
import model_lifecycle  # noqa: E402
import model_metrics  # noqa: E402
import python_ort_config as ort_config  # noqa: E402
import python_ort_core as core  # noqa: E402
import python_ort_memory as ort_memory  # noqa: E402

BATCH_SIZE_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


def create_session(path: Path, intra_op_threads: int, instance_kind: str, device_id: int, spinning: bool = True):
    """An ONNX Runtime session: CUDA for a GPU instance (onnxruntime-gpu), else CPU."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if intra_op_threads > 0:
        options.intra_op_num_threads = intra_op_threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if instance_kind.upper() == "GPU":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ValueError("a GPU instance needs onnxruntime-gpu (no CUDAExecutionProvider here)")
        providers = [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    return ort.InferenceSession(str(path), sess_options=options, providers=providers)


# (metric name, kind, description, the figure read from the core), published as changes so the
# instances add up; gauges leave with their instance.
_CORE_FIGURES = (
    ("mimi_decoder_live_streams", "GAUGE", "Sequences with decoder state held by the model",
     operator.attrgetter("live_streams")),
    ("mimi_decoder_state_buffer_bytes", "GAUGE",
     "Bytes of free state arrays kept for the next runs (let go when the model is idle)",
     operator.attrgetter("buffers.held_bytes")),
    ("mimi_decoder_batches_total", "COUNTER", "Batched decoder steps run (one session run each)",
     operator.attrgetter("runs_total")),
    ("mimi_decoder_batched_requests_total", "COUNTER", "Requests run in batched decoder steps (rows over all runs)",
     operator.attrgetter("rows_total")),
    ("mimi_decoder_expired_streams_total", "COUNTER", "Sequences whose decoder state was dropped after the idle timeout",
     operator.attrgetter("expired_total")),
    ("mimi_decoder_refused_streams_total", "COUNTER", "STARTs refused because the instance held max_live_streams streams",
     operator.attrgetter("refused_total")),
)


class _Metrics:
    """The model's Prometheus metrics, sent as changes (every call is an IPC round trip)."""

    def __init__(self, labels):
        family = pb_utils.MetricFamily
        # The families must outlive their metrics: a metric of a collected family stops working.
        self._families = []

        def metric(name, kind, description, **kwargs):
            self._families.append(family(name=name, description=description, kind=getattr(family, kind)))
            return self._families[-1].Metric(labels=labels, **kwargs)

        self._figures = [
            (model_metrics.DeltaMetric(metric(name, kind, description)), kind, read)
            for name, kind, description, read in _CORE_FIGURES
        ]
        self.batch_size = metric(
            "mimi_decoder_batch_size", "HISTOGRAM", "Rows per decoder session run", buckets=BATCH_SIZE_BUCKETS
        )

    def publish(self, decoder: core.StreamingDecoderCore) -> None:
        for delta, _, read in self._figures:
            delta.update(read(decoder))
        for size in decoder.run_sizes:
            self.batch_size.observe(size)
        decoder.run_sizes.clear()

    def close(self) -> None:
        # This instance's streams and buffers leave the shared gauges with it.
        for delta, kind, _ in self._figures:
            if kind == "GAUGE":
                delta.withdraw()
        # Metrics go before their families (python_backend custom-metrics contract).
        self._figures = self.batch_size = None
        self._families.clear()


class TritonPythonModel:
    def initialize(self, args):
        model_lifecycle.on_initialize()  # a dying stub's stacks go to the server's log
        self._name = args["model_name"]
        try:
            config = ort_config.parse_model_config(json.loads(args["model_config"]), pb_utils.triton_string_to_numpy)
            onnx_path = Path(args["model_repository"]) / args["model_version"] / config.onnx_file
            if not onnx_path.is_file():
                raise ValueError(f"ONNX file {onnx_path} does not exist (parameter onnx_file)")
            kind, device_id = args.get("model_instance_kind", "CPU"), int(args.get("model_instance_device_id", "0"))
            session = create_session(onnx_path, config.intra_op_threads, kind, device_id, config.intra_op_spinning)
            config = ort_config.check_against_onnx(config, session.get_inputs(), session.get_outputs())
            if config.max_live_streams is None:
                cap, derived = ort_memory.auto_stream_cap(config, ort_memory.available_memory_bytes())
                config = dataclasses.replace(config, max_live_streams=cap)
            else:
                derived = f"{config.max_live_streams} (configured)"
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"model '{self._name}': {exc}") from None

        mmap_fixed = ort_memory.fix_mmap_threshold()
        buffers = ort_memory.StateBuffers(ort_memory.state_buffer_limit(config))
        runner = ort_memory.BoundRunner(session, config, ort_memory.arena_release_options(kind, device_id), allocate=buffers.take)
        self._core = core.StreamingDecoderCore(
            config, runner, model_name=self._name, log_error=pb_utils.Logger.log_error, release=runner.release,
            buffers=buffers,
        )
        self._input_names = [t.name for t in config.inputs]
        self._start_flag = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
        self._end_flag = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
        pb_utils.Logger.log_info(
            f"{self._name}: {len(config.states)} state tensors ({config.state_bytes_per_stream / 2**20:.2f} MiB "
            f"per stream), idle timeout {config.idle_timeout_s:g} s, ONNX {onnx_path.name}, providers "
            f"{session.get_providers()}; max_live_streams {derived}; at most {config.max_rows_per_run} rows "
            f"per run; glibc mmap threshold {'pinned' if mmap_fixed else 'left as it is'}"
        )
        # Last: the sweeper thread calls _expire_idle, which needs the core and the metrics.
        self._metrics = model_metrics.GuardedMetrics(self._name, args["model_version"], _Metrics, pb_utils.Logger.log_warn)
        self._sweeper = idle_sweeper.IdleSweeper.started(
            self._name, config.idle_timeout_s, self._expire_idle, pb_utils.Logger.log_error
        )

    def _publish_metrics(self) -> None:
        self._metrics.report(lambda metrics: metrics.publish(self._core))

    def _expire_idle(self) -> None:
        # Called by the sweeper thread under its lock.
        expired = self._core.expire_idle()
        if self._core.release_idle_memory() or expired:
            self._publish_metrics()

    def execute(self, requests):
        step_requests = []
        for request in requests:
            tensors = {tensor.name(): tensor for tensor in request.inputs()}
            flags = request.flags()
            inputs = {name: tensors[name].as_numpy() if name in tensors else None for name in self._input_names}
            step_requests.append(core.StepRequest(request.correlation_id(), bool(flags & self._start_flag),
                                                  bool(flags & self._end_flag), inputs))
        with self._sweeper.lock:
            results = self._core.step(step_requests)
            self._publish_metrics()

        responses = []
        for result in results:
            if isinstance(result, model_errors.ModelError):
                if result.code == "INVALID_ARG":
                    pb_utils.Logger.log_verbose(f"{self._name}: rejected: {result}")
                error = pb_utils.TritonError(str(result), getattr(pb_utils.TritonError, result.code))
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
            else:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(name, array) for name, array in result.items()]))
        return responses

    def finalize(self):
        self._sweeper.close(pb_utils.Logger.log_warn)
        self._metrics.close()
        model_lifecycle.on_finalize()
