"""Triton Python (BLS) model `code2wav`: Mimi codes in, PCM out, one stream per sequence (the request
contract: docs/design.md §2). Thin on purpose: tensors -> numpy, `code2wav_core`, the decoder calls,
numpy -> responses; everything testable lives in the sibling files and model_repository/common/.
"""

import asyncio
import json
import os
import sys
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

# The Python backend appends this version directory to sys.path before importing model.py
# (python_backend r24.10, ModelContext::StubSetup); keep the import working if it ever stops.
_MODEL_DIR = os.path.dirname(os.path.abspath(__file__))
if _MODEL_DIR not in sys.path:
    sys.path.insert(0, _MODEL_DIR)

import idle_sweeper  # noqa: E402
import model_errors  # noqa: E402
import model_lifecycle  # noqa: E402
import model_metrics  # noqa: E402
from code2wav_calls import BlockingCalls  # noqa: E402
from code2wav_core import StreamTable  # noqa: E402
from code2wav_plan import StreamRequest  # noqa: E402
from code2wav_settings import ERROR_KINDS, DecoderError, RequestError, settings_from_config  # noqa: E402

# What a BLS request says once the server is exiting (the Python backend checks the decoder's
# readiness first, and Triton answers it no more while it shuts down).
SERVER_EXITING = "Server not ready"
# The decoder's tensors (docs/design.md §3): codes INT32 [1, k, S] -> pcm FP32 [1, samples_per_frame*S].
DECODER_INPUT_NAME = "codes"
DECODER_OUTPUT_NAME = "pcm"
BLS_THREADS_MAX = 256
# How long execute waits for its live requests before it leaves the rest to their response senders.
RETURN_WAIT_S = 0.02


