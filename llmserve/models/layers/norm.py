"""RMSNorm, computed in float32 like the reference implementation, whatever the model dtype."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.models.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """RMSNorm(x); given `residual`, x becomes x + residual (in place: x is a sublayer's fresh output)
    and the result is (RMSNorm(x + residual), x + residual), a decoder layer's "add the sublayer back,
    normalize for the next one" in one pass."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.reference(x)
        x = x.add_(residual)
        return self.reference(x), x

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 2 or x.dtype != self.weight.dtype:  # the kernel's shapes: rows of the weight's dtype
            return self.forward_native(x, residual)
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps), x

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.ops.norm_takes(x, self.weight, residual):
            return self.forward_native(x, residual)
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps), x

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The PyTorch formulation (HF's): the oracle for the kernels, and the path without them."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
