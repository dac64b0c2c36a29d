"""AWQ (Lin et al., 2023): scale salient input channels up before rounding, and the input down.

A linear layer's output error from rounding is weighted by its inputs' magnitudes, so the channels
with large activations matter most. AWQ multiplies weight column j by s_j (its rounding error
shrinks relative to its value) and divides input j by s_j, which is free when the input comes from
an operation that can absorb it. The scales are s = mean|x|^alpha (normalized), with alpha chosen
from a grid by the error of the layer's output on calibration inputs, then the scaled weights are
rounded group-wise (RTN int4).

Where the division is folded, per decoder layer:
    input_layernorm weight       <- q/k/v projections (one shared input, one scale vector)
    post_attention_layernorm     <- gate/up projections
    up_proj rows                 <- down_proj (down's input is silu(gate) * up, linear in up)
The o_proj input (the attention output) would fold into v_proj rows only with one scale per kv
head shared by its query heads (GQA); it is left to plain RTN.
"""

from __future__ import annotations

import torch

from llmserve.quantization.formats import fake_quantize_int4

GRID = 20  # alpha = 0, 1/20, ..., 19/20
SEARCH_TOKENS = 512  # calibration rows the search measures the error on


def search_scales(weight: torch.Tensor, inputs: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-input-channel scales [in] minimizing ||X W^T - X Q(W s)^T / s||^2 over the alpha grid."""
    x = _subsample(inputs.float())
    weight = weight.float()
    reference = x @ weight.t()
    magnitude = x.abs().mean(0)
    best_error, best = float("inf"), torch.ones_like(magnitude)
    for step in range(GRID):
        scales = magnitude.pow(step / GRID).clamp_min(1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        candidate = fake_quantize_int4(weight * scales, group_size) / scales
        error = (x @ candidate.t() - reference).pow(2).mean().item()
        if error < best_error:
            best_error, best = error, scales
    return best


def _subsample(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] <= SEARCH_TOKENS:
        return x
    step = x.shape[0] // SEARCH_TOKENS
    return x[::step][:SEARCH_TOKENS]


@torch.no_grad()
def apply_scales(weights: list[torch.Tensor], previous: torch.Tensor, scales: torch.Tensor) -> None:
    """Columns of `weights` times s, `previous` (a norm weight or producer rows) divided by s."""
    for weight in weights:
        weight.mul_(scales.to(weight.dtype))
    view = scales.to(previous.dtype)
    previous.div_(view if previous.dim() == 1 else view[:, None])