class TritonPythonModel:
    def initialize(self, args):
        model_lifecycle.on_initialize()  # a dying stub's stacks go to the server's log
        config = json.loads(args["model_config"])
        self._model_name = args.get("model_name", "code2wav")
        try:
            settings = settings_from_config(config)
        except model_errors.ConfigError as exc:
            raise pb_utils.TritonModelException(f"model '{self._model_name}': {exc}") from None
        self._max_batch_size = int(config.get("max_batch_size", 0))
        if self._max_batch_size < 1:
            raise pb_utils.TritonModelException(
                f"model '{self._model_name}': parameter 'max_batch_size' must be > 0 (requests carry a "
                f"leading batch dimension), got {self._max_batch_size}")
        self._pcm_dtype = _output_dtype(config, "model_outputs", self._model_name)
        self._sample_rate = np.array([[settings.sample_rate_hz]], dtype=_output_dtype(config, "sr", self._model_name))
        self._decoder_model_name = settings.decoder_model_name
        self._table = StreamTable(settings)
        # Each decoder call blocks one of these threads (a BLS request is synchronous). Each stream has
        # at most one call in flight, so one thread per stream that can be in flight (at least a full
        # decoder batch, at most BLS_THREADS_MAX) lets the decoder batch every live stream.
        self._decoder_calls = BlockingCalls(max(self._max_batch_size, min(settings.max_live_streams, BLS_THREADS_MAX)))
        self._loop = None  # the stub's event loop, known from the first execute
        self._answers = []  # (response sender, result) of finished requests, not yet sent
        self._metrics = model_metrics.ModelMetrics(METRIC_FAMILIES, self._model_name, args["model_version"],
                                                   pb_utils.MetricFamily, pb_utils.Logger.log_warn)
        self._sweeper = idle_sweeper.IdleSweeper.started(self._model_name, settings.stream_idle_timeout_s,
                                                         self._expire_idle, pb_utils.Logger.log_error)
        pb_utils.Logger.log_info(f"model '{self._model_name}': decoder '{settings.decoder_model_name}', dedupe_mode="
                                 f"{settings.dedupe_mode}, stream idle timeout {settings.stream_idle_timeout_s:g} s")

    async def execute(self, requests):
        # Every request becomes a task of the stream table on the stub's event loop. A live request
        # (`StreamTable.live`) is awaited here, up to RETURN_WAIT_S, and answered in the returned list: the
        # backend sends the whole list in one message. Anything else, and whatever is not done by then,
        # is answered through its response sender when it finishes, so a long request (a resume's
        # replay) holds up no other stream (docs/design.md §5).
        self._loop = asyncio.get_running_loop()
        responses = [None] * len(requests)
        stream_requests, positions, senders = [], [], []
        for position, request in enumerate(requests):
            try:
                stream_requests.append(_stream_request(request))
            except Exception as exc:
                self._table.count_error(model_errors.error_kind(exc))
                responses[position] = self._error_response(exc)
                continue
            positions.append(position)
            senders.append(request.get_response_sender())
        replies = [_Reply(self, position, sender, live)
                   for position, sender, live in zip(positions, senders, self._table.live(stream_requests))]
        tasks = self._table.submit_batch(stream_requests, self._decode_step, [reply.finish for reply in replies])
        held = [task for task, reply in zip(tasks, replies) if reply.held]
        if held:
            await asyncio.wait(held, timeout=RETURN_WAIT_S)
        for task, reply in zip(tasks, replies):
            if reply.held and task.done():
                responses[reply.position] = self._response(task.result())
            else:
                reply.held = False  # answered through its sender when it finishes
        self._report_metrics()  # before the answers: a client that reads the metrics next sees its request
        return responses

    def _response(self, result):
        if isinstance(result, Exception):
            return self._error_response(result)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("model_outputs", result.astype(self._pcm_dtype, copy=False)),
            pb_utils.Tensor("sr", self._sample_rate),
        ])

    def _answer(self, sender, result):
        # Answers that finish together (a decoder batch's steps reach the loop within moments) go out
        # in one flush with one metrics report: each report and each send is a blocking round trip to
        # tritonserver. The flush is scheduled before anything the finished task wakes (the stream's
        # next request), so each stream's answers go out in its order.
        self._answers.append((sender, result))
        if len(self._answers) == 1:
            self._loop.call_soon(self._send_answers)

    def _send_answers(self):
        answers, self._answers = self._answers, []
        self._report_metrics()  # before the answers: a client that reads the metrics next sees its request
        for sender, result in answers:
            try:
                sender.send(self._response(result), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # the client went away; nothing else depends on this response
                pb_utils.Logger.log_warn(f"model '{self._model_name}': a response could not be sent: {exc}")

    def _report_metrics(self):
        self._metrics.report(self._table.stats())

    async def _decode_step(self, correlation_id, codes, flags):
        """The one way into the decoder: one step of one stream, codes int32 [1, k, S] -> PCM FP32
        [1, samples_per_frame*S]. Raises DecoderError with the decoder's message."""
        request = pb_utils.InferenceRequest(
            model_name=self._decoder_model_name,
            inputs=[pb_utils.Tensor(DECODER_INPUT_NAME, codes)],
            requested_output_names=[DECODER_OUTPUT_NAME],
            correlation_id=correlation_id,
            flags=flags,
        )
        response = await self._decoder_calls.call(self._loop, request.exec)
        if response.has_error():
            error = response.error()
            message = error.message()
            if SERVER_EXITING in message:
                # The server is shutting down: no request reaches the decoder any more.
                raise DecoderError(f"the server is shutting down ({message})", "UNAVAILABLE", "unavailable")
            if error.code() == pb_utils.TritonError.UNAVAILABLE:
                # The decoder's own stream cap: the client may retry later, as for code2wav's.
                raise DecoderError(message, "UNAVAILABLE", "stream_cap")
            raise DecoderError(message)
        pcm = pb_utils.get_output_tensor_by_name(response, DECODER_OUTPUT_NAME)
        if pcm is None:
            raise DecoderError(f"the response has no '{DECODER_OUTPUT_NAME}' output")
        return pcm.as_numpy()

    def _expire_idle(self):
        # Called by the sweeper thread: the table belongs to the event loop, so expiry runs there.
        # Before the first execute there is no loop and no stream to expire.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._expire_on_loop)

    def _expire_on_loop(self):
        if self._table.expire_idle():
            self._report_metrics()

    def _error_response(self, exc):
        code = model_errors.error_code(exc)
        if code == "INTERNAL":
            pb_utils.Logger.log_error(f"model '{self._model_name}': "
                                      + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        return pb_utils.InferenceResponse(output_tensors=[],
                                          error=pb_utils.TritonError(model_errors.tagged_message("code2wav", exc),
                                                                     getattr(pb_utils.TritonError, code)))

    def finalize(self):
        self._sweeper.close(pb_utils.Logger.log_warn)
        self._metrics.close()
        running = self._decoder_calls.close()
        if running:
            pb_utils.Logger.log_warn(f"model '{self._model_name}': decoder calls still running at unload: "
                                     f"{', '.join(running)}")
        self._answers = []
        model_lifecycle.on_finalize()


class _Reply:
    """Where a request's answer goes: execute's returned list while `held`, else its response sender."""

    __slots__ = ("model", "position", "sender", "held")

    def __init__(self, model, position, sender, held):
        self.model, self.position, self.sender, self.held = model, position, sender, held

    def finish(self, result):
        if not self.held:
            self.model._answer(self.sender, result)


def _stream_request(request):
    input_ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
    if input_ids is None:
        raise RequestError("shape", "the request has no input_ids")
    frame_offset = pb_utils.get_input_tensor_by_name(request, "frame_offset")
    history_frames = pb_utils.get_input_tensor_by_name(request, "history_frames")
    return StreamRequest(
        correlation_id=request.correlation_id(),
        flags=request.flags(),
        # Copies: a request's tensors are freed when execute returns, and it may be decoded later.
        input_ids=np.array(input_ids.as_numpy()),
        frame_offset=None if frame_offset is None else np.array(frame_offset.as_numpy()),
        history_frames=None if history_frames is None else np.array(history_frames.as_numpy()),
    )


def _output_dtype(config, name, model_name):
    output = pb_utils.get_output_config_by_name(config, name)
    if output is None:
        raise pb_utils.TritonModelException(f"model '{model_name}': the config declares no output '{name}'")
    return pb_utils.triton_string_to_numpy(output["data_type"])


# The custom metrics, filled from Code2WavStats (model_metrics.Family: name, kind, help, field).
METRIC_FAMILIES = (
    model_metrics.Family("code2wav_live_streams", "GAUGE", "Streams open in code2wav (started, not ended or expired)",
                         "live_streams"),
    model_metrics.Family("code2wav_frames_decoded_total", "COUNTER",
                         "Audio frames (80 ms each) decoded by code2wav, replayed history included", "frames_decoded"),
    model_metrics.Family("code2wav_resumed_streams_total", "COUNTER",
                         "Streams opened by a START with history_frames (resumed after losing their server)",
                         "streams_resumed"),
    model_metrics.Family("code2wav_expired_streams_total", "COUNTER",
                         "Streams forgotten after the idle timeout without an END", "streams_expired"),
    model_metrics.Family("code2wav_errors_total", "COUNTER", "Failed code2wav requests by kind", "errors_by_kind",
                         label="kind", label_values=ERROR_KINDS),
)
