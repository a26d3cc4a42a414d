"""`mimi_decoder` of the `null` bench target: the decoder's interface, returning silence at once with no state.
Behind code2wav it measures the front's own ceiling (`python -m benchmarks sweep --decoder null`)."""

import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

_MODEL_DIR = os.path.dirname(os.path.abspath(__file__))
if _MODEL_DIR not in sys.path:
    sys.path.insert(0, _MODEL_DIR)

import model_errors  # noqa: E402
import model_lifecycle  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        model_lifecycle.on_initialize()  # a dying stub's stacks go to the server's log
        try:
            values, _ = model_errors.read_parameters(json.loads(args["model_config"]), {"samples_per_frame": int})
        except model_errors.ConfigError as exc:
            raise pb_utils.TritonModelException(f"model '{args['model_name']}': {exc}") from None
        self._samples_per_frame = values["samples_per_frame"]

    def execute(self, requests):
        responses = []
        for request in requests:
            frames = pb_utils.get_input_tensor_by_name(request, "codes").as_numpy().shape[-1]
            pcm = np.zeros((1, self._samples_per_frame * frames), np.float32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("pcm", pcm)]))
        return responses

    def finalize(self):
        model_lifecycle.on_finalize()
