"""Qwen3: the Llama layer with an RMSNorm over each query and key head before rope (q_norm, k_norm).

The norms share one weight across heads, so tensor parallelism replicates them. The fused decode
stack (models/decode_stack.py) runs them too, with the kernel the modules call.
"""

from __future__ import annotations

import torch

from llmserve.models.layers.norm import RMSNorm
from llmserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class QKNormAttention(LlamaAttention):
    def __init__(self, arch, rotary, shard, tp) -> None:
        super().__init__(arch, rotary, shard, tp)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query, key = self.normalize_heads(query, key)
        query, key = self.rotary(positions, query, key, self.head_dim)
        return self.tp.all_reduce(self.o_proj(self.attn(query, key, value)))

    def normalize_heads(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's RMSNorm, as [tokens, heads * head_dim] rows again (fresh contiguous tensors)."""
        tokens = query.shape[0]
        query = self.q_norm(query.reshape(-1, self.head_dim)).view(tokens, -1)
        key = self.k_norm(key.reshape(-1, self.head_dim)).view(tokens, -1)
        return query, key


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = QKNormAttention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
