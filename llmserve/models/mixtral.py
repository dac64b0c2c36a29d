"""Mixtral: Llama's layer with a sparse mixture-of-experts MLP (models/layers/moe.py).

Checkpoints store each expert's w1 (gate), w3 (up) and w2 (down) under block_sparse_moe.experts.N;
the loader stacks them into the experts' [E, ...] parameters (model_loader/family_weights.py).
Over a tensor-parallel group the expert layers split by units or, with --enable-expert-parallel, by
experts (models/layers/moe_parallel.py). int8-rtn, int4 and a GGUF's blocks (cut per rank) quantize
the experts (quantization/moe.py swaps the experts module), which on one rank run in the fused decode
stack (models/decode_stack.py); the calibrated methods do not handle expert layers (config/families.py
says so in one line).
"""

from __future__ import annotations

from llmserve.models.layers.moe_parallel import ExpertShardLoading, ParallelSparseMoE
from llmserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class MixtralMoE(ParallelSparseMoE):
    def __init__(self, arch, shard, tp) -> None:
        units = arch.moe_intermediate_size or arch.intermediate_size
        super().__init__(arch.hidden_size, units, arch.num_experts, arch.num_experts_per_tok, tp)


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_cls = MixtralMoE


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(ExpertShardLoading, LlamaForCausalLM):
    model_cls = MixtralModel
