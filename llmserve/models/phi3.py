"""Phi-3 / Phi-4-mini: Llama's layer with rope on a `partial_rotary_factor` of each head and LongRoPE
scaling (models/layers/rotary.py).

The checkpoint's fused qkv_proj and gate_up_proj are split into Llama's names at load
(model_loader/family_weights.py), so quantization and tensor parallelism treat them as Llama's.
With rope on whole heads the layers are Llama's exactly and the fused decode stack serves them;
partial rope runs the module path (the stack's kernel rotates whole heads).
"""

from __future__ import annotations

import torch

from llmserve.config import ModelArchConfig
from llmserve.models.layers.rotary import PartialRotaryEmbedding, RotaryEmbedding
from llmserve.models.llama import LlamaForCausalLM


def rotary_dim(arch: ModelArchConfig) -> int:
    return int(arch.head_dim * arch.partial_rotary_factor)


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArchConfig, *args, **kwargs) -> None:
        super().__init__(arch, *args, **kwargs)
        self.fused_decode_stack = rotary_dim(arch) == arch.head_dim

    @staticmethod
    def make_rotary(arch: ModelArchConfig, max_positions: int, device: torch.device):
        dim = rotary_dim(arch)
        rope_cls = RotaryEmbedding if dim == arch.head_dim else PartialRotaryEmbedding
        return rope_cls(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, device, dim)
