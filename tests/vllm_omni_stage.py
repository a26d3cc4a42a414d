"""vLLM-Omni's stage 1 as its generation runner drives it, run by tests/test_vllm_omni.py in the vLLM-Omni
environment (importing vLLM-Omni patches vLLM and torch). One JSON command per line on stdin, one answer
per line on stdout (logs: stderr); ops: `model` (register the plugin and construct the class with a CPU
VllmConfig whose additional_config.code2wav is `config`), `forward` (requests' codes, ids and dummy flags ->
each request's PCM, base64 float32, and sr), `finish` (on_requests_finished) and `overlay` (the deploy
overlay file at `path` as vLLM-Omni's loader reads it). A failure answers {"error": "Type: text"}."""

from __future__ import annotations

import base64
import json
import os
import sys
import traceback

import numpy as np


def _forward(model, requests: list[dict]) -> dict:
    import torch

    flats = [np.asarray(r["codes"] if r.get("codes") is not None else [], np.int64).reshape(-1) for r in requests]
    infos = [{"meta": {"personaplex_dummy_profile": True} if r.get("dummy") else {}} for r in requests]
    ids = [r.get("id") for r in requests]
    input_ids = torch.from_numpy(np.concatenate(flats)) if requests else torch.zeros(0, dtype=torch.long)
    kwargs = {"seq_token_counts": [flat.size for flat in flats]} if requests else {}  # none: a step with no input
    if ids and all(request_id is not None for request_id in ids):
        kwargs["request_ids"] = ids
    outputs = model.forward(input_ids=input_ids, positions=None, runtime_additional_information=infos,
                            **kwargs).multimodal_outputs
    pcms, srs = outputs["model_outputs"], outputs["sr"]
    return {"pcm": [base64.b64encode(pcm.numpy().astype(np.float32).tobytes()).decode() for pcm in pcms],
            "dtypes": [str(pcm.dtype) for pcm in pcms], "sr": [int(sr) for sr in srs],
            "sr_dtypes": [str(sr.dtype) for sr in srs]}


def _overlay(command: dict) -> dict:
    from vllm_omni.config.stage_config import load_deploy_config

    stages = {stage.stage_id: stage for stage in load_deploy_config(command["path"]).stages}
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
                          "settings": model.settings, "weights": sorted(model.load_weights(iter(())))}
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
