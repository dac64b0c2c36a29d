"""GPTQ (Frantar et al., 2022): int4 group-wise weights that compensate each column's rounding error.

For a linear layer with inputs X, the output error of a weight change is measured by the Hessian
H = 2 X^T X / n. Columns are quantized left to right; each one's error, scaled by the inverse
Hessian's Cholesky factor, is spread over the columns not yet quantized, so they absorb it
(optimal brain surgeon, one column at a time). Updates to far columns are deferred and applied once
per block of 128 columns ("lazy batch updates"), and H gets `damp` x its mean diagonal added so
that the inverse exists. Group scales are fixed when the quantizer reaches a group's first column,
from the weights as already updated. Columns are taken in their natural order (no act-order), so
groups stay contiguous and the result is an ordinary `Int4Weight`.
"""

from __future__ import annotations

import torch

from llmserve.quantization.formats import Int4Weight, int4_codes, int4_params

BLOCK_COLUMNS = 128
DEFAULT_DAMP = 0.01


class HessianAccumulator:
    """Running H = 2 X^T X / n over calls with x [tokens, in] (float32: float64 made calibration
    several times slower on CPU, and a few thousand rows sum accurately enough in float32)."""

    def __init__(self, in_features: int, device: torch.device) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.float()
        self.sum.addmm_(x.t(), x)
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        return 2.0 * self.sum / max(self.count, 1)


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float = DEFAULT_DAMP
) -> Int4Weight:
    """Quantize weight [out, in] given its inputs' Hessian [in, in]."""
    weight = weight.float().clone()
    rows, cols = weight.shape
    hessian = hessian.clone()
    dead = hessian.diagonal() == 0  # inputs that were always zero: any value works, pick 0
    hessian[dead, dead] = 1.0
    weight[:, dead] = 0.0
    hessian.diagonal().add_(damp * hessian.diagonal().mean())
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)

    codes = torch.zeros(rows, cols, dtype=torch.uint8, device=weight.device)
    scales = torch.zeros(rows, cols // group_size, device=weight.device)
    offsets = torch.zeros_like(scales)
    for start in range(0, cols, BLOCK_COLUMNS):
        end = min(start + BLOCK_COLUMNS, cols)
        errors = _quantize_block(weight, inverse, start, end, group_size, codes, scales, offsets)
        weight[:, end:] -= errors @ inverse[start:end, end:]  # the deferred (lazy) update
    return Int4Weight(codes, scales, offsets, group_size)


def _quantize_block(weight, inverse, start, end, group_size, codes, scales, offsets) -> torch.Tensor:
    """Quantize columns start..end in place; returns their scaled errors [out, end - start]."""
    block = weight[:, start:end]
    block_inverse = inverse[start:end, start:end]
    errors = torch.zeros_like(block)
    for column in range(end - start):
        index = start + column
        group = index // group_size
        if index % group_size == 0:  # a new group: its parameters from the weights as updated so far
            scale, offset = int4_params(block[:, column : column + group_size])
            scales[:, group], offsets[:, group] = scale, offset
        scale, offset = scales[:, group], offsets[:, group]
        values = block[:, column]
        code = int4_codes(values, scale, offset)
        codes[:, index] = code.to(torch.uint8)
        error = (values - (code * scale + offset)) / block_inverse[column, column]
        block[:, column:] -= error[:, None] * block_inverse[column, column:][None, :]
        errors[:, column] = error
    return errors
