"""Logits in float32 from a weight of any dtype: the output projection's one formula where no
compiled kernel writes them (models/layers/lm_head.py says why float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_MM_OUT_DTYPE = {"usable": True}  # False once torch.mm(out_dtype=float32) was refused (an older build)


def float32_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """hidden @ weight.T (+ bias) with float32 out: the GEMM's float32 accumulators where the device
    writes them unrounded (CUDA), else the product taken in float32."""
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(hidden, weight, bias)
    if hidden.device.type == "cuda" and _MM_OUT_DTYPE["usable"]:
        try:
            logits = torch.mm(hidden.reshape(-1, hidden.shape[-1]), weight.t(), out_dtype=torch.float32)
            logits = logits.view(*hidden.shape[:-1], weight.shape[0])
            return logits if bias is None else logits + bias.float()
        except (RuntimeError, TypeError):
            _MM_OUT_DTYPE["usable"] = False
    return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
