"""Linear layers that switch to the compiled matrix-vector kernel at small batch (bf16 on CPU).

At 1-8 rows a linear layer reads every weight once and does little else: it is bound by memory
bandwidth. PyTorch's bf16 GEMM reaches about half of what the machine can stream there (docs/
benchmarks.md has the measurement), so decode at low concurrency and speculative verification
spend most of their time in it. `use_small_batch_linear` turns the model's plain `nn.Linear`s into
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
            out = _small_batch_linear(input.contiguous(), self.weight)
            return out if self.bias is None else out + self.bias
        return F.linear(input, self.weight, self.bias)


_small_batch_linear = None


def can_use_small_batch_linear(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a CPU whose build of the kernels has the AVX-512 BF16 path."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    ops = load_cpu_ops()
    return ops is not None and ops.small_batch_linear_supported()


def use_small_batch_linear(model: nn.Module) -> int:
    """Swap every plain bf16 `nn.Linear` whose input width the kernel takes; returns how many."""
    global _small_batch_linear
    ops = load_cpu_ops()
    if ops is None or not ops.small_batch_linear_supported():
        return 0
    _small_batch_linear = ops.small_batch_linear
    swapped = 0
    for module in model.modules():
        if (
            type(module) is nn.Linear
            and module.weight.dtype == torch.bfloat16
            and module.in_features % 32 == 0
        ):
            module.weight.data = module.weight.data.contiguous()
            module.__class__ = SmallBatchLinear
            swapped += 1
    return swapped
