"""Gated MLP activations on a fused [gate | up] projection: SwiGLU (SiLU) and GeGLU (GELU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.models.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2:
            return self.forward_native(gate_up)
        return self.ops.silu_and_mul(gate_up)

    def forward_cuda(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self.ops.takes_rows(gate_up):
            return self.forward_native(gate_up)
        return self.ops.silu_and_mul(gate_up)


class GeluTanhAndMul(CustomOp):
    """GeGLU's activation on a fused [gate | up] projection: GELU(gate, tanh approximation) * up."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def forward_cuda(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self.ops.takes_rows(gate_up):
            return self.forward_native(gate_up)
        return self.ops.gelu_tanh_and_mul(gate_up)
