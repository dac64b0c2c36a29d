"""Attention backends by name; the reference torch backend is the oracle for the others."""

from __future__ import annotations

import logging

import torch

from llmserve.attention.backends.cpu_paged import CPUPagedBackend
from llmserve.attention.backends.torch_sdpa import TorchSDPABackend

logger = logging.getLogger("llmserve")

_BACKENDS = {backend.name: backend for backend in (TorchSDPABackend, CPUPagedBackend)}


def get_attention_backend(name: str = "torch", kv_cache_dtype: str = "auto"):
    """A backend instance reading and writing the KV cache in the given format (kv_format.py)."""
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from auto, {', '.join(sorted(_BACKENDS))}"
        )
    return _BACKENDS[name](kv_cache_dtype)


def select_attention_backend(
    name: str, device: torch.device, kv_cache_dtype: str = "auto", reference_only: bool = False
):
    """Resolve "auto": the compiled paged kernel on CPU when it builds, else the reference (always
    the reference for a model whose scores are soft-capped: `reference_only`)."""
    if reference_only and name not in ("auto", TorchSDPABackend.name):
        raise ValueError(
            f"attention backend {name!r} cannot soft-cap attention scores (this model's); use auto or torch"
        )
    if reference_only:
        return get_attention_backend(TorchSDPABackend.name, kv_cache_dtype)
    if name != "auto":
        return get_attention_backend(name, kv_cache_dtype)
    if device.type == "cpu":
        try:
            return get_attention_backend(CPUPagedBackend.name, kv_cache_dtype)
        except RuntimeError:
            pass
    return get_attention_backend(TorchSDPABackend.name, kv_cache_dtype)
