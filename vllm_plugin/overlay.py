"""The vLLM-Omni deploy overlay that selects `TritonPersonaPlexCode2Wav` for PersonaPlex's stage 1.

vLLM-Omni resolves an overlay's `base_config` relative to the overlay's folder, so a usable overlay
names the installed `vllm_omni/deploy/personaplex.yaml` by its absolute path
(deploy/vllm-omni/personaplex-triton.yaml is the same text with a placeholder base path).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from . import ARCHITECTURE

BASE_CONFIG = "personaplex.yaml"  # in vllm_omni/deploy/

TEMPLATE = """\
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


def installed_base_config() -> Path:
    """vLLM-Omni's shipped PersonaPlex deploy config, found without importing vLLM-Omni."""
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("vllm_omni is not installed in this environment (pip install 'mimi-code2wav[vllm-omni]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "deploy" / BASE_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"this vLLM-Omni has no {path}")
    return path


def render_overlay(url: str, base_config: str | Path, response_timeout_s: float = 10.0,
                   resume_timeout_s: float = 30.0) -> str:
    return TEMPLATE.format(architecture=ARCHITECTURE, base_config=base_config, url=url,
                           response_timeout_s=response_timeout_s, resume_timeout_s=resume_timeout_s)
