"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2): GQA, RoPE, RMSNorm, SwiGLU.

The model runs on a flat batch of tokens from many sequences (no padding) with per-token positions.
It knows nothing of batching or the KV cache layout: its Attention layers read those from the forward
context. Module names follow the HF checkpoint so weights load by name; q/k/v and gate/up are fused
into one matmul each and filled shard by shard at load time.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention.layer import Attention
from llmserve.config import ModelArchConfig
from llmserve.models.layers.activation import SiluAndMul
from llmserve.models.layers.lm_head import LMHead
from llmserve.models.layers.norm import RMSNorm
from llmserve.models.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.q_size = arch.num_attention_heads * arch.head_dim
        self.kv_size = arch.num_key_value_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = Attention(arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        query, key, value = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        query, key = self.rotary(positions, query, key, self.head_dim)
        return self.o_proj(self.attn(query, key, value))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = LlamaAttention(arch, rotary)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = LlamaMLP(arch)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        attn_out = self.self_attn(positions, self.input_layernorm(hidden))
        # attn_out becomes hidden + attn_out, and its normalization comes back with it: one pass
        normed, hidden = self.post_attention_layernorm(attn_out, residual=hidden)
        return hidden + self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        # An explicit (meta) weight skips Embedding's random init, which on the meta device goes through
        # torch._refs and imports torch._dynamo: start-up time for a tensor the checkpoint overwrites.
        self.embed_tokens = nn.Embedding(
            arch.vocab_size, arch.hidden_size, _weight=torch.empty(arch.vocab_size, arch.hidden_size)
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, rotary) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    # fused parameter -> the checkpoint tensors stacked into it, in order
    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, arch: ModelArchConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.arch = arch
        rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, device)
        self.model = LlamaModel(arch, rotary)
        self.lm_head = LMHead(arch.hidden_size, arch.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] for a flat batch of tokens."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] (models/layers/lm_head.py says why float32)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters, filling fused ones by shard."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights.items():
            target, offset = self._fused_target(name, params)
            param = params.get(target)
            if param is None:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in the model")
            param.data[offset : offset + tensor.shape[0]].copy_(tensor)
            loaded.add(name)
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            loaded.add("lm_head.weight")
        self._check_complete(loaded)

    def _fused_target(self, name: str, params: dict[str, nn.Parameter]) -> tuple[str, int]:
        """Map e.g. layers.0.self_attn.k_proj.weight to (layers.0.self_attn.qkv_proj.weight, row offset)."""
        for fused, shards in self.packed_modules.items():
            for index, shard in enumerate(shards):
                if f".{shard}." in name:
                    target = name.replace(shard, fused)
                    return target, sum(self._shard_rows(fused, s) for s in shards[:index])
        return name, 0

    def _shard_rows(self, fused: str, shard: str) -> int:
        arch = self.arch
        if fused == "gate_up_proj":
            return arch.intermediate_size
        heads = arch.num_attention_heads if shard == "q_proj" else arch.num_key_value_heads
        return heads * arch.head_dim

    def _check_complete(self, loaded: set[str]) -> None:
        expected = set()
        for name, _ in self.named_parameters():
            fused = next((f for f in self.packed_modules if f".{f}." in name), None)
            if fused is None:
                expected.add(name)
            else:
                expected.update(name.replace(fused, shard) for shard in self.packed_modules[fused])
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
