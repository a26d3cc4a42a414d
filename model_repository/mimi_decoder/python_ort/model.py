"""Triton Python-backend `mimi_decoder` (python-ort target): the streaming ONNX step in ONNX Runtime on the CPU,
state kept by the model. Thin: the rest is in `python_ort_config`, `python_ort_core` and common/."""

import json
import os
import sys
from pathlib import Path

import onnxruntime as ort
import triton_python_backend_utils as pb_utils

# The Python backend puts this directory on sys.path (r24.10); keep the sibling imports working if it stops.
_MODEL_DIR = os.path.dirname(os.path.abspath(__file__))
if _MODEL_DIR not in sys.path:
    sys.path.insert(0, _MODEL_DIR)

import idle_sweeper  # noqa: E402
import model_errors  # noqa: E402
import model_lifecycle  # noqa: E402
import python_ort_config as ort_config  # noqa: E402
import python_ort_core as core  # noqa: E402
from model_metrics import Family, ModelMetrics  # noqa: E402

# The custom metrics, filled from the core's statistics (Family: name, kind, help, field).
METRIC_FAMILIES = (
    Family("mimi_decoder_live_streams", "GAUGE", "Sequences with decoder state held by the model", "live_streams"),
    Family("mimi_decoder_batches_total", "COUNTER", "Batched decoder steps run (one session run each)", "runs_total"),
    Family("mimi_decoder_batched_requests_total", "COUNTER", "Requests run in batched decoder steps (rows over all runs)",
           "rows_total"),
    Family("mimi_decoder_expired_streams_total", "COUNTER",
           "Sequences whose decoder state was dropped after the idle timeout", "expired_total"),
    Family("mimi_decoder_refused_streams_total", "COUNTER",
           "STARTs refused because the instance held max_live_streams streams", "refused_total"),
    Family("mimi_decoder_batch_size", "HISTOGRAM", "Rows per decoder session run", "run_sizes",
           buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)),
)


class TritonPythonModel:
    def initialize(self, args):
        model_lifecycle.on_initialize()  # a dying stub's stacks go to the server's log
        self._name = args["model_name"]
        try:
            config = ort_config.parse_model_config(json.loads(args["model_config"]), pb_utils.triton_string_to_numpy)
            onnx_path = Path(args["model_repository"]) / args["model_version"] / config.onnx_file
            if not onnx_path.is_file():
                raise ValueError(f"ONNX file {onnx_path} does not exist (parameter onnx_file)")
            options = ort.SessionOptions()
            options.intra_op_num_threads = config.intra_op_threads  # 0: ONNX Runtime's default
            # Idle threads sleep instead of spinning, which would take cores from code2wav's stub and the server.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session = ort.InferenceSession(str(onnx_path), sess_options=options, providers=["CPUExecutionProvider"])
            ort_config.check_against_onnx(config, session.get_inputs(), session.get_outputs())
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"model '{self._name}': {exc}") from None

        output_names = config.output_names
        self._core = core.StreamingDecoderCore(config, lambda feeds: session.run(output_names, feeds),
                                               model_name=self._name, log_error=pb_utils.Logger.log_error)
        pb_utils.Logger.log_info(f"{self._name}: {len(config.states)} state tensors, idle timeout "
                                 f"{config.idle_timeout_s:g} s, ONNX {onnx_path.name}, max_live_streams "
                                 f"{config.max_live_streams}")
        self._metrics = ModelMetrics(METRIC_FAMILIES, self._name, args["model_version"], pb_utils.MetricFamily,
                                     pb_utils.Logger.log_warn)
        # Last: the sweeper thread calls _expire_idle, which needs the core and the metrics.
        self._sweeper = idle_sweeper.IdleSweeper(self._name, config.idle_timeout_s, self._expire_idle,
                                                 pb_utils.Logger.log_error)

    def _expire_idle(self) -> None:
        # Called by the sweeper thread under its lock.
        if self._core.expire_idle():
            self._metrics.report(self._core)

    def execute(self, requests):
        step_requests = [core.StepRequest(
            request.correlation_id(), bool(request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START),
            bool(request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END),
            {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}) for request in requests]
        with self._sweeper.lock:
            results = self._core.step(step_requests)
            self._metrics.report(self._core)

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
