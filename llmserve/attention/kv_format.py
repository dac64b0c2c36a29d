"""How K and V rows are stored in the paged pool (`--kv-cache-dtype`): the model dtype, or 8 bits.

Quantized layout (int8, fp8): the pool is a byte tensor whose last dimension holds, for each
(slot, kv head), the head_dim 8-bit codes followed by that row's float16 scale:

    [ c_0  c_1  ...  c_{d-1} | s s ]        x_i ~= c_i * s,   s = max_i |x_i| / code_max (in float16)

Why per (token, kv head) and not per block: a row is quantized once, when its token is written,
and never again; a per-block scale would grow as tokens arrive and force re-quantizing the block.
Why inside the row and not a parallel tensor: everything that moves blocks (swap space,
copy-on-write copies, the draft model's copies, the early-exit draft's shared pool) moves raw pool
rows, so the scales travel with their codes and none of that code knows about quantization. The
cost is 2 bytes per row: int8 holds 2d / (d + 2) times the tokens of bf16 in the same memory,
1.94x at head_dim 64 and 1.97x at 128.

Why float16 for the scale: its 11-bit significand rounds the scale by at most 2^-11 relative (the
codes are then chosen for the rounded scale, so that is the only cost), 16 times finer than
bfloat16's; its range is ample for a scale (max |x| up to 448 x 65504). Scales are kept at or above
float16's smallest normal (6.1e-5), so a row of near-zeros keeps an absolute error below 3.1e-5
instead of losing precision to subnormals.

int8 rounds to the nearest of 255 levels (max error s / 2 per element); fp8 stores
float8_e4m3fn codes (3 mantissa bits: relative error up to 1/16 per element, but finer near
zero). Both dequantize in attention, to the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.config.kv_cache_dtype import SCALE_BYTES, check_kv_cache_dtype, kv_row_size, kv_storage_dtype
from llmserve.kernels.cpu_ops import cpu_ops_for

_SCALE_DTYPE = torch.float16  # SCALE_BYTES wide
_MIN_SCALE = torch.finfo(_SCALE_DTYPE).tiny  # the smallest normal float16


@dataclass(frozen=True)
class KVCacheFormat:
    """The model's own dtype: rows are stored as they are computed."""

    name: str = "auto"
    kernel_code: int = 0  # the compiled kernel's switch: 0 plain, 1 int8, 2 fp8

    @property
    def is_quantized(self) -> bool:
        return False

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return kv_storage_dtype(self.name, model_dtype)

    def row_size(self, head_dim: int) -> int:
        """Elements of the pool's last dimension per (slot, kv head)."""
        return kv_row_size(self.name, head_dim)

    def bytes_per_row(self, head_dim: int, model_dtype: torch.dtype) -> int:
        return self.row_size(head_dim) * self.storage_dtype(model_dtype).itemsize

    def write(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows [n, kv_heads, head_dim] at the given slots of cache [slots, kv_heads, row]."""
        ops = cpu_ops_for(cache)
        if (
            ops is not None
            and cache.is_contiguous()
            and rows.dtype == cache.dtype
            and slots.dtype == torch.int64
            and rows.stride(-1) == 1
            and rows.stride(-2) == rows.shape[-1]
        ):
            ops.write_kv_rows(cache, slots, rows)  # a memcpy per token instead of an indexed copy
        else:
            cache.index_copy_(0, slots, rows)

    def read(self, cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows at `slots` (any shape) as [*slots.shape, kv_heads, head_dim] in `dtype`."""
        return cache[slots].to(dtype)


@dataclass(frozen=True)
class QuantizedKVCacheFormat(KVCacheFormat):
    """8-bit codes plus a float16 scale per (token, kv head), packed in one byte row."""

    code_dtype: torch.dtype = torch.int8
    code_max: float = 127.0

    @property
    def is_quantized(self) -> bool:
        return True

    def write(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        cache.index_copy_(0, slots, self.quantize(rows))

    def read(self, cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize(cache[slots], dtype)

    def quantize(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] floats -> [..., head_dim + 2] bytes (codes, then the scale's bytes)."""
        rows = rows.float()
        scale = (rows.abs().amax(dim=-1, keepdim=True) / self.code_max).clamp_min(_MIN_SCALE)
        scale = scale.to(_SCALE_DTYPE)  # the stored scale; codes are rounded against it
        scaled = (rows / scale.float()).clamp(-self.code_max, self.code_max)
        if self.code_dtype == torch.int8:  # float8 rounds to nearest in the cast itself
            scaled = scaled.round()
        codes = scaled.to(self.code_dtype)
        return torch.cat((codes.view(torch.uint8), scale.view(torch.uint8)), dim=-1)

    def dequantize(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., head_dim + 2] bytes -> [..., head_dim] in `dtype`."""
        packed = packed.contiguous()
        head_dim = packed.shape[-1] - SCALE_BYTES
        codes = packed[..., :head_dim].view(self.code_dtype).float()
        scale = packed[..., head_dim:].view(_SCALE_DTYPE).float()
        return (codes * scale).to(dtype)


KV_CACHE_FORMATS: dict[str, KVCacheFormat] = {
    fmt.name: fmt
    for fmt in (
        KVCacheFormat(),
        QuantizedKVCacheFormat(name="int8", kernel_code=1, code_dtype=torch.int8, code_max=127.0),
        QuantizedKVCacheFormat(name="fp8", kernel_code=2, code_dtype=torch.float8_e4m3fn, code_max=448.0),
    )
}


def get_kv_cache_format(name: str) -> KVCacheFormat:
    check_kv_cache_dtype(name)
    return KV_CACHE_FORMATS[name]
