"""GPTQ (Frantar et al., 2022): weights that compensate each column's rounding error.

For a linear layer with inputs X, the output error of a weight change is measured by the Hessian
H = 2 X^T X / n. Columns are quantized left to right; each one's error, scaled by the inverse
Hessian's Cholesky factor, is spread over the columns not yet quantized, so they absorb it
(optimal brain surgeon, one column at a time). Updates to far columns are deferred and applied once
per block of 128 columns ("lazy batch updates"), and H gets `damp` x its mean diagonal added so
that the inverse exists. Group parameters are fixed when the quantizer reaches a group's first
column, from the weights as already updated. Columns are taken in their natural order (no
act-order), so groups stay contiguous and the result is an ordinary `Int4Weight` or `Int8Weight`.

Two grids (`GRIDS`): int4 group-wise asymmetric (`--quantization gptq`) and int8 symmetric, whose
group may be the whole row (one scale per output channel: `--quantization int8`, which then keeps
the single packed int8 call per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.quantization.calibration import one_thread
from llmserve.quantization.formats import (
    INT8_MAX,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    int4_codes,
    int4_params,
    int8_scales,
)

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


@dataclass(frozen=True)
class Grid:
    """One format's quantizer: w ~= code * scale + offset, parameters per (row, group)."""

    kind: str  # "int4" | "int8"

    def params(self, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and offset [rows] of a group's columns [rows, group_size]."""
        if self.kind == "int4":
            return int4_params(group)
        scales = int8_scales(group)
        return scales, torch.zeros_like(scales)

    def codes(self, values: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        if self.kind == "int4":
            return int4_codes(values, scale, offset)
        return torch.round(values / scale).clamp(-INT8_MAX, INT8_MAX)

    def weight(self, codes: torch.Tensor, scales, offsets, group_size: int) -> QuantizedWeight:
        if self.kind == "int4":
            return Int4Weight(codes.to(torch.uint8), scales, offsets, group_size)
        return Int8Weight(codes.to(torch.int8), scales, group_size)


GRIDS = {"int4": Grid("int4"), "int8": Grid("int8")}


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int | None,
    damp: float = DEFAULT_DAMP,
    kind: str = "int4",
) -> QuantizedWeight:
    """Quantize weight [out, in] given its inputs' Hessian [in, in]; `group_size` None: the whole
    row is one group (one scale per output channel)."""
    with one_thread():  # small ops: see one_thread
        return _gptq(GRIDS[kind], weight, hessian, group_size, damp)


def _gptq(grid: Grid, weight, hessian, group_size: int | None, damp: float) -> QuantizedWeight:
    weight = weight.float().clone()
    rows, cols = weight.shape
    group_size = group_size or cols
    hessian = hessian.clone()
    dead = hessian.diagonal() == 0  # inputs that were always zero: any value works, pick 0
    hessian[dead, dead] = 1.0
    weight[:, dead] = 0.0
    hessian.diagonal().add_(damp * hessian.diagonal().mean())
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)

    codes = torch.zeros(rows, cols, device=weight.device)
    scales = torch.zeros(rows, cols // group_size, device=weight.device)
    offsets = torch.zeros_like(scales)
    for start in range(0, cols, BLOCK_COLUMNS):
        end = min(start + BLOCK_COLUMNS, cols)
        errors = _quantize_block(grid, weight, inverse, start, end, group_size, codes, scales, offsets)
        weight[:, end:] -= errors @ inverse[start:end, end:]  # the deferred (lazy) update
    return grid.weight(codes, scales, offsets, group_size)


def _quantize_block(grid, weight, inverse, start, end, group_size, codes, scales, offsets) -> torch.Tensor:
    """Quantize columns start..end in place; returns their scaled errors [out, end - start]."""
    block = weight[:, start:end]
    block_inverse = inverse[start:end, start:end]
    errors = torch.zeros_like(block)
    for column in range(end - start):
        index = start + column
        group = index // group_size
        if index % group_size == 0:  # a new group: its parameters from the weights as updated so far
            scales[:, group], offsets[:, group] = grid.params(weight[:, index : index + group_size])
        scale, offset = scales[:, group], offsets[:, group]
        values = block[:, column]
        code = grid.codes(values, scale, offset)
        codes[:, index] = code
        error = (values - (code * scale + offset)) / block_inverse[column, column]
        block[:, column:] -= error[:, None] * block_inverse[column, column:][None, :]
        errors[:, column] = error
    return errors
