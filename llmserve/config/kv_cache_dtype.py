"""The KV cache's storage dtypes (`--kv-cache-dtype`) as the pool's sizing sees them: bytes per row.

attention/kv_format.py implements each (how rows are written and read); it takes its row sizes from
here, so the pool is sized by the same arithmetic that lays it out. An 8-bit row is the head_dim codes
followed by its float16 scale.
"""

from __future__ import annotations

import typing
from typing import Literal

import torch

KVCacheDtype = Literal["auto", "int8", "fp8"]  # auto: the model dtype
KV_CACHE_DTYPES: tuple[str, ...] = typing.get_args(KVCacheDtype)
SCALE_BYTES = 2  # one float16 scale per 8-bit row


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool tensor's dtype: the model's, or bytes for an 8-bit cache."""
    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else torch.uint8


def kv_row_size(name: str, head_dim: int) -> int:
    """Elements of the pool's last dimension per (slot, KV head)."""
    check_kv_cache_dtype(name)
    if name == "auto":
        return head_dim
    if head_dim % SCALE_BYTES:
        raise ValueError(f"an 8-bit KV cache needs an even head_dim, got {head_dim}")
    return head_dim + SCALE_BYTES


def kv_row_bytes(name: str, head_dim: int, model_dtype: torch.dtype) -> int:
    return kv_row_size(name, head_dim) * kv_storage_dtype(name, model_dtype).itemsize
