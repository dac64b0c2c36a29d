"""Checkpoint layouts of other families brought to the names the models load (HF Llama's), and the
tensors each family has beyond Llama's.

- Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj: split here, so quantization
  and tensor parallelism see Llama's tensors.
- Mixtral stores each expert's w1 (gate), w3 (up), w2 (down) under block_sparse_moe.experts.N,
  Qwen3-MoE its gate_proj, up_proj, down_proj under mlp.experts.N: stacked here into
  mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I], the router as mlp.gate.
"""

from __future__ import annotations

import re

import torch

from llmserve.config import ModelArchConfig

# Mixtral's w1 (gate), w3 (up), w2 (down); Qwen3-MoE's gate_proj, up_proj, down_proj
_EXPERT = re.compile(
    r"(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w[123]|gate_proj|up_proj|down_proj)\.weight$"
)
_MERGED_EXPERT = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def to_llama_names(arch: ModelArchConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if arch.architecture == "phi3":
        return dict(_split_fused(arch, weights))
    if arch.num_experts:
        return _stack_experts(arch, weights)
    return weights


def _split_fused(arch: ModelArchConfig, weights: dict[str, torch.Tensor]):
    q_size = arch.num_attention_heads * arch.head_dim
    kv_size = arch.num_key_value_heads * arch.head_dim
    for name, tensor in weights.items():
        if ".qkv_proj." in name and tensor.shape[0] == q_size + 2 * kv_size:
            names = (name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj"))
            yield from zip(names, tensor.split([q_size, kv_size, kv_size]), strict=True)
        elif ".gate_up_proj." in name and tensor.shape[0] % 2 == 0:
            names = (name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj"))
            yield from zip(names, tensor.chunk(2), strict=True)
        else:
            yield name, tensor


def stacked_expert_name(name: str) -> str | None:
    """The stacked experts tensor (`model.layers.N.mlp.experts.gate_up_proj` or `.down_proj`) that a
    checkpoint's expert tensor goes into: one expert's (`...experts.3.w1.weight`) or all experts'
    merged (`...experts.gate_proj.weight`, a GGUF's); None for any other tensor."""
    match = _EXPERT.match(name) or _MERGED_EXPERT.match(name)
    if match is None:
        return None
    stacked = "down_proj" if _PART[match[match.lastindex]] == "down" else "gate_up_proj"
    return f"{match[1]}.mlp.experts.{stacked}"


def _stack_experts(arch: ModelArchConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in weights.items():
        match = _EXPERT.match(name)
        if match:
            experts.setdefault(match[1], {})[(int(match[2]), _PART[match[3]])] = tensor
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for layer, parts in experts.items():
        if len(parts) != 3 * arch.num_experts:
            continue  # incomplete: check_weights names the stacked tensor as missing
        count = range(arch.num_experts)
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((parts[(e, "gate")], parts[(e, "up")])) for e in count]
        )
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([parts[(e, "down")] for e in count])
    return out


def family_shapes(arch: ModelArchConfig, prefix: str) -> dict[str, tuple[int, ...] | None]:
    """Layer tensors a family adds to (shape) or removes from (None) Llama's, under `prefix`."""
    hidden, head_dim = arch.hidden_size, arch.head_dim
    shapes: dict[str, tuple[int, ...] | None] = {}
    if arch.qk_norm:
        shapes[f"{prefix}self_attn.q_norm.weight"] = (head_dim,)
        shapes[f"{prefix}self_attn.k_norm.weight"] = (head_dim,)
    if arch.architecture in ("gemma2", "gemma3"):
        shapes[f"{prefix}pre_feedforward_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}post_feedforward_layernorm.weight"] = (hidden,)
    if arch.num_experts and int(prefix.split(".")[2]) not in arch.dense_layers:
        units = arch.moe_intermediate_size or arch.intermediate_size
        for name in ("gate_proj", "up_proj", "down_proj"):
            shapes[f"{prefix}mlp.{name}.weight"] = None
        shapes[f"{prefix}mlp.gate.weight"] = (arch.num_experts, hidden)
        shapes[f"{prefix}mlp.experts.gate_up_proj"] = (arch.num_experts, 2 * units, hidden)
        shapes[f"{prefix}mlp.experts.down_proj"] = (arch.num_experts, hidden, units)
    return shapes
