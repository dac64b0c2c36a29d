"""Qwen3-MoE: Qwen3's attention (q/k head norms) with sparse expert MLPs (models/layers/moe.py),
except on the layers its config keeps dense (`mlp_only_layers`, `decoder_sparse_step`); the chosen
experts' weights are renormalized only where `norm_topk_prob` says so. As for Mixtral, the expert
layers split over tensor-parallel ranks by units or by experts (models/layers/moe_parallel.py), are
quantized by int8-rtn, int4 and a GGUF's blocks, cut per rank (quantization/moe.py), and, quantized
on one rank, run in the fused decode stack (models/decode_stack.py).
"""

from __future__ import annotations

from torch import nn

from llmserve.models.layers.moe_parallel import ExpertShardLoading, ParallelSparseMoE
from llmserve.models.llama import LlamaDecoderLayer, LlamaMLP
from llmserve.models.qwen3 import QKNormAttention, Qwen3ForCausalLM, Qwen3Model


class Qwen3MoeMLP(ParallelSparseMoE):
    def __init__(self, arch, shard, tp) -> None:
        super().__init__(
            arch.hidden_size,
            arch.moe_intermediate_size,
            arch.num_experts,
            arch.num_experts_per_tok,
            tp,
            renormalize=arch.norm_topk_prob,
        )


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = QKNormAttention
    mlp_cls = Qwen3MoeMLP


class Qwen3DenseDecoderLayer(LlamaDecoderLayer):
    attention_cls = QKNormAttention
    mlp_cls = LlamaMLP


class Qwen3MoeModel(Qwen3Model):
    def make_layer(self, index, arch, rotary, shard, tp) -> nn.Module:
        layer_cls = Qwen3DenseDecoderLayer if index in arch.dense_layers else Qwen3MoeDecoderLayer
        return layer_cls(arch, rotary, shard, tp)


class Qwen3MoeForCausalLM(ExpertShardLoading, Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel
