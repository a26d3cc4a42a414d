"""vLLM-Omni's stage 1 as its generation runner drives it, in the vLLM-Omni environment (run by
tests/test_vllm_omni.py with build/vllm-omni-venv's Python: importing vLLM-Omni patches vLLM and
torch, so it stays out of the test process).

One JSON command per line on stdin, one JSON answer per line on stdout (logs go to stderr):

- {"op": "model", "config": {...}}: register the plugin as vLLM's entry point would, and construct
  `TritonPersonaPlexCode2Wav` with a real VllmConfig (CPU) whose additional_config.code2wav is `config`;
- {"op": "forward", "requests": [{"id": "a", "codes": [[...] x 8] | null, "dummy": false}, ...]}: one
  `forward` with the runner's arguments (the requests' codes concatenated codebook-major, their
  seq_token_counts, request_ids and runtime_additional_information); answers each request's PCM
  (base64 float32) and sr, or {"error": ...} with the exception's text;
- {"op": "finish", "ids": [...]}: `on_requests_finished(ids)`;
- {"op": "overlay", "url": ...}: the deploy overlay, loaded by vLLM-Omni's own loader: stage 1's
  model_arch and additional_config.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import tempfile
import traceback

import numpy as np


def _forward(model, requests: list[dict]) -> dict:
    import torch

    flats, infos, ids = [], [], []
    for request in requests:
        codes = np.zeros((8, 0), np.int64) if request.get("codes") is None else np.asarray(request["codes"], np.int64)
        flats.append(codes.reshape(-1))
        infos.append({"meta": {"personaplex_dummy_profile": True}} if request.get("dummy") else {"meta": {}})
        ids.append(request.get("id"))
    if not requests:  # a step with no input at all
        input_ids, kwargs = torch.zeros(0, dtype=torch.long), {}
    else:
        input_ids = torch.from_numpy(np.concatenate(flats))
        kwargs = {"seq_token_counts": [flat.size for flat in flats]}
    if ids and all(request_id is not None for request_id in ids):
        kwargs["request_ids"] = ids
    outputs = model.forward(input_ids=input_ids, positions=None, runtime_additional_information=infos,
                            **kwargs).multimodal_outputs
    return {
        "pcm": [base64.b64encode(pcm.numpy().astype(np.float32).tobytes()).decode() for pcm in outputs["model_outputs"]],
        "dtypes": [str(pcm.dtype) for pcm in outputs["model_outputs"]],
        "sr": [int(sr) for sr in outputs["sr"]],
        "sr_dtypes": [str(sr.dtype) for sr in outputs["sr"]],
    }


def _overlay(command: dict) -> dict:
    from vllm_omni.config.stage_config import load_deploy_config

    from mimi_code2wav.vllm_plugin import installed_base_config, render_overlay

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as handle:
        handle.write(render_overlay(command["url"], installed_base_config()))
        handle.flush()
        deploy = load_deploy_config(handle.name)
    stages = {stage.stage_id: stage for stage in deploy.stages}
    extras = stages[1].engine_extras
    return {"stages": sorted(stages), "model_arch": extras.get("model_arch"),
            "additional_config": extras.get("additional_config"),
            "stage0_max_num_seqs": getattr(stages[0], "max_num_seqs", None)}


def main() -> int:
    # Answers go to the real stdout; everything else that writes to it (vLLM logs there) goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer_with(answer: dict) -> None:
        answers.write(json.dumps(answer) + "\n")
        answers.flush()

    import mimi_code2wav.vllm_plugin as plugin

    model = None
    answer_with({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "model":
                from vllm.config import DeviceConfig, VllmConfig
                from vllm_omni.model_executor.models import OmniModelRegistry

                plugin.register()
                model_class = OmniModelRegistry._try_load_model_cls(plugin.ARCHITECTURE)
                model = model_class(vllm_config=VllmConfig(device_config=DeviceConfig(device="cpu"),
                                                           additional_config={"code2wav": command["config"]}))
                answer = {"class": f"{model_class.__module__}.{model_class.__qualname__}",
                          "bases": [base.__name__ for base in model_class.__mro__],
                          "settings": model.settings.__dict__, "weights": sorted(model.load_weights(iter(())))}
            elif command["op"] == "forward":
                answer = _forward(model, command["requests"])
            elif command["op"] == "finish":
                model.on_requests_finished(command["ids"])
                answer = {}
            elif command["op"] == "overlay":
                answer = _overlay(command)
            else:
                answer = {"error": f"unknown op {command['op']!r}"}
        except Exception as error:  # reported to the test, which asserts on it
            traceback.print_exc(file=sys.stderr)
            answer = {"error": f"{type(error).__name__}: {error}"}
        answer_with(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
