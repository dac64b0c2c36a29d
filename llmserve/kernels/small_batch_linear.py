"""Linear layers that switch to the compiled matrix-vector kernel at small batch (bf16 on CPU).

At 1-8 rows a linear layer reads every weight once and does little else: it is bound by memory
bandwidth. PyTorch's bf16 GEMM ran at about half this kernel's speed there (a one-thread
microbenchmark over SmolLM2's shapes; the end-to-end effect, batch-1 decode 18.6 -> 14.5 ms/token,
is in docs/benchmarks.md), and decode at low concurrency and speculative verification spend most
of their time in it. `use_small_batch_linear` turns the model's plain `nn.Linear`s into
`SmallBatchLinear`s (same parameters, shared weights stay shared) whose forward takes the kernel
for few rows and `F.linear` otherwise; quantized layers keep their own kernels. Like quantization,
this is a transform of the loaded model: the model file does not change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels.cpu_ops import load_cpu_ops

MAX_ROWS = 8  # above this the GEMM in F.linear is compute-bound and faster


class SmallBatchLinear(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() == 2 and input.shape[0] <= MAX_ROWS:
            out = load_cpu_ops().small_batch_linear(input.contiguous(), self.weight)
            return out if self.bias is None else out + self.bias
        return F.linear(input, self.weight, self.bias)


def use_small_batch_linear(model: nn.Module) -> int:
    """Swap every plain `nn.Linear` with bf16 weights on the CPU and an input width the kernel takes
    (a multiple of 32), where this build has the kernel; returns how many were swapped."""
    ops = load_cpu_ops()
    if ops is None or not ops.small_batch_linear_supported():
        return 0
    swapped = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            type(module) is nn.Linear
            and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu"
            and module.in_features % 32 == 0
        ):
            weight.data = weight.data.contiguous()
            module.__class__ = SmallBatchLinear
            swapped += 1
    return swapped
