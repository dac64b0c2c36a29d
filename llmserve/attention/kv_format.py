"""How K and V rows are stored in the paged pool (`--kv-cache-dtype`): the model dtype, 8, 4 or 2 bits.

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

4-bit and 2-bit caches (int4, int2) follow KIVI (Liu et al., 2024): keys have a few channels of large
magnitude, so they are quantized per channel over a group of tokens, values per token over groups of
channels, both asymmetric (x ~= minimum + code * scale, codes 0..2^bits - 1, the scale and minimum in
float16), and the most recent tokens stay in full precision. Here a key group is a block of
LOW_BIT_GROUP tokens, quantized (keys and values at once) when its last row is written; what a query
reads in full precision instead (its sequence's incomplete span of blocks, and its first tokens, the
attention sinks) is kept outside the pool (worker/recent_kv.py), and attention/low_bit.py says which
positions a query reads from where. Row
layout (bytes): [packed codes, head_dim * bits / 8 | head_dim / 8 bytes of float16 (scale, minimum)
pairs]; a key row's pairs are its block's per-channel pairs for channels [t * head_dim / 32,
(t + 1) * head_dim / 32) (row t of the block), a value row's those of its own groups of 32 channels.
Codes are packed from the low bits up: element d at bit (d * bits) % 8 of byte d * bits / 8.

A key channel's pair is not always its block's full range: a few outlying tokens would coarsen every
code of the channel (at 2 bits, four levels). Each end may move in by 0-3 parts of 2^(bits + 2) of
the range (sixteenths at int2, sixty-fourths at int4), and the pair whose dequantized block has the
least squared error is kept (as llama.cpp's K-quants search their scales). Value groups keep their
full ranges: clipping the outliers of a token's values cost perplexity where it helped keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.config.kv_cache_dtype import (
    LOW_BIT_GROUP,
    LOW_BIT_KV_BITS,
    SCALE_BYTES,
    check_kv_cache_dtype,
    kv_row_size,
    kv_storage_dtype,
)
from llmserve.kernels.cpu_ops import cpu_ops_for

_SCALE_DTYPE = torch.float16  # SCALE_BYTES wide
_MIN_SCALE = torch.finfo(_SCALE_DTYPE).tiny  # the smallest normal float16
_KEY_CLIP_STEPS = 4  # each end of a key channel's range moves in by 0 .. 3 parts (module docstring)


@dataclass(frozen=True)
class KVCacheFormat:
    """The model's own dtype: rows are stored as they are computed."""

    name: str = "auto"
    kernel_code: int = 0  # the compiled kernel's switch: 0 plain, 1 int8, 2 fp8

    @property
    def is_quantized(self) -> bool:
        return False

    @property
    def is_low_bit(self) -> bool:
        """int4 / int2: written and read a block at a time, with a full-precision window."""
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


