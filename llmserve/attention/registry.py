"""Attention backends by name; the reference torch backend is the oracle for the others."""

from __future__ import annotations

import logging

import torch

from llmserve.attention.backends.cpu_paged import CPUPagedBackend
from llmserve.attention.backends.torch_sdpa import TorchSDPABackend

logger = logging.getLogger("llmserve")

_BACKENDS = {backend.name: backend for backend in (TorchSDPABackend, CPUPagedBackend)}


def get_attention_backend(name: str = "torch"):
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from auto, {', '.join(sorted(_BACKENDS))}"
        )
    return _BACKENDS[name]()


def select_attention_backend(name: str, device: torch.device):
    """Resolve "auto": the compiled paged kernel on CPU when it builds, else the reference."""
    if name != "auto":
        return get_attention_backend(name)
    if device.type == "cpu":
        try:
            return get_attention_backend(CPUPagedBackend.name)
        except RuntimeError:
            pass
    return get_attention_backend(TorchSDPABackend.name)
