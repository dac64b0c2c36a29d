"""Layers with a compiled CPU kernel and a PyTorch formulation, the implementation chosen once.

`bind_kernels(model, device)` runs when a model is built (models/registry.py) or a draft head is
loaded: each CustomOp then forwards to `forward_cpu` where the compiled kernels serve the device, else
to `forward_native` (the PyTorch formulation: CUDA, or a CPU where the kernels did not build). Model
code calls the layer and never asks which device it runs on (vLLM's CustomOp does the same).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from llmserve.kernels.cpu_ops import load_cpu_ops


class CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ops: ModuleType | None = None  # the compiled kernels, once bound to a CPU that has them
        self._forward_method = self.forward_native

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def bind(self, ops: ModuleType | None) -> None:
        self.ops = ops
        self._forward_method = self.forward_native if ops is None else self.forward_cpu


def bind_kernels(model: nn.Module, device: torch.device) -> None:
    """Choose every CustomOp's implementation in `model` for `device`."""
    ops = load_cpu_ops() if torch.device(device).type == "cpu" else None
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.bind(ops)
