"""GGUF files (llama.cpp's format): architecture from the metadata, tensors as HF Llama weights.

Accepted: "llama" (Llama 1-3, SmolLM2, Mistral, which llama.cpp also files as llama; with
`llama.expert_count` set, Mixtral), "qwen2", "qwen3" (q/k head norms), "qwen3moe" (Qwen3-MoE),
"phi3" (fused attn_qkv and gate/up ffn_up, split by model_loader/family_weights.py as an HF
checkpoint's; LongRoPE's factor tensors are refused), "gemma2" and "gemma3" (whose norm weights
llama.cpp stores as 1 + w: 1 is taken off again, as transformers does). A mixture-of-experts layer's
router is `ffn_gate_inp` [E, H] and its experts are merged tensors `ffn_gate_exps`, `ffn_up_exps`
[E, I, H] and `ffn_down_exps` [E, H, I] (older Mixtral files: one `ffn_gate.N` ... per expert), cut
here into each expert's HF-named rows (`mlp.experts.N.gate_proj.weight`), which family_weights.py
stacks as for an HF checkpoint. Tensors are dequantized to
float32 and renamed and reshaped so they equal what HF transformers loads from the same file,
including undoing the row permutation that llama.cpp's converter applies to the q and k projections
of "llama" models.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmserve.config import ModelArchConfig
from llmserve.model_loader.errors import ModelLoadError, describe

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3")
# llama.cpp's name -> ours where they differ ("llama" with experts is Mixtral)
_OUR_ARCHITECTURE = {"qwen3moe": "qwen3_moe"}
_GEMMA = frozenset({"gemma2", "gemma3"})
_MOE_ARCHITECTURES = frozenset({"llama", "qwen3moe"})  # "llama" with experts: Mixtral
# llama.cpp's Gemma layouts: every `pattern`-th layer global, the others sliding; local rope base
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
# the 27B models' layer counts: llama.cpp scales their attention by 1/sqrt(hidden / heads)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
# llama.cpp rotates adjacent pairs of q/k elements for "llama" (its "normal" rope) and converts HF's
# rotate-half layout by permuting rows; "qwen2" uses the neox rope, which needs no permutation.
_ROPE_PERMUTED_ARCHITECTURES = frozenset({"llama", "mixtral"})
_GGUF_MAGIC = b"GGUF"

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # a mixture-of-experts layer's router
    # every expert's weights in one tensor [E, ...]: cut per expert by `expert_parts`
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_LAYER_TENSORS = {**_LAYER_TENSORS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")  # older Mixtral files
_MERGED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\w+)\.weight")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


def open_gguf(path: str) -> GGUFReader:
    """Parse a GGUF's header, metadata and tensor index (the data stays memory-mapped)."""
    from gguf import GGUFReader

    _check_magic(path)
    try:
        return GGUFReader(path)
    except Exception as error:  # gguf reports damage as IndexError/ValueError/... from numpy
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({describe(error)})") from None


def _check_magic(path: str) -> None:
    """Tell "not a GGUF at all" apart from "a damaged GGUF", which the reader cannot."""
    try:
        with open(path, "rb") as file:
            magic = file.read(len(_GGUF_MAGIC))
    except OSError as error:
        raise ModelLoadError(f"{path}: cannot read the file ({describe(error)})") from None
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (its first bytes are {magic!r}, not {_GGUF_MAGIC!r})")


