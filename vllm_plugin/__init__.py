"""vLLM-Omni plugin: PersonaPlex's codec stage (stage 1) decoded by this Triton service. `register` (vLLM's
`vllm.general_plugins` entry point) registers `TritonPersonaPlexCode2Wav`; the deploy overlay selects it."""

ARCHITECTURE = "TritonPersonaPlexCode2Wav"
MODEL_CLASS = "mimi_code2wav.vllm_plugin.code2wav:TritonPersonaPlexCode2Wav"
MODEL_TYPE = "personaplex"  # the HF model_type vLLM-Omni patches into PersonaPlex's config for stage archs


def register() -> None:
    """Register the architecture with vLLM-Omni's registry (stages' `model_arch`) and vLLM's (its model config)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm_omni.engine import arg_utils
    from vllm_omni.model_executor.models import OmniModelRegistry

    for registry in (OmniModelRegistry, ModelRegistry):
        if ARCHITECTURE not in registry.get_supported_archs():
            registry.register_model(ARCHITECTURE, MODEL_CLASS)
    arg_utils._ARCH_TO_MODEL_TYPE.setdefault(ARCHITECTURE, MODEL_TYPE)
