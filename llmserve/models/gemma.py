"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP with Gemma's differences.

- RMSNorm scales by (1 + w): the checkpoint's norm weights get 1 added at load, so the usual RMSNorm
  (and its compiled kernel) computes it.
- Embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype as HF rounds it.
- GeGLU (GELU with the tanh approximation) in the MLP; attention scaled by query_pre_attn_scalar^-1/2.
- Norms after attention and after the MLP as well as before (four per layer).
- Layers alternate between sliding (local) and global attention (`layer_types`); Gemma 3's local
  layers have their own rope base, its global ones the rope scaling. The KV cache keeps only the
  window of a local layer (its KV-cache group frees the rest: config/kv_groups.py), unless
  --disable-hybrid-kv-cache-manager keeps every position and the window only masks.
- Gemma 2 soft-caps attention scores and final logits (cap * tanh(x / cap)): the compiled paged
  attention kernel has no soft-cap, so those models take the reference attention backend.
- Gemma 3 normalizes each query and key head (q_norm, k_norm, also (1 + w)).

The fused decode stack does not run these layers (module path).
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention.layer import LocalAttention
from llmserve.config import ModelArchConfig
from llmserve.models.layers.activation import GeluTanhAndMul, SiluAndMul
from llmserve.models.layers.norm import RMSNorm
from llmserve.models.layers.rotary import RotaryEmbedding
from llmserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from llmserve.models.qwen3 import QKNormAttention

SLIDING = "sliding_attention"


def _local_attention(arch: ModelArchConfig, shard, sliding: bool) -> LocalAttention:
    return LocalAttention(
        len(shard.q_heads),
        len(shard.kv_heads),
        arch.head_dim,
        scale=(arch.query_pre_attn_scalar or arch.head_dim) ** -0.5,
        sliding_window=(arch.sliding_window or 0) if sliding else 0,
        softcap=arch.attn_logit_softcapping or 0.0,
    )


class Gemma2Attention(LlamaAttention):
    def __init__(self, arch, rotary, shard, tp, sliding: bool) -> None:
        super().__init__(arch, rotary, shard, tp)
        self.attn = _local_attention(arch, shard, sliding)


class Gemma3Attention(QKNormAttention):
    def __init__(self, arch, rotary, shard, tp, sliding: bool) -> None:
        super().__init__(arch, rotary, shard, tp)
        self.attn = _local_attention(arch, shard, sliding)


class GemmaMLP(LlamaMLP):
    def __init__(self, arch, shard, tp) -> None:
        super().__init__(arch, shard, tp)
        self.act_fn = GeluTanhAndMul() if arch.hidden_act == "gelu_pytorch_tanh" else SiluAndMul()


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch, rotary, shard, tp, sliding: bool) -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        attention_cls = Gemma3Attention if arch.qk_norm else Gemma2Attention
        self.input_layernorm = RMSNorm(arch.hidden_size, eps)
        self.self_attn = attention_cls(arch, rotary, shard, tp, sliding)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)
        self.mlp = GemmaMLP(arch, shard, tp)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attn_out = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(hidden)))
        normed, hidden = self.pre_feedforward_layernorm(attn_out, residual=hidden)  # hidden += attn_out
        return hidden + self.post_feedforward_layernorm(self.mlp(normed))


class GemmaModel(LlamaModel):
    embed_scale = 1.0  # sqrt(hidden_size) in the model dtype, set at load (the dtype is known then)

    def make_layer(self, index, arch, rotary, shard, tp) -> nn.Module:
        sliding = arch.layer_types[index] == SLIDING
        global_rope, local_rope = rotary
        return GemmaDecoderLayer(arch, local_rope if sliding else global_rope, shard, tp, sliding)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.stage.is_first:
            hidden = self.embed_tokens(input_ids) * self.embed_scale
        for index in self.stage.layers:
            hidden = self.layers[index](positions, hidden)
        return self.norm(hidden) if self.stage.is_last else hidden


class GemmaForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel
    fused_decode_stack = False

    def __init__(self, arch: ModelArchConfig, *args, **kwargs) -> None:
        super().__init__(arch, *args, **kwargs)
        self.reference_attention_only = bool(arch.attn_logit_softcapping)

    @staticmethod
    def make_rotary(arch: ModelArchConfig, max_positions: int, device: torch.device):
        """(the global layers' rope, the local layers'): Gemma 3's local layers have their own base
        and no scaling; Gemma 2's share one."""
        global_rope = RotaryEmbedding(
            arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, device
        )
        if arch.rope_local_theta is None:
            return global_rope, global_rope
        return global_rope, RotaryEmbedding(arch.head_dim, max_positions, arch.rope_local_theta, None, device)

    def load_weights(self, weights: dict[str, torch.Tensor], left_out: frozenset[str] = frozenset()) -> None:
        """HF's Gemma RMSNorm multiplies by (1 + w) in float32: w + 1 is stored instead."""
        weights = {
            name: tensor.float() + 1 if name.endswith("norm.weight") else tensor
            for name, tensor in weights.items()
        }
        super().load_weights(weights, left_out)
        dtype = next(self.parameters()).dtype
        self.model.embed_scale = float(torch.tensor(self.arch.hidden_size**0.5, dtype=dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        if logits is None or not cap:
            return logits
        return logits.div_(cap).tanh_().mul_(cap)  # in place: a fresh float32 tensor
