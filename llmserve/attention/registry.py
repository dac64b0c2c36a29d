"""Attention backends by name; the reference torch backend is the oracle for the others."""

from __future__ import annotations

import logging

import torch

from llmserve.attention.backends.cpu_paged import CPUPagedBackend
from llmserve.attention.backends.torch_sdpa import TorchSDPABackend
from llmserve.attention.backends.triton_paged import TritonPagedBackend
from llmserve.config.kv_cache_dtype import is_low_bit

logger = logging.getLogger("llmserve")

_BACKENDS = {backend.name: backend for backend in (TorchSDPABackend, CPUPagedBackend, TritonPagedBackend)}
_SOFT_CAPPING = (TorchSDPABackend.name, TritonPagedBackend.name)  # the backends that soft-cap scores


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
    """Resolve "auto": the compiled paged kernel on CPU when it builds, the Triton kernel on CUDA when
    triton imports, else the reference. A model whose scores are soft-capped (`reference_only`) runs
    a backend that soft-caps: on CPU the reference, on CUDA the Triton kernel."""
    if reference_only and name not in ("auto", *_SOFT_CAPPING):
        raise ValueError(
            f"attention backend {name!r} cannot soft-cap attention scores (this model's); "
            f"use auto, {' or '.join(_SOFT_CAPPING)}"
        )
    if is_low_bit(kv_cache_dtype) and name == TritonPagedBackend.name:
        raise ValueError(
            f"attention backend {name!r} does not read {kv_cache_dtype} KV caches; use auto or torch"
        )
    if name == TritonPagedBackend.name and not TritonPagedBackend.runs_on(device):
        raise ValueError(f"attention backend {name!r} runs on CUDA devices, not {device.type}")
    if name != "auto":
        return get_attention_backend(name, kv_cache_dtype)
    fast = _in_place_backend(device, reference_only)
    if is_low_bit(kv_cache_dtype) and fast == TritonPagedBackend.name:  # no Triton kernel for them yet
        fast = None
    if fast is not None:
        try:
            return get_attention_backend(fast, kv_cache_dtype)
        except RuntimeError:  # not built (CPU) or no triton (CUDA)
            pass
    return get_attention_backend(TorchSDPABackend.name, kv_cache_dtype)


def _in_place_backend(device: torch.device, reference_only: bool) -> str | None:
    """The backend "auto" tries first: Triton's on CUDA; on CPU the compiled one, which cannot
    soft-cap (soft-capped models keep the reference there)."""
    if device.type == "cuda":
        return TritonPagedBackend.name
    if device.type == "cpu" and not reference_only:
        return CPUPagedBackend.name
    return None
