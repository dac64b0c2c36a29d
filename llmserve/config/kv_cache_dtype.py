"""The KV cache's storage dtypes (`--kv-cache-dtype`) as the pool's sizing sees them: bytes per row.

attention/kv_format.py implements each (how rows are written and read); it takes its row sizes from
here, so the pool is sized by the same arithmetic that lays it out. An 8-bit row is the head_dim codes
followed by its float16 scale. A 4-bit or 2-bit row (KIVI: keys per channel over a block of
LOW_BIT_GROUP tokens, values per token in groups of LOW_BIT_GROUP channels) is the head_dim packed codes
followed by head_dim / 8 bytes of float16 (scale, minimum) pairs: its block's share of the keys'
per-channel pairs, or its own value groups' pairs.
"""

from __future__ import annotations

import typing
from typing import Literal

import torch

KVCacheDtype = Literal["auto", "int8", "fp8", "int4", "int2"]  # auto: the model dtype
KV_CACHE_DTYPES: tuple[str, ...] = typing.get_args(KVCacheDtype)
SCALE_BYTES = 2  # one float16 scale per 8-bit row
LOW_BIT_KV_BITS = {"int4": 4, "int2": 2}
LOW_BIT_GROUP = 32  # tokens per key group (the block), channels per value group
# KIVI's residual: a sequence's tokens are read in full precision until the span of this many blocks
# (128 tokens) they belong to is complete, then quantized (attention/low_bit.py)
LOW_BIT_WINDOW_BLOCKS = 4
# attention sinks: a sequence's first tokens, whose keys carry outlier channels and draw much of the
# attention, stay in full precision (and out of their block's ranges)
LOW_BIT_SINK_TOKENS = 4
_PAIR_BYTES = 4  # a float16 scale and a float16 minimum


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")


def is_low_bit(name: str) -> bool:
    """int4 or int2: KIVI's grouped quantization with a full-precision window (attention/kv_format.py)."""
    return name in LOW_BIT_KV_BITS


def check_low_bit_kv(name: str, head_dim: int, block_size: int) -> None:
    """What a 4-bit or 2-bit cache's layout needs: key groups that are blocks, value groups that tile
    the head."""
    if not is_low_bit(name):
        return
    if block_size != LOW_BIT_GROUP:
        raise ValueError(
            f"kv_cache_dtype {name} quantizes keys per channel over blocks of {LOW_BIT_GROUP} tokens: "
            f"block_size must be {LOW_BIT_GROUP}, got {block_size}"
        )
    if head_dim % LOW_BIT_GROUP:
        raise ValueError(
            f"kv_cache_dtype {name} needs a head_dim that is a multiple of {LOW_BIT_GROUP}, got {head_dim}"
        )


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool tensor's dtype: the model's, or bytes for a quantized cache."""
    check_kv_cache_dtype(name)
    return model_dtype if name == "auto" else torch.uint8


def kv_row_size(name: str, head_dim: int) -> int:
    """Elements of the pool's last dimension per (slot, KV head)."""
    check_kv_cache_dtype(name)
    if name == "auto":
        return head_dim
    if is_low_bit(name):
        if head_dim % LOW_BIT_GROUP:
            raise ValueError(
                f"a {name} KV cache needs a head_dim that is a multiple of {LOW_BIT_GROUP}, got {head_dim}"
            )
        return head_dim * LOW_BIT_KV_BITS[name] // 8 + head_dim // LOW_BIT_GROUP * _PAIR_BYTES
    if head_dim % SCALE_BYTES:
        raise ValueError(f"an 8-bit KV cache needs an even head_dim, got {head_dim}")
    return head_dim + SCALE_BYTES


def kv_row_bytes(name: str, head_dim: int, model_dtype: torch.dtype) -> int:
    return kv_row_size(name, head_dim) * kv_storage_dtype(name, model_dtype).itemsize
