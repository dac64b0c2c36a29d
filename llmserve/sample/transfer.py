"""Host-to-device copies of the sampler's per-step tensors that do not stall the host.

A copy from pageable host memory to CUDA waits for the work queued before it (the step's forward);
one from pinned memory with non_blocking is queued behind it instead.
"""

from __future__ import annotations

import torch


def to_device(cpu_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`cpu_tensor` on `device`, queued (pinned, non-blocking) where that is CUDA."""
    if device.type == "cuda":
        return cpu_tensor.pin_memory().to(device, non_blocking=True)
    return cpu_tensor.to(device)