def read_arch_config(reader: GGUFReader, path: str) -> ModelArchConfig:
    """The architecture, from llama.cpp's `{arch}.*` and `tokenizer.ggml.*` metadata keys."""
    arch = _architecture(reader, path)
    experts = int(_optional(reader, f"{arch}.expert_count", 0))
    hidden = int(_required(reader, f"{arch}.embedding_length", path))
    heads = int(_required(reader, f"{arch}.attention.head_count", path))
    tensor_names = {tensor.name for tensor in reader.tensors}
    _reject_rope_frequency_factors(tensor_names, path)
    return ModelArchConfig(
        architecture="mixtral" if arch == "llama" and experts else _OUR_ARCHITECTURE.get(arch, arch),
        vocab_size=_vocab_size(reader, arch, path),
        hidden_size=hidden,
        intermediate_size=int(_required(reader, f"{arch}.feed_forward_length", path)),
        num_hidden_layers=int(_required(reader, f"{arch}.block_count", path)),
        num_attention_heads=heads,
        num_key_value_heads=int(_optional(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=_head_dim(reader, arch, hidden, heads, path),
        rms_norm_eps=float(_required(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        rope_theta=float(_optional(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_required(reader, f"{arch}.context_length", path)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_scaling=_rope_scaling(reader, arch, path),
        bos_token_id=_optional_int(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(reader),
        sliding_window=_optional_int(reader, f"{arch}.attention.sliding_window"),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        partial_rotary_factor=_partial_rotary_factor(reader, arch, hidden, heads, path),
        **(_gemma_fields(reader, arch, hidden, heads, path) if arch in _GEMMA else {}),
        **(_moe_fields(reader, arch, experts, tensor_names, path) if experts else {}),
        gguf_tensor_types=_served_tensor_types(reader, tensor_names),
    )


def _served_tensor_types(reader: GGUFReader, tensor_names: set[str]) -> tuple[str, ...]:
    """The types of the tensors a forward multiplies by: an untied `token_embd` is only looked up (its
    type decides no kernel), a tied one is the output projection too."""
    untied = "output.weight" in tensor_names
    kept = [t for t in reader.tensors if not (untied and t.name == "token_embd.weight")]
    return tuple(sorted({tensor.tensor_type.name for tensor in kept}))


def _moe_fields(reader: GGUFReader, arch: str, experts: int, tensor_names: set[str], path: str) -> dict:
    """The experts' count, top k and width (Mixtral's: feed_forward_length), whether the chosen
    weights are renormalized (llama.cpp does for both families unless `expert_weights_norm` says
    otherwise), and the layers without a router, which have a dense MLP."""
    layers = int(_required(reader, f"{arch}.block_count", path))
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(_required(reader, f"{arch}.expert_used_count", path)),
        "moe_intermediate_size": int(
            _optional(reader, f"{arch}.expert_feed_forward_length")
            or _required(reader, f"{arch}.feed_forward_length", path)
        ),
        "norm_topk_prob": bool(_optional(reader, f"{arch}.expert_weights_norm", True)),
        "dense_layers": tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names),
    }


def _partial_rotary_factor(reader: GGUFReader, arch: str, hidden: int, heads: int, path: str) -> float:
    """Rope's share of each head: `rope.dimension_count` over the head size (Phi-4-mini: 0.75)."""
    rotary = _field(reader, f"{arch}.rope.dimension_count")
    return 1.0 if rotary is None else int(rotary) / _head_dim(reader, arch, hidden, heads, path)


def _gemma_fields(reader: GGUFReader, arch: str, hidden: int, heads: int, path: str) -> dict[str, Any]:
    """What llama.cpp derives for Gemma rather than stores: GeGLU, the attention scale (1/sqrt(head_dim),
    Gemma 2 and 3 27B's 1/sqrt(hidden / heads)), the layer pattern and Gemma 3's local rope base."""
    layers = int(_required(reader, f"{arch}.block_count", path))
    head_dim = _head_dim(reader, arch, hidden, heads, path)
    pattern = _GEMMA_SLIDING_PATTERN[arch]
    softcap = _field(reader, f"{arch}.attn_logit_softcapping")
    final_softcap = _field(reader, f"{arch}.final_logit_softcapping")
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": float(hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim),
        "attn_logit_softcapping": None if softcap is None else float(softcap),
        "final_logit_softcapping": None if final_softcap is None else float(final_softcap),
        "layer_types": tuple(
            "full_attention" if (index + 1) % pattern == 0 else "sliding_attention" for index in range(layers)
        ),
        "rope_local_theta": _GEMMA3_LOCAL_ROPE_BASE if arch == "gemma3" else None,
    }


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _required(reader: GGUFReader, key: str, path: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ModelLoadError(f"{path}: the GGUF metadata lacks the key {key}")
    return value


def _optional(reader: GGUFReader, key: str, default: Any = None) -> Any:
    value = _field(reader, key)
    return default if value is None else value


def _optional_int(reader: GGUFReader, key: str) -> int | None:
    value = _field(reader, key)
    return None if value is None else int(value)


def _architecture(reader: GGUFReader, path: str) -> str:
    arch = _required(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} (supported: {supported})")
    if _optional(reader, f"{arch}.expert_count", 0) and arch not in _MOE_ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} with mixture-of-experts layers")
    return arch


def _vocab_size(reader: GGUFReader, arch: str, path: str) -> int:
    """`{arch}.vocab_size`; older files only have the token list, whose length is the same."""
    size = _field(reader, f"{arch}.vocab_size")
    if size is not None:
        return int(size)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"{path}: the GGUF metadata has neither {arch}.vocab_size nor a token list")
    return len(tokens.data)


def _head_dim(reader: GGUFReader, arch: str, hidden: int, heads: int, path: str) -> int:
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        return int(key_length)
    if heads <= 0 or hidden % heads:
        raise ModelLoadError(f"{path}: embedding_length {hidden} is not divisible by head_count {heads}")
    return hidden // heads


def _rope_scaling(reader: GGUFReader, arch: str, path: str) -> dict | None:
    """HF's rope_scaling dict; llama.cpp records only "linear" in a form our rotary layer reproduces."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if factor is None:
        factor = _field(reader, f"{arch}.rope.scale_linear")  # the key before scaling.type existed
        kind = kind or (None if factor is None else "linear")
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    if kind != "linear":
        raise ModelLoadError(f"{path}: unsupported rope scaling type {kind!r} (supported: linear)")
    return {"rope_type": "linear", "factor": float(factor)}


def _reject_rope_frequency_factors(tensor_names: set[str], path: str) -> None:
    """Llama 3.1+ files store their rope scaling as per-frequency factors, which we cannot apply."""
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(
            f"{path}: unsupported rope scaling (per-frequency factors in tensor rope_freqs.weight, "
            "as in Llama 3.1+ GGUFs); load the HF model directory instead"
        )


def _eos_token_ids(reader: GGUFReader) -> tuple[int, ...]:
    """End-of-sequence plus end-of-turn/-message ids: llama.cpp stops on all of them."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = (_optional_int(reader, key) for key in keys)
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def read_weights(
    reader: GGUFReader, arch: ModelArchConfig, path: str, skipped: Callable[[str], bool] = lambda name: False
) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32, under its HF name and in HF's layout; those whose HF
    name `skipped` is true of are left out."""
    weights = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch.architecture)
        if name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r} (an unsupported model variant)")
        if skipped(name):
            continue
        array = _to_hf_layout(name, _dequantize(tensor, path), arch, path)
        for part_name, part in expert_parts(name, array):
            weights[part_name] = torch.from_numpy(part if part.flags.writeable else part.copy())
    return weights


def expert_parts(name: str, array: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A merged experts tensor (`mlp.experts.gate_proj.weight`, first axis the experts) as each
    expert's HF name and rows (views); any other tensor as itself."""
    match = _MERGED_EXPERTS.fullmatch(name)
    if match is None:
        return [(name, array)]
    return [(f"{match[1]}.{expert}.{match[2]}.weight", array[expert]) for expert in range(len(array))]


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for unknown tensors."""
    match = _EXPERT_TENSOR.fullmatch(gguf_name)
    if match:
        layer, part, expert = match.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        names = _GEMMA_LAYER_TENSORS if arch in _GEMMA else _LAYER_TENSORS
        names = _PHI3_LAYER_TENSORS if arch == "phi3" else names
        return f"model.layers.{layer}.{names[part]}.{kind}" if part in names else None
    match = _GLOBAL_TENSOR.fullmatch(gguf_name)
    if match and match.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[match.group(1)]}.{match.group(2)}"
    return None


def _dequantize(tensor: ReaderTensor, path: str) -> np.ndarray:
    """float32 in HF's shape: GGUF lists dimensions fastest-first, the reverse of numpy's order."""
    from gguf.quants import dequantize

    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
        return array.astype(np.float32, copy=False).reshape(shape)
    except Exception as error:  # an unsupported quantization type or a damaged tensor
        raise ModelLoadError(
            f"{path}: cannot dequantize tensor {tensor.name} ({tensor.tensor_type.name}): {describe(error)}"
        ) from None


def _to_hf_layout(name: str, array: np.ndarray, arch: ModelArchConfig, path: str) -> np.ndarray:
    if arch.architecture in _GEMMA and name.endswith("norm.weight"):
        return array - 1  # llama.cpp stores Gemma's (1 + w)
    if arch.architecture not in _ROPE_PERMUTED_ARCHITECTURES:
        return array
    if ".self_attn.q_proj." in name:
        heads = arch.num_attention_heads
    elif ".self_attn.k_proj." in name:
        heads = arch.num_key_value_heads
    else:
        return array
    if array.shape[0] != heads * arch.head_dim or arch.head_dim % 2:
        raise ModelLoadError(
            f"{path}: tensor {name} has {array.shape[0]} rows, not {heads} heads of {arch.head_dim}"
        )
    return unpermute_rope_rows(array, heads)


def unpermute_rope_rows(array: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rows and, for biases, elements are the first axis).

    HF rotates the two halves of each head (element i pairs with i + head_dim/2); llama.cpp rotates
    adjacent elements (2i pairs with 2i + 1). Its converter therefore reorders each head's rows from
    (half, i) to (i, half); swapping those two axes back restores HF's order.
    """
    split = array.reshape(num_heads, array.shape[0] // num_heads // 2, 2, *array.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2)).reshape(array.shape)
