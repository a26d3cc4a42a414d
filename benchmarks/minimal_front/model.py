"""`minimal_front`: the cheapest Python BLS front there is, the yardstick of `python -m benchmarks front`.

Per request one `async_exec` into the decoder with the request's sequence id and flags, and one response:
no stream table, dedupe, replay, cap, metrics or checks, so what code2wav costs beyond it is its contract's.
"""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils

import model_lifecycle


class TritonPythonModel:
    def initialize(self, args):
        model_lifecycle.on_initialize()
        parameters = {key: value["string_value"] for key, value in json.loads(args["model_config"])["parameters"].items()}
        self._codebooks = int(parameters["num_codebooks"])
        self._decoder = parameters["decoder_model_name"]
        self._sample_rate = np.array([[int(parameters["sample_rate_hz"])]], dtype=np.int32)

    async def execute(self, requests):
        calls = []
        for request in requests:
            codes = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            decoder_request = pb_utils.InferenceRequest(
                model_name=self._decoder,
                inputs=[pb_utils.Tensor("codes", codes.reshape(1, self._codebooks, -1).astype(np.int32))],
                requested_output_names=["pcm"], correlation_id=request.correlation_id(), flags=request.flags())
            calls.append(decoder_request.async_exec())
        responses = []
        for response in await asyncio.gather(*calls):
            if response.has_error():
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=response.error()))
                continue
            pcm = pb_utils.get_output_tensor_by_name(response, "pcm").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("model_outputs", pcm), pb_utils.Tensor("sr", self._sample_rate)]))
        return responses

    def finalize(self):
        model_lifecycle.on_finalize()
