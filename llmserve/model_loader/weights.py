"""The architecture and weights of a model, from a GGUF file or an HF directory, behind one interface.

A GGUF is converted once (its metadata parsed, its tensors dequantized) and served from the on-disk
cache afterwards, so the second start costs a hash of the file plus a memory-map of the cache entry.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection

import torch

from llmserve.config import ModelArchConfig
from llmserve.model_loader import family_weights, gguf_loader, hf_loader, weights_cache
from llmserve.model_loader.default_model import is_gguf, resolve_model_path
from llmserve.model_loader.errors import ModelLoadError

logger = logging.getLogger(__name__)

_ARCH_FILE = "arch-v3.json"  # v3: gguf_tensor_types (the types a forward multiplies by)
_MAX_NAMES_IN_MESSAGE = 3
# besides eos_token_ids: JSON gives lists back
_TUPLE_FIELDS = ("layer_types", "dense_layers", "gguf_tensor_types")


def load_arch_config(path: str) -> ModelArchConfig:
    """The architecture of the GGUF file or HF directory at `path`."""
    path = resolve_model_path(path)
    if not is_gguf(path):
        return hf_loader.read_arch_config(path)
    arch = _cached_arch_config(path)
    if arch is None:  # parsing a GGUF's metadata reads its whole vocabulary: seconds, so cache it
        arch = gguf_loader.read_arch_config(gguf_loader.open_gguf(path), path)
        weights_cache.save_json(path, _ARCH_FILE, dataclasses.asdict(arch))
    return arch


def _cached_arch_config(path: str) -> ModelArchConfig | None:
    fields = weights_cache.load_json(path, _ARCH_FILE)
    if fields is None:
        return None
    try:
        tuples = {key: tuple(fields[key]) for key in _TUPLE_FIELDS if fields.get(key) is not None}
        return ModelArchConfig(**{**fields, "eos_token_ids": tuple(fields["eos_token_ids"]), **tuples})
    except (TypeError, KeyError) as error:  # written with other fields: the caller parses the GGUF again
        logger.warning("ignoring a cached architecture of %s with other fields (%s)", path, error)
        return None


def load_weights(
    path: str, dtype: torch.dtype, left_out: Collection[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """Every weight under its HF Llama name (`model.layers.0.self_attn.q_proj.weight` ...; other
    families' layouts are brought to those, model_loader/family_weights.py) in `dtype`, less those
    named in `left_out` (a quantization serves them from the file's own blocks).

    A tied model has no `lm_head.weight` unless its checkpoint stores one anyway.
    """
    path = resolve_model_path(path)
    left_out = frozenset(left_out)
    if is_gguf(path):
        arch, weights = _gguf_weights(path, left_out)
    else:
        arch = hf_loader.read_arch_config(path)
        floats = hf_loader.read_float_weights(path, dtype, _leaves_out(left_out))
        weights = family_weights.to_llama_names(arch, floats)
    check_weights(weights, arch, path, left_out)
    return {name: tensor.to(dtype) for name, tensor in weights.items() if name not in left_out}


def _gguf_weights(path: str, left_out: frozenset[str]) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    """float32 weights from the cache, or dequantized now and cached for the next start. Tensors in
    `left_out` (served from the file's blocks) are not dequantized unless the cache holds them
    already: an entry grows to what later starts ask for, so a model larger than memory in float32
    loads in its blocks without ever existing in float."""
    held = weights_cache.cached_weight_names(path)
    if held:
        arch = load_arch_config(path)
        if expected_shapes(arch).keys() - held <= left_out:
            cached = weights_cache.load_weights(path, left_out)
            if cached is not None:
                return arch, cached
    reader = gguf_loader.open_gguf(path)
    arch = gguf_loader.read_arch_config(reader, path)
    skipped = left_out - held
    weights = family_weights.to_llama_names(
        arch, gguf_loader.read_weights(reader, arch, path, _leaves_out(skipped))
    )
    check_weights(weights, arch, path, skipped)  # never cache a file that cannot be served
    weights_cache.save_json(path, _ARCH_FILE, dataclasses.asdict(arch))
    weights_cache.save_weights(path, weights)
    return arch, weights


def _leaves_out(left_out: frozenset[str]) -> Callable[[str], bool]:
    """Whether a checkpoint tensor need not be read: it is left out, or it is an expert's part of a
    stacked experts tensor that is."""
    return lambda name: name in left_out or family_weights.stacked_expert_name(name) in left_out


def expected_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """The HF name and shape of every tensor the architecture needs."""
    hidden, ffn, vocab = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    q_rows = arch.num_attention_heads * arch.head_dim
    kv_rows = arch.num_key_value_heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(arch.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        shapes.update(
            {
                f"{prefix}self_attn.q_proj.weight": (q_rows, hidden),
                f"{prefix}self_attn.k_proj.weight": (kv_rows, hidden),
                f"{prefix}self_attn.v_proj.weight": (kv_rows, hidden),
                f"{prefix}self_attn.o_proj.weight": (hidden, q_rows),
                f"{prefix}mlp.gate_proj.weight": (ffn, hidden),
                f"{prefix}mlp.up_proj.weight": (ffn, hidden),
                f"{prefix}mlp.down_proj.weight": (hidden, ffn),
                f"{prefix}input_layernorm.weight": (hidden,),
                f"{prefix}post_attention_layernorm.weight": (hidden,),
            }
        )
        for name, shape in family_weights.family_shapes(arch, prefix).items():
            if shape is None:
                del shapes[name]
            else:
                shapes[name] = shape
        if arch.attention_bias:
            shapes[f"{prefix}self_attn.q_proj.bias"] = (q_rows,)
            shapes[f"{prefix}self_attn.k_proj.bias"] = (kv_rows,)
            shapes[f"{prefix}self_attn.v_proj.bias"] = (kv_rows,)
    shapes["model.norm.weight"] = (hidden,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def check_weights(
    weights: dict[str, torch.Tensor], arch: ModelArchConfig, path: str, left_out: frozenset[str] = frozenset()
) -> None:
    """Fail with the path and the first problem instead of a shape error deep in model building
    (tensors in `left_out` may be missing)."""
    shapes = {name: shape for name, shape in expected_shapes(arch).items() if name not in left_out}
    missing = [name for name in shapes if name not in weights]
    if missing:
        shown = ", ".join(missing[:_MAX_NAMES_IN_MESSAGE])
        shown += " ..." if len(missing) > _MAX_NAMES_IN_MESSAGE else ""
        raise ModelLoadError(f"{path}: missing tensors {shown} ({len(missing)} of {len(shapes)} missing)")
    for name, shape in shapes.items():
        actual = tuple(weights[name].shape)
        if actual != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {actual}, the architecture needs {shape}")
