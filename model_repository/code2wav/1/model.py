"""Triton Python (BLS) model `code2wav`: Mimi codes in, PCM out, one stream per sequence (docs/design.md §2).
Thin: tensors -> numpy -> `code2wav_core` and the decoder calls -> responses; the rest is in its siblings."""

import asyncio
import functools
import json
import os
import sys
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

# The Python backend puts this directory on sys.path (r24.10); keep the sibling imports working if it stops.
_MODEL_DIR = os.path.dirname(os.path.abspath(__file__))
if _MODEL_DIR not in sys.path:
    sys.path.insert(0, _MODEL_DIR)

import idle_sweeper  # noqa: E402
import model_errors  # noqa: E402
import model_lifecycle  # noqa: E402
from code2wav_calls import BlockingCalls  # noqa: E402
from code2wav_core import StreamTable  # noqa: E402
from code2wav_plan import StreamRequest  # noqa: E402
from code2wav_settings import ERROR_KINDS, DecoderError, RequestError, settings_from_config  # noqa: E402
from model_metrics import Family, ModelMetrics  # noqa: E402

# What a BLS request says once the server is exiting (the backend checks the decoder's readiness first).
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
        # Each decoder call blocks a thread, at most one per stream: one thread per stream (at least a full
        # decoder batch, at most BLS_THREADS_MAX) lets the decoder batch every live stream.
        self._decoder_calls = BlockingCalls(max(self._max_batch_size, min(settings.max_live_streams, BLS_THREADS_MAX)))
        self._loop = None  # the stub's event loop, known from the first execute
        self._answers = []  # (response sender, result) of finished requests, not yet sent
        self._metrics = ModelMetrics(METRIC_FAMILIES, self._model_name, args["model_version"], pb_utils.MetricFamily,
                                     pb_utils.Logger.log_warn)
        self._sweeper = idle_sweeper.IdleSweeper(self._model_name, settings.stream_idle_timeout_s,
                                                 self._expire_idle, pb_utils.Logger.log_error)
        pb_utils.Logger.log_info(f"model '{self._model_name}': decoder '{settings.decoder_model_name}', dedupe_mode="
                                 f"{settings.dedupe_mode}, stream idle timeout {settings.stream_idle_timeout_s:g} s")

    async def execute(self, requests):
        # Each request is a task of the stream table. A live one (`StreamTable.live`) done within RETURN_WAIT_S is
        # answered in the returned list (one message); the others through their senders when they finish, so a
        # long request (a resume's replay) holds up no other stream (docs/design.md §5).
        self._loop = asyncio.get_running_loop()
        responses = [None] * len(requests)
        accepted = []  # (position, StreamRequest, response sender)
        for position, request in enumerate(requests):
            try:
                accepted.append((position, _stream_request(request), request.get_response_sender()))
            except Exception as exc:
                self._table.count_error(model_errors.error_kind(exc))
                responses[position] = self._error_response(exc)
        stream_requests = [stream_request for _, stream_request, _ in accepted]
        # The positions answered in the returned list (while they are in it); the others go to their senders.
        held = {position for (position, _, _), live in zip(accepted, self._table.live(stream_requests)) if live}
        tasks = self._table.submit_batch(stream_requests, self._decode_step, [
            functools.partial(self._answer, held, position, sender) for position, _, sender in accepted])
        if held:
            await asyncio.wait([task for task, (position, _, _) in zip(tasks, accepted) if position in held],
                               timeout=RETURN_WAIT_S)
        for task, (position, _, _) in zip(tasks, accepted):
            if position in held and task.done():
                responses[position] = self._response(task.result())
            else:
                held.discard(position)  # answered through its sender when it finishes
        self._metrics.report(self._table)  # before the answers: a client that reads the metrics next sees its request
        return responses

    def _response(self, result):
        if isinstance(result, Exception):
            return self._error_response(result)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("model_outputs", result.astype(self._pcm_dtype, copy=False)),
            pb_utils.Tensor("sr", self._sample_rate),
        ])

    def _answer(self, held, position, sender, result):
        # Answers that finish together go out in one flush with one metrics report (each is a blocking round
        # trip to tritonserver), scheduled before the stream's next request can run: each stream's stay in order.
        if position in held:  # execute answers it in its returned list
            return
        self._answers.append((sender, result))
        if len(self._answers) == 1:
            self._loop.call_soon(self._send_answers)

    def _send_answers(self):
        answers, self._answers = self._answers, []
        self._metrics.report(self._table)  # before the answers: a client that reads the metrics next sees its request
        for sender, result in answers:
            try:
                sender.send(self._response(result), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # the client went away; nothing else depends on this response
                pb_utils.Logger.log_warn(f"model '{self._model_name}': a response could not be sent: {exc}")

    async def _decode_step(self, correlation_id, codes, flags):
        """The one way into the decoder: one step of one stream. Raises DecoderError with the decoder's message."""
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
                raise DecoderError(f"the server is shutting down ({message})", "UNAVAILABLE", "unavailable")
            if error.code() == pb_utils.TritonError.UNAVAILABLE:  # the decoder's own stream cap: may retry
                raise DecoderError(message, "UNAVAILABLE", "stream_cap")
            raise DecoderError(message)
        pcm = pb_utils.get_output_tensor_by_name(response, DECODER_OUTPUT_NAME)
        if pcm is None:
            raise DecoderError(f"the response has no '{DECODER_OUTPUT_NAME}' output")
        return pcm.as_numpy()

    def _expire_idle(self):
        # The sweeper thread's: the table belongs to the event loop (none, nor streams, before the first execute).
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._expire_on_loop)

    def _expire_on_loop(self):
        if self._table.expire_idle():
            self._metrics.report(self._table)

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


def _stream_request(request):
    # Copies: a request's tensors are freed when execute returns, and it may be decoded later.
    arrays = {name: None if tensor is None else np.array(tensor.as_numpy())
              for name in ("input_ids", "frame_offset", "history_frames")
              for tensor in [pb_utils.get_input_tensor_by_name(request, name)]}
    if arrays["input_ids"] is None:
        raise RequestError("shape", "the request has no input_ids")
    return StreamRequest(request.correlation_id(), request.flags(), **arrays)


def _output_dtype(config, name, model_name):
    output = pb_utils.get_output_config_by_name(config, name)
    if output is None:
        raise pb_utils.TritonModelException(f"model '{model_name}': the config declares no output '{name}'")
    return pb_utils.triton_string_to_numpy(output["data_type"])


# The custom metrics, filled from the StreamTable (Family: name, kind, help, field).
METRIC_FAMILIES = (
    Family("code2wav_live_streams", "GAUGE", "Streams open in code2wav (started, not ended or expired)", "live_streams"),
    Family("code2wav_frames_decoded_total", "COUNTER",
           "Audio frames (80 ms each) decoded by code2wav, replayed history included", "frames_decoded"),
    Family("code2wav_resumed_streams_total", "COUNTER",
           "Streams opened by a START with history_frames (resumed after losing their server)", "streams_resumed"),
    Family("code2wav_expired_streams_total", "COUNTER",
           "Streams forgotten after the idle timeout without an END", "streams_expired"),
    Family("code2wav_errors_total", "COUNTER", "Failed code2wav requests by kind", "errors_by_kind",
           label="kind", label_values=ERROR_KINDS),
)
