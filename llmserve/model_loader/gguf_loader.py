"""GGUF files: architecture from the metadata, tensors dequantized to HF names and layouts."""

from __future__ import annotations

import re

import numpy as np
import torch

from llmserve.config import ModelArchConfig
from llmserve.model_loader.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as error:  # noqa: BLE001 - any parse failure means a corrupt or foreign file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(error).__name__}: {error})") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def arch_config(reader, path: str) -> ModelArchConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def key(name: str, default=None):
        value = _field(reader, f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(
            _field(reader, f"{arch}.vocab_size", None) or len(_field(reader, "tokenizer.ggml.tokens", []))
        ),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=_rope_scaling(reader, arch),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        sliding_window=_field(reader, f"{arch}.attention.sliding_window"),
    )


def _rope_scaling(reader, arch: str) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    if kind != "linear":
        raise ModelLoadError(f"unsupported GGUF rope scaling type {kind!r}")
    return {"rope_type": "linear", "factor": float(factor)}


def load_weights(reader, arch: ModelArchConfig, path: str) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its HF name, in HF layout."""
    from gguf.quants import dequantize

    weights = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        try:
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except Exception as error:  # noqa: BLE001
            raise ModelLoadError(f"{path}: cannot read tensor {tensor.name} ({error})") from None
        weights[name] = torch.from_numpy(_undo_rope_permutation(name, array, arch).copy())
    return weights


def hf_name(gguf_name: str) -> str | None:
    match = _LAYER_TENSOR.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}" if part in _LAYER_NAMES else None
    base, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{kind}" if base in _GLOBAL_NAMES else None


def _undo_rope_permutation(name: str, array: np.ndarray, arch: ModelArchConfig) -> np.ndarray:
    """llama.cpp's converter interleaves the two rotary halves of each q/k head; restore HF order.

    It maps rows (head, half, i) to (head, i, half); the inverse swaps those axes back.
    """
    if arch.architecture != "llama" or not (".q_proj." in name or ".k_proj." in name):
        return array
    heads = arch.num_attention_heads if ".q_proj." in name else arch.num_key_value_heads
    rest = array.shape[1:]
    return array.reshape(heads, array.shape[0] // heads // 2, 2, *rest).swapaxes(1, 2).reshape(array.shape)
