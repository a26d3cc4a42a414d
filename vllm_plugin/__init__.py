"""vLLM-Omni plugin: PersonaPlex's codec stage (stage 1) decoded by this Triton service. `register` (vLLM's
`vllm.general_plugins` entry point) registers `TritonPersonaPlexCode2Wav`; the deploy overlay selects it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ARCHITECTURE = "TritonPersonaPlexCode2Wav"
MODEL_CLASS = "mimi_code2wav.vllm_plugin.code2wav:TritonPersonaPlexCode2Wav"
MODEL_TYPE = "personaplex"  # the HF model_type vLLM-Omni patches into PersonaPlex's config for stage archs
# base_config: the installed vllm_omni/deploy/personaplex.yaml by absolute path (vLLM-Omni resolves it relative
# to the overlay); deploy/vllm-omni/personaplex-triton.yaml is the same text with a placeholder path.
OVERLAY = """\
# vLLM-Omni deploy overlay: PersonaPlex with its codec stage (stage 1) decoded by the code2wav Triton
# service instead of an in-process Mimi. Serve it with `--deploy-config <this file>`; everything not
# named here comes from the base config. Needs `pip install 'mimi-code2wav[vllm-omni]'` in the
# pipeline's environment (the plugin registers {architecture}). Written by
# `python -m mimi_code2wav.vllm_plugin overlay`, which fills in base_config for that environment.
base_config: {base_config}
stages:
  - stage_id: 1
    model_arch: {architecture}
    additional_config:
      code2wav:
        url: "{url}"  # gRPC address: a proxy, or servers to fail over between (comma-separated)
        response_timeout_s: {response_timeout_s:g}  # a request's deadline before its stream resumes elsewhere
        resume_timeout_s: {resume_timeout_s:g}  # how long a stream tries to resume before the stage fails
"""


def register() -> None:
    """Register the architecture with vLLM-Omni's registry (stages' `model_arch`) and vLLM's (its model config)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm_omni.engine import arg_utils
    from vllm_omni.model_executor.models import OmniModelRegistry

    for registry in (OmniModelRegistry, ModelRegistry):
        if ARCHITECTURE not in registry.get_supported_archs():
            registry.register_model(ARCHITECTURE, MODEL_CLASS)
    arg_utils._ARCH_TO_MODEL_TYPE.setdefault(ARCHITECTURE, MODEL_TYPE)


def installed_base_config() -> Path:
    """vLLM-Omni's shipped PersonaPlex deploy config, found without importing vLLM-Omni."""
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("vllm_omni is not installed in this environment (pip install 'mimi-code2wav[vllm-omni]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "deploy" / "personaplex.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"this vLLM-Omni has no {path}")
    return path


def render_overlay(url: str, base_config: str | Path, response_timeout_s: float = 10.0,
                   resume_timeout_s: float = 30.0) -> str:
    return OVERLAY.format(architecture=ARCHITECTURE, base_config=base_config, url=url,
                          response_timeout_s=response_timeout_s, resume_timeout_s=resume_timeout_s)
