"""Layers with compiled kernels and a PyTorch formulation, the implementation chosen once.

`bind_kernels(model, device)` runs when a model is built (models/registry.py) or a draft head is
loaded: each CustomOp then forwards to `forward_cpu` where the compiled C++ kernels serve a CPU, to
`forward_cuda` (the Triton kernels, kernels/triton/elementwise.py) on a CUDA device where Triton
imports, else to `forward_native` (the PyTorch formulation: any other device, a CPU where the kernels
did not build, CUDA without Triton). Model code calls the layer and never asks which device it runs on
(vLLM's CustomOp does the same).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from llmserve.kernels.cpu_ops import load_cpu_ops


class CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ops: ModuleType | None = None  # the kernels bound for the device (the C++ or Triton ones)
        self._forward_method = self.forward_native

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def bind(self, ops: ModuleType | None, device_type: str = "cpu") -> None:
        """Forward to the kernels `ops` of `device_type` ("cpu" or "cuda"), or without them natively."""
        self.ops = ops
        if ops is None:
            self._forward_method = self.forward_native
        else:
            self._forward_method = self.forward_cuda if device_type == "cuda" else self.forward_cpu


def load_triton_ops() -> ModuleType | None:
    """The Triton elementwise kernels, or None where Triton does not import."""
    try:
        from llmserve.kernels.triton import elementwise
    except ImportError:
        return None
    return elementwise


def bind_kernels(model: nn.Module, device: torch.device) -> None:
    """Choose every CustomOp's implementation in `model` for `device`."""
    device_type = torch.device(device).type
    ops = _load_ops(device_type)
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.bind(ops, device_type)


def _load_ops(device_type: str) -> ModuleType | None:
    """The kernels for a device type: the compiled C++ ones on a CPU, the Triton ones on CUDA."""
    if device_type == "cpu":
        return load_cpu_ops()
    if device_type == "cuda":
        return load_triton_ops()
    return None
