"""The engine's quantized weight formats and round-to-nearest (RTN) quantizers.

A format is the canonical, kernel-independent form of one linear layer's weight [out, in]: what
`llmserve quantize` saves, what GGUF blocks are read into, and what kernels pack from. Groups run
along the input dimension, so fusing layers (q/k/v, gate/up) is a concatenation of rows.

    Int8Weight:  w[n, k] = q[n, k] * scale[n, k // group]               q in -128..127 (symmetric)
    Int4Weight:  w[n, k] = q[n, k] * scale[n, k // group] + offset[...]  q in 0..15 (asymmetric)
                 bits 5: q in 0..31 (GGUF Q5_0: scale d, offset -16 d), packed as 4 + 1 bits

The int4 offset is a float (llama.cpp's Q4_1 `m`, tinygemm's zero point) rather than an integer zero
point: it represents Q4_0, Q4_1 and RTN's exact group minimum without a second rounding.
Scales and offsets are float32, which holds GGUF's float16 `d` and `m` exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

INT8_MAX = 127
INT4_LEVELS = 15
_TINY = 1e-10  # the scale of an all-equal group: any positive value reproduces it exactly


@dataclass
class Int8Weight:
    qweight: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out, in // group_size]
    group_size: int  # == in_features: one scale per output channel

    kind = "int8"
    bits = 8

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.qweight.shape
        codes = self.qweight.to(dtype).view(rows, cols // self.group_size, self.group_size)  # 0 rows too
        grouped = codes * self.scales.to(dtype)[..., None]
        return grouped.view(rows, cols)

    def rows(self, index: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.qweight[index], self.scales[index], self.group_size)


@dataclass
class Int4Weight:
    qweight: torch.Tensor  # uint8 [out, in], one code 0..15 per byte (packing is the kernel's job)
    scales: torch.Tensor  # float32 [out, in // group_size]
    offsets: torch.Tensor  # float32 [out, in // group_size]
    group_size: int
    bits: int = 4  # 5: codes 0..31 (GGUF Q5_0), which the int4 kernels take with a plane of fifth bits

    kind = "int4"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.qweight.shape
        codes = self.qweight.to(dtype).view(rows, cols // self.group_size, self.group_size)  # 0 rows too
        return (codes * self.scales.to(dtype)[..., None] + self.offsets.to(dtype)[..., None]).view(rows, cols)

    def rows(self, index: torch.Tensor) -> Int4Weight:
        parts = (self.qweight[index], self.scales[index], self.offsets[index])
        return Int4Weight(*parts, self.group_size, self.bits)

    def as_int8(self) -> Int8Weight | None:
        """The same weights as int8 codes q - c with the same scales, where every offset is -c times its
        scale for one integer c (GGUF Q5_0's -16 d): exact, since q * s - c * s = (q - c) * s; else None."""
        center = 1 << (self.bits - 1)
        if not torch.equal(self.offsets, -center * self.scales):
            return None
        codes = (self.qweight.to(torch.int16) - center).to(torch.int8)
        return Int8Weight(codes, self.scales, self.group_size)


QuantizedWeight = Int8Weight | Int4Weight


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Fuse shards (q/k/v, gate/up) into one weight; None if their formats differ. 5-bit shards beside
    int8 ones (a GGUF's Q5_0 q/k beside a Q8_0 v) join as the int8 codes they equal."""
    if any(isinstance(w, Int8Weight) for w in weights):
        weights = [w.as_int8() or w if isinstance(w, Int4Weight) and w.bits == 5 else w for w in weights]
    first = weights[0]
    if any(_layout(w) != _layout(first) for w in weights):
        return None
    if isinstance(first, Int8Weight):
        return Int8Weight(
            torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]), first.group_size
        )
    return Int4Weight(
        torch.cat([w.qweight for w in weights]),
        torch.cat([w.scales for w in weights]),
        torch.cat([w.offsets for w in weights]),
        first.group_size,
        first.bits,
    )


@dataclass
class StackedRows:
    """A fused layer (q/k/v, gate/up) whose shards' formats do not join: a Q4_K_M file's Q4_K q and k
    beside a Q6_K v. Its parts stack along the output rows, each in its own format (runs of shards that
    do join are one part), so every shard keeps its file's codes."""

    parts: list[QuantizedWeight]

    kind = "stacked"

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([part.dequantize(dtype) for part in self.parts])

    def rows(self, index: torch.Tensor) -> StackedRows:
        """Rows `index` (ascending: a tensor-parallel rank's heads of each shard), each part keeping
        those of its own rows it holds (a part with none of them drops out)."""
        if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
            raise ValueError("StackedRows.rows takes ascending rows")
        parts, start = [], 0
        for part in self.parts:
            stop = start + part.shape[0]
            mine = index[(index >= start) & (index < stop)] - start
            if mine.numel():
                parts.append(part.rows(mine))
            start = stop
        return StackedRows(parts)


