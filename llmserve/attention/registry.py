"""Attention backends by name; the reference torch backend is the oracle for the others."""

from __future__ import annotations

from llmserve.attention.backends.torch_sdpa import TorchSDPABackend

_BACKENDS = {TorchSDPABackend.name: TorchSDPABackend}


def get_attention_backend(name: str = "torch"):
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    return _BACKENDS[name]()
