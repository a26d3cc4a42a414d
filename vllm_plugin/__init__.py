"""vLLM-Omni plugin: PersonaPlex's codec stage (stage 1) decoded by this Triton service.

`register` (vLLM's `vllm.general_plugins` entry point, loaded in every stage worker) registers
`TritonPersonaPlexCode2Wav`; a deploy overlay (`python -m mimi_code2wav.vllm_plugin overlay`) selects it.
"""

from __future__ import annotations

ARCHITECTURE = "TritonPersonaPlexCode2Wav"
MODEL_CLASS = "mimi_code2wav.vllm_plugin.code2wav:TritonPersonaPlexCode2Wav"
# The HF model_type vLLM-Omni patches into PersonaPlex's empty config.json for stage architectures.
MODEL_TYPE = "personaplex"


def register() -> None:
    """The `vllm.general_plugins` entry point: register the architecture with vLLM-Omni's registry (stage
    classes are looked up there by `model_arch`) and vLLM's (its model config checks the architecture),
    and tell vLLM-Omni which HF model_type the stage's empty config.json stands for."""
    from vllm.model_executor.models import ModelRegistry
    from vllm_omni.engine import arg_utils
    from vllm_omni.model_executor.models import OmniModelRegistry

    for registry in (OmniModelRegistry, ModelRegistry):
        if ARCHITECTURE not in registry.get_supported_archs():
            registry.register_model(ARCHITECTURE, MODEL_CLASS)
    arg_utils._ARCH_TO_MODEL_TYPE.setdefault(ARCHITECTURE, MODEL_TYPE)