@dataclass
class DeferredWeight:
    """A weight built when its layer is (`materialize`): a GGUF's shards, fused only then, so that a
    model's fused copies never all exist at once. Its shape is known before its data."""

    shape: tuple[int, int]
    build: Callable[[], QuantizedWeight | StackedRows]


def materialize(weight):
    """The weight itself: a DeferredWeight built, anything else as it is."""
    return weight.build() if isinstance(weight, DeferredWeight) else weight


def stack_rows(weights: list[QuantizedWeight]) -> QuantizedWeight | StackedRows:
    """Fuse shards into one weight: `concat_rows` where their formats join, else a StackedRows of the
    runs of neighbouring shards that do."""
    fused = concat_rows(weights)
    if fused is not None:
        return fused
    runs: list[list[QuantizedWeight]] = [[weights[0]]]
    for weight in weights[1:]:
        if concat_rows([*runs[-1], weight]) is not None:
            runs[-1].append(weight)
        else:
            runs.append([weight])
    return StackedRows([concat_rows(run) for run in runs])


def _layout(weight: QuantizedWeight) -> tuple:
    """What shards must share to be fused: format, group size and code width."""
    return type(weight), weight.group_size, weight.bits


def shard_rows(
    weight: QuantizedWeight | StackedRows, index: torch.Tensor, rows: int
) -> QuantizedWeight | StackedRows:
    """The output rows `index` of `weight`, then zero rows up to `rows` (codes, scales and offsets
    all zero: they dequantize to the zero padding of a float shard's last vocabulary block)."""
    if isinstance(weight, StackedRows):  # a fused column-parallel layer's heads: never padded
        if index.numel() != rows:
            raise ValueError("a stacked layer's rank rows are not padded")
        return weight.rows(index)
    return dataclasses.replace(weight, **{name: _pad(t[index], rows) for name, t in _tensors(weight)})


def shard_columns(weight: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Input columns start..stop of `weight` (a row-parallel shard), where `column_groups` allows."""
    groups, group = column_groups(weight, start, stop)
    parts = {name: t[:, start:stop] if name == "qweight" else t[:, groups] for name, t in _tensors(weight)}
    return dataclasses.replace(weight, **{k: v.contiguous() for k, v in parts.items()}, group_size=group)


def column_groups(weight: QuantizedWeight, start: int, stop: int) -> tuple[slice, int]:
    """(the scale columns, the group size) of input columns start..stop of `weight`. A group must
    not straddle a cut: both ends fall on group boundaries, unless the weight has one group per row
    (per channel), whose scale holds for any part of its row."""
    group = weight.group_size
    if group == weight.shape[1]:
        return slice(None), stop - start
    if start % group or stop % group:
        raise ValueError(f"input columns {start}..{stop} cut its groups of {group} columns")
    return slice(start // group, stop // group), group


def _tensors(weight: QuantizedWeight) -> list[tuple[str, torch.Tensor]]:
    """The format's tensors, each [out, ...]: qweight, scales (and offsets)."""
    values = ((f.name, getattr(weight, f.name)) for f in dataclasses.fields(weight))
    return [(name, value) for name, value in values if isinstance(value, torch.Tensor)]


def _pad(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] >= rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric RTN; `group_size` None: one scale per output channel."""
    rows, cols = weight.shape
    group_size = group_size or cols
    grouped = weight.float().view(rows, -1, group_size)
    scales = int8_scales(grouped)
    codes = torch.round(grouped / scales[..., None]).clamp(-INT8_MAX, INT8_MAX)
    return Int8Weight(codes.to(torch.int8).view(rows, cols), scales, group_size)


def int8_scales(grouped: torch.Tensor) -> torch.Tensor:
    """Symmetric scale of each group [..., group_size]: its largest magnitude maps to 127."""
    return (grouped.abs().amax(-1) / INT8_MAX).clamp_min(_TINY)


def int4_params(grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and offset of each group [..., group_size] spanning its min..max in 16 levels."""
    low, high = grouped.amin(-1), grouped.amax(-1)
    return ((high - low) / INT4_LEVELS).clamp_min(_TINY), low


def int4_codes(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Nearest codes (as floats) of `values` given broadcastable scales and offsets."""
    return torch.round((values - offsets) / scales).clamp(0, INT4_LEVELS)


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Asymmetric group-wise RTN: each group's min and max are representable exactly."""
    rows, cols = weight.shape
    grouped = weight.float().view(rows, -1, group_size)
    scales, offsets = int4_params(grouped)
    codes = int4_codes(grouped, scales[..., None], offsets[..., None])
    return Int4Weight(codes.to(torch.uint8).view(rows, cols), scales, offsets, group_size)


def fake_quantize_int4(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """RTN int4 and back to float32 (the searches in AWQ compare candidates this way)."""
    return quantize_int4(weight, group_size).dequantize()
