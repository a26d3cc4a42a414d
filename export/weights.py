"""Mimi weights into a `transformers.MimiModel`, safetensors only: a transformers folder or hub id, a moshi-format
file (e.g. PersonaPlex's tokenizer) or seeded random weights, checked name by name and shape by shape."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_SUFFIXES = (".safetensors", ".sft")


class WeightsError(ValueError):
    """A checkpoint that does not fit the architecture; the message names the tensors."""


@dataclass
class LoadedMimi:
    model: torch.nn.Module
    source: str
    kind: str  # "transformers" | "moshi" | "random"
    sha256: str  # of the weight file(s), or of the random recipe


def _flat_name(module_name: str) -> str:
    """MimiModel's name -> kyutai/mimi's checkpoint name (encoder.encoder_seanet.layers.0 -> encoder.layers.0)."""
    name = re.sub(r"^(encoder|decoder)\.\1_seanet\.layers\.", r"\1.layers.", module_name)
    return re.sub(r"^(encoder|decoder)\.(\1_transformer|downsample|upsample)\.", r"\2.", name)


def new_model(config=None):
    from transformers import MimiConfig, MimiModel

    return MimiModel(config or MimiConfig()).eval()


def load_flat_state_dict(model, flat: dict[str, torch.Tensor], source: str) -> None:
    """Load checkpoint-named tensors; a missing, extra or mis-shaped tensor raises WeightsError naming it."""
    expected = {_flat_name(name): (name, tensor) for name, tensor in model.state_dict().items()}
    missing, extra = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
    shapes = sorted(f"{name}: checkpoint {tuple(flat[name].shape)}, model {tuple(expected[name][1].shape)}"
                    for name in set(expected) & set(flat) if flat[name].shape != expected[name][1].shape)
    if problems := [f"{what} tensors ({len(names)}): {_short(names)}"
                    for what, names in (("missing", missing), ("unexpected", extra), ("mis-shaped", shapes)) if names]:
        raise WeightsError(f"{source} does not fit the Mimi architecture: " + "; ".join(problems))
    model.load_state_dict({expected[name][0]: tensor for name, tensor in flat.items()}, strict=True)


def _short(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


_LAYER = r"^(encoder|decoder)_transformer\.transformer\.layers\.(\d+)\."  # moshi's transformer layers
_MOSHI_RULES = (
    (r"^(encoder|decoder)\.model\.(\d+)\.(block\.\d+\.|shortcut\.)?(conv\.conv|convtr\.convtr)\.",
     r"\1.layers.\2.\3conv."),
    (r"^(down|up)sample\.(conv|convtr)\.\2\.\2\.", r"\1sample.conv."),
    *((_LAYER + moshi, r"\1_transformer.layers.\2." + mimi) for moshi, mimi in (
        (r"self_attn\.out_projs?(\.0)?\.", "self_attn.o_proj."), (r"norm1\.", "input_layernorm."),
        (r"norm2\.", "post_attention_layernorm."), (r"linear1\.", "mlp.fc1."), (r"linear2\.", "mlp.fc2."),
        (r"layer_scale_1\.", "self_attn_layer_scale."), (r"layer_scale_2\.", "mlp_layer_scale."))),
    (r"^quantizer\.rvq_first\.vq\.layers\.(\d+)\._codebook\.", r"quantizer.semantic_residual_vector_quantizer.layers.\1.codebook."),
    (r"^quantizer\.rvq_rest\.vq\.layers\.(\d+)\._codebook\.", r"quantizer.acoustic_residual_vector_quantizer.layers.\1.codebook."),
    (r"^quantizer\.rvq_first\.", "quantizer.semantic_residual_vector_quantizer."),
    (r"^quantizer\.rvq_rest\.", "quantizer.acoustic_residual_vector_quantizer."),
)
_MOSHI_LEAF = {"codebook._initialized": "codebook.initialized", "codebook.embedding_sum": "codebook.embed_sum"}
# moshi's fused q/k/v as Kyutai ships it (`in_proj_weight`) or as its modules name it (`in_projs.0.weight`).
_MOSHI_QKV = re.compile(_LAYER + r"self_attn\.(?:in_projs\.0\.weight|in_proj_weight|in_proj\.weight)$")


def _rope_pairs_to_halves(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder q/k output rows per head from adjacent (real, imag) pairs to (all real, all imag) halves."""
    rows, cols = weight.shape
    return weight.view(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_shipped_moshi_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """moshi module names -> the names of the checkpoints Kyutai ships (and rustymimi reads)."""
    shipped = {"in": "in_proj_weight", "out": "out_proj.weight"}
    return {re.sub(r"\.self_attn\.(in|out)_projs\.0\.weight$", lambda m: f".self_attn.{shipped[m[1]]}", name): tensor
            for name, tensor in state.items()}


def moshi_to_flat(state: dict[str, torch.Tensor], num_heads: int = 8) -> dict[str, torch.Tensor]:
    """moshi-format names -> transformers' flat ones (WeightsError names any no rule knows); moshi's fused q/k/v
    are split, and q and k rows permuted per head: moshi's RoPE rotates adjacent pairs, transformers' halves."""
    flat: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in state.items():
        if qkv := _MOSHI_QKV.match(name):
            prefix = f"{qkv.group(1)}_transformer.layers.{qkv.group(2)}.self_attn."
            q, k, v = tensor.chunk(3, dim=0)
            flat |= {prefix + "q_proj.weight": _rope_pairs_to_halves(q, num_heads),
                     prefix + "k_proj.weight": _rope_pairs_to_halves(k, num_heads), prefix + "v_proj.weight": v}
            continue
        for pattern, replacement in _MOSHI_RULES:
            mapped, count = re.subn(pattern, replacement, name)
            if count:
                for old, new in _MOSHI_LEAF.items():
                    mapped = mapped.replace(old, new)
                flat[mapped] = tensor
                break
        else:
            unknown.append(name)
    if unknown:
        raise WeightsError(f"moshi checkpoint has tensors with no known Mimi name: {_short(sorted(unknown))}")
    return flat


def randomize_(model, seed: int) -> None:
    """Seeded random weights in place, non-degenerate for parity tests (unlike zero codebooks, LayerScale 0.01)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(shape, std):
        return torch.randn(shape, generator=generator, dtype=torch.float64).float() * std

    with torch.no_grad():
        for name, param in sorted(model.named_parameters()) + sorted(model.named_buffers()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("embed_sum", "embedding_sum"):
                param.copy_(randn(param.shape, 1.0))
            elif leaf == "cluster_usage":
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
            elif leaf in ("initialized", "_initialized"):
                param.fill_(1.0)
            elif leaf == "scale":  # LayerScale
                param.copy_(0.1 + 0.2 * torch.rand(param.shape, generator=generator))
            elif "layernorm" in name or re.search(r"\.norm\d\.", name):
                param.copy_((1.0 if leaf == "weight" else 0.0) + randn(param.shape, 0.1))
            elif leaf == "weight" and param.dim() == 3:  # conv / transposed conv
                param.copy_(randn(param.shape, 1.2 / (param.shape[1] * param.shape[2]) ** 0.5))
            elif leaf == "weight" and param.dim() == 2:  # linear
                param.copy_(randn(param.shape, 1.0 / param.shape[1] ** 0.5))
            elif leaf == "bias":
                param.copy_(randn(param.shape, 0.05))


def random_model(seed: int, config=None) -> LoadedMimi:
    model = new_model(config)
    randomize_(model, seed)
    recipe = json.dumps({"random_seed": seed, "config": model.config.to_dict()}, sort_keys=True, default=str)
    return LoadedMimi(model, f"random:{seed}", "random", hashlib.sha256(recipe.encode()).hexdigest())


@contextlib.contextmanager
def _readable(path: Path):
    """A truncated or corrupt safetensors file: one error naming it, not the library's traceback."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError) as error:
        raise WeightsError(f"{path}: not a readable safetensors file ({error})") from error


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors (memory-mapped) and the sha256 (in chunks) of a file: a checkpoint is never held twice."""
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    with _readable(path), open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
        return load_file(str(path)), digest.hexdigest()


def load_transformers_dir(path: Path) -> LoadedMimi:
    from transformers import MimiConfig

    weights_path = path / "model.safetensors"
    for needed in (path / "config.json", weights_path):
        if not needed.is_file():
            raise WeightsError(f"{path} is not a transformers-format Mimi folder: {needed.name} is missing")
    model = new_model(MimiConfig.from_pretrained(str(path)))
    tensors, sha256 = _read_safetensors(weights_path)
    load_flat_state_dict(model, tensors, str(weights_path))
    return LoadedMimi(model, str(path), "transformers", sha256)


def resolve_hub_id(repo_id: str) -> Path:
    """A local folder for a hub id: the local hub cache first, then the hub where one is reachable."""
    from huggingface_hub import snapshot_download

    patterns = ["config.json", "model.safetensors"]
    with contextlib.suppress(Exception):
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:  # offline, unknown repo, no access
        raise WeightsError(f"cannot get {repo_id!r} from the local hub cache or the hub: {error}") from error


def load_weights(source: str | os.PathLike | None, seed: int | None = None) -> LoadedMimi:
    """Mimi from a transformers folder, moshi .safetensors file, hub id, or (None, seed) loud random weights."""
    if source is None:
        if seed is None:
            raise WeightsError("no weights given: pass a folder, a .safetensors file, a hub id, or a random seed")
        print(f"WARNING: Mimi with RANDOM weights (seed {seed}): the audio is noise. "
              "Use real weights (kyutai/mimi or a moshi-format checkpoint) for speech.", file=sys.stderr)
        return random_model(seed)
    path = Path(source)
    if path.is_dir():
        return load_transformers_dir(path)
    if path.is_file():
        if path.suffix not in SAFETENSORS_SUFFIXES:
            raise WeightsError(f"{path}: only safetensors checkpoints are read (pickled checkpoints can run code)")
        from safetensors import safe_open

        with _readable(path), safe_open(str(path), "pt") as header:  # the names only, before any tensor is read
            names = list(header.keys())
        if not any(name.startswith(("decoder.model.", "quantizer.rvq_first.")) for name in names):
            raise WeightsError(f"{path}: not a moshi-format Mimi checkpoint; for transformers format pass the "
                               "folder holding config.json and model.safetensors")
        tensors, sha256 = _read_safetensors(path)
        model = new_model()
        load_flat_state_dict(model, moshi_to_flat(tensors, model.config.num_attention_heads), str(path))
        return LoadedMimi(model, str(path), "moshi", sha256)
    if re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", str(source)) and path.suffix not in SAFETENSORS_SUFFIXES:
        return load_transformers_dir(resolve_hub_id(str(source)))
    raise WeightsError(f"{source}: no such file or folder")