@dataclass(frozen=True)
class LowBitKVCacheFormat(KVCacheFormat):
    """int4 / int2 (KIVI, module docstring): whole blocks are written at once, from the full-precision
    window and the step's new rows (`RecentKVPlan`); rows are read back a block at a time."""

    bits: int = 4

    @property
    def is_quantized(self) -> bool:
        return True

    @property
    def is_low_bit(self) -> bool:
        return True

    def write(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        raise TypeError(f"a {self.name} KV cache is written a block at a time (write_blocks)")

    def read(self, cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise TypeError(f"a {self.name} KV cache is read a block at a time (read_blocks)")

    def write_blocks(
        self, key_cache, value_cache, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Quantize whole blocks keys/values [n, block, kv_heads, head_dim] into pool blocks `blocks`."""
        if blocks.numel() == 0:
            return
        block = keys.shape[1]
        ops = cpu_ops_for(key_cache)
        if ops is not None and keys.dtype in (torch.float32, torch.bfloat16):  # one call for both, byte-exact
            key_rows, value_rows = ops.quantize_low_bit_blocks(keys, values, self.bits)
        else:
            key_rows, value_rows = self.quantize_key_blocks(keys), self.quantize_values(values)
        _blocks_view(key_cache, block)[blocks] = key_rows
        _blocks_view(value_cache, block)[blocks] = value_rows

    def read_blocks(self, cache: torch.Tensor, blocks: torch.Tensor, block: int, keys: bool) -> torch.Tensor:
        """Pool blocks `blocks` (any shape) as [*blocks.shape, block, kv_heads, head_dim] float32."""
        packed = _blocks_view(cache, block)[blocks]
        return self.dequantize_key_blocks(packed) if keys else self.dequantize_values(packed)

    def quantize_key_blocks(self, keys: torch.Tensor) -> torch.Tensor:
        """[..., block, heads, d] floats -> [..., block, heads, row] bytes: per channel over the block."""
        x = keys.float()
        scale, minimum = self._key_pairs(x)  # [..., heads, d]
        codes = self._codes(x, scale.unsqueeze(-3), minimum.unsqueeze(-3))
        *lead, block, heads, dim = x.shape
        pairs = torch.stack((scale, minimum), dim=-1).view(torch.uint8)  # [..., heads, d, 4]
        # row t of the block carries channels [t * d / block, (t + 1) * d / block)'s pairs
        pairs = pairs.reshape(*lead, heads, block, -1).transpose(-3, -2)
        return torch.cat((self._pack(codes), pairs), dim=-1)

    def dequantize_key_blocks(self, packed: torch.Tensor) -> torch.Tensor:
        *lead, block, heads, _ = packed.shape
        dim = self._head_dim(packed.shape[-1])
        pairs = packed[..., dim * self.bits // 8 :].transpose(-3, -2).contiguous()  # [..., heads, block, d/8]
        pairs = pairs.view(torch.float16).reshape(*lead, heads, dim, 2).float()
        codes = self._unpack(packed[..., : dim * self.bits // 8], dim).float()
        return codes * pairs[..., 0].unsqueeze(-3) + pairs[..., 1].unsqueeze(-3)

    def quantize_values(self, values: torch.Tensor) -> torch.Tensor:
        """[..., d] floats -> [..., row] bytes: per row, in groups of LOW_BIT_GROUP channels."""
        x = values.float()
        grouped = x.reshape(*x.shape[:-1], -1, LOW_BIT_GROUP)
        scale, minimum = self._pairs(grouped.amin(dim=-1), grouped.amax(dim=-1))
        codes = self._codes(grouped, scale.unsqueeze(-1), minimum.unsqueeze(-1)).reshape(x.shape)
        pairs = torch.stack((scale, minimum), dim=-1).view(torch.uint8).reshape(*x.shape[:-1], -1)
        return torch.cat((self._pack(codes), pairs), dim=-1)

    def dequantize_values(self, packed: torch.Tensor) -> torch.Tensor:
        dim = self._head_dim(packed.shape[-1])
        pairs = packed[..., dim * self.bits // 8 :].contiguous().view(torch.float16).float()
        pairs = pairs.reshape(*packed.shape[:-1], dim // LOW_BIT_GROUP, 1, 2)
        codes = self._unpack(packed[..., : dim * self.bits // 8], dim).float()
        grouped = (
            codes.reshape(*codes.shape[:-1], dim // LOW_BIT_GROUP, LOW_BIT_GROUP) * pairs[..., 0]
            + pairs[..., 1]
        )
        return grouped.reshape(codes.shape)

    def _key_pairs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each channel's (scale, minimum) over the block (dim -3): of its range with the low end moved
        in by a and the high end by b parts (module docstring), candidate a * steps + b, the first
        with the least squared error. The errors are summed token by token in float32, every product
        rounded, as quantize_low_bit_blocks sums them, so both keep the same pair."""
        low, high = x.amin(dim=-3), x.amax(dim=-3)
        parts = torch.arange(_KEY_CLIP_STEPS, dtype=torch.float32, device=x.device) / (1 << (self.bits + 2))
        span = (high - low).clamp(max=torch.finfo(torch.float32).max)  # an infinite key: no 0 * inf
        moves = parts.view(-1, *[1] * low.dim()) * span  # [steps, ..., heads, d]
        lows = (low + moves).repeat_interleave(_KEY_CLIP_STEPS, dim=0)
        highs = (high - moves).repeat(_KEY_CLIP_STEPS, *[1] * low.dim())
        scale, minimum = self._pairs(lows, highs)  # [candidates, ..., heads, d]
        step, start = scale.float().unsqueeze(-3), minimum.float().unsqueeze(-3)
        error = self._codes(x, step, start).float() * step + start - x
        error = error * error
        total = error.select(-3, 0)
        for t in range(1, x.shape[-3]):
            total = total + error.select(-3, t)
        best = total.argmin(dim=0, keepdim=True)
        return scale.gather(0, best).squeeze(0), minimum.gather(0, best).squeeze(0)

    def _pairs(self, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, minimum) in float16: the minimum rounded first, the scale then spanning up to the
        maximum from it (at least float16's smallest normal, so a constant group stays exact)."""
        limit = torch.finfo(torch.float16).max
        minimum = low.clamp(-limit, limit).to(torch.float16)
        levels = (1 << self.bits) - 1
        scale = ((high - minimum.float()) / levels).clamp(_MIN_SCALE, limit).to(torch.float16)
        return scale, minimum

    def _codes(self, x: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        levels = (1 << self.bits) - 1
        return ((x - minimum.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        per_byte = 8 // self.bits
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=codes.device)
        grouped = codes.reshape(*codes.shape[:-1], -1, per_byte) << shifts
        return grouped.sum(dim=-1, dtype=torch.uint8)

    def _unpack(self, packed: torch.Tensor, dim: int) -> torch.Tensor:
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.unsqueeze(-1) >> shifts) & ((1 << self.bits) - 1)
        return codes.reshape(*packed.shape[:-1], dim)

    def _head_dim(self, row: int) -> int:
        """head_dim from a row's bytes: d * bits / 8 + d / 8."""
        return row * 8 // (self.bits + 1)


def _blocks_view(cache: torch.Tensor, block: int) -> torch.Tensor:
    """[slots, heads, row] as [blocks, block, heads, row]."""
    return cache.view(-1, block, *cache.shape[1:])


KV_CACHE_FORMATS: dict[str, KVCacheFormat] = {
    fmt.name: fmt
    for fmt in (
        KVCacheFormat(),
        QuantizedKVCacheFormat(name="int8", kernel_code=1, code_dtype=torch.int8, code_max=127.0),
        QuantizedKVCacheFormat(name="fp8", kernel_code=2, code_dtype=torch.float8_e4m3fn, code_max=448.0),
        *(
            LowBitKVCacheFormat(name=name, kernel_code=3 + i, bits=bits)
            for i, (name, bits) in enumerate(LOW_BIT_KV_BITS.items())
        ),
    )
}


def get_kv_cache_format(name: str) -> KVCacheFormat:
    check_kv_cache_dtype(name)
    return KV_CACHE_FORMATS[name]
