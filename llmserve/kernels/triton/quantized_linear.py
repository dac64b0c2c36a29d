"""Quantized linear layers on CUDA: y = x W^T with W held in its codes (quantization/formats.py), each tile
of W rebuilt in registers from its codes, scales and offsets and multiplied there (no float copy of W).

The layouts, made once from a format's one-code-per-byte form by `pack_int4` (the tensors a layer keeps):

    int8:    codes int8 [N, K]; scales [N, K / group]                  w = q * scale
    int4:    nibbles uint8 [N, K / 2], column 2j in byte j's low half, 2j + 1 in its high half;
             scales and offsets [N, K / group]                         w = q * scale + offset
    5 bits:  int4's, plus fifths uint8 [N, K / 8]: bit b of byte j is column 8j + b's fifth bit

so a GGUF's blocks stay at about the file's size (Q4_1: 4 bits a weight plus two float16 a group of 32).
Scales and offsets are float16 where every value is exact in it (a GGUF's d and m), else float32. A tile
rebuilds w in float32 as the format's `dequantize` does (the product, then the offset: no fused
multiply-add), rounds it once to x's dtype and multiplies with float32 accumulators (TF32 off);
`logits` writes those sums unrounded. Where the (row tile, column tile) programs alone would leave
multiprocessors idle (decode), the K range is split and the float32 partial sums are added in a fixed
order after. The wrapper reads no tensor's values on the host (no syncs; CUDA graphs can hold it).
Under TRITON_INTERPRET=1 it runs on CPU tensors (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.triton.elementwise import _round
from llmserve.kernels.triton.paged_attention import multiprocessors

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK_N = 64
_BLOCK_K = {4: 128, 5: 128, 8: 64}  # 64 bytes of a row's codes per step for every layout
_MAX_SPLITS = 16


def pack_int4(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """codes uint8 [N, K] (0..15, or 0..31 at 5 bits; K a multiple of 8) -> (nibbles [N, K / 2], fifths
    [N, K / 8] at 5 bits else None), on codes' device."""
    rows, cols = codes.shape
    nibbles = ((codes[:, 0::2] & 15) | ((codes[:, 1::2] & 15) << 4)).contiguous()
    if bits == 4:
        return nibbles, None
    weights = torch.arange(8, device=codes.device, dtype=torch.int32)
    fifth = ((codes >> 4) & 1).to(torch.int32).view(rows, cols // 8, 8) << weights
    return nibbles, fifth.sum(-1).to(torch.uint8)


def unpack_int4(nibbles: torch.Tensor, fifths: torch.Tensor | None) -> torch.Tensor:
    """pack_int4's inverse: uint8 codes [N, K], one a byte."""
    rows = nibbles.shape[0]
    codes = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).view(rows, -1)
    if fifths is None:
        return codes
    shifts = torch.arange(8, device=fifths.device, dtype=torch.uint8)
    return codes | (((fifths[..., None] >> shifts) & 1) << 4).view(rows, -1)


def quantized_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    fifths: torch.Tensor | None,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group_size: int,
    bits: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] (rows contiguous) -> x W^T [M, N] in `out_dtype` (x's by default), W in the layout above:
    `bits` 8 (codes int8, no offsets), 4 or 5 (nibbles, offsets; fifths at 5)."""
    if x.dtype not in FLOAT_DTYPES or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("quantized_linear takes x [M, K] of float16, bfloat16 or float32, rows contiguous")
    rows, cols = x.shape
    out_features = scales.shape[0]
    if cols % group_size or scales.shape[1] != cols // group_size or group_size % 2:
        raise ValueError(
            f"quantized_linear: scales {tuple(scales.shape)} do not fit K {cols} in groups of {group_size}"
        )
    if not all(t is None or t.is_contiguous() for t in (codes, fifths, scales, offsets)):
        raise ValueError("quantized_linear takes contiguous codes, fifths, scales and offsets")
    if fifths is not None and fifths.shape != (out_features, cols // 8):
        raise ValueError(
            f"quantized_linear: fifths {tuple(fifths.shape)} do not fit [{out_features}, {cols // 8}]"
        )
    if codes.shape != (out_features, cols if bits == 8 else cols // 2):
        raise ValueError(
            f"quantized_linear: codes {tuple(codes.shape)} do not fit [{out_features}, {cols}] at {bits} bits"
        )
    out_dtype = out_dtype or x.dtype
    out = torch.empty((rows, out_features), dtype=out_dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    block_k = _BLOCK_K[bits]
    grid_mn = triton.cdiv(rows, block_m) * triton.cdiv(out_features, _BLOCK_N)
    splits = _splits(grid_mn, triton.cdiv(cols, block_k), x.device)
    k_per_split = triton.cdiv(triton.cdiv(cols, splits), block_k) * block_k
    splits = triton.cdiv(cols, k_per_split)
    target = (
        out
        if splits == 1
        else torch.empty((splits, rows, out_features), dtype=torch.float32, device=x.device)
    )
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, _BLOCK_N), splits)
    _quantized_matmul_kernel[grid](
        x,
        codes,
        scales if fifths is None else fifths,
        scales,
        scales if offsets is None else offsets,
        target,
        rows,
        out_features,
        cols,
        x.stride(0),
        cols // group_size,
        group_size,
        k_per_split,
        BITS=bits,
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=block_k,
        num_stages=2 if x.dtype == torch.float32 else 3,  # float32 tiles: half the shared memory a stage
        enable_fp_fusion=False,  # w = q * scale + offset rounded twice, as the format's dequantize()
    )
    if splits > 1:
        out.copy_(target.sum(0))  # the partial sums in a fixed order, rounded once
    return out


def _splits(programs: int, k_steps: int, device: torch.device) -> int:
    """Parts of K, a power of two, where `programs` alone would leave multiprocessors idle; each part at
    least two steps of the loop."""
    wanted = min(triton.cdiv(2 * multiprocessors(device), programs), k_steps // 2, _MAX_SPLITS)
    return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1


@triton.jit
def _quantized_matmul_kernel(
    x_ptr,
    codes_ptr,
    fifths_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,
    M,
    N,
    K,
    x_row_stride,
    groups,
    group_size,
    k_per_split,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[m, n] = sum over this program's K part of x[m, k] w[n, k]; out is [M, N] in its dtype, or the
    float32 partial sums [splits, M, N] where the grid splits K."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask = rows < M
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    param_rows = cols.to(tl.int64)[None, :] * groups
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if BITS == 8:
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < k_end
            xv = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & col_mask[None, :]
            q = tl.load(codes_ptr + cols.to(tl.int64)[None, :] * K + ks[:, None], mask=w_mask, other=0)
            scale = tl.load(scales_ptr + param_rows + (ks // group_size)[:, None], mask=w_mask, other=0.0)
            w = _round(q.to(tl.float32) * scale.to(tl.float32), x_ptr.dtype.element_ty)
            acc += tl.dot(xv, w, input_precision="ieee")
        else:
            # byte j holds columns 2j (low nibble) and 2j + 1 (high), one group's (group_size is even)
            evens = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            k_mask = evens < k_end
            x_mask = row_mask[:, None] & k_mask[None, :]
            x_even = tl.load(x_rows + evens[None, :], mask=x_mask, other=0.0)
            x_odd = tl.load(x_rows + evens[None, :] + 1, mask=x_mask, other=0.0)
            w_mask = k_mask[:, None] & col_mask[None, :]
            packed = tl.load(
                codes_ptr + cols.to(tl.int64)[None, :] * (K // 2) + (evens // 2)[:, None],
                mask=w_mask,
                other=0,
            )
            low = (packed & 15).to(tl.int32)
            high = (packed >> 4).to(tl.int32)
            if BITS == 5:
                fifth_byte = cols.to(tl.int64)[None, :] * (K // 8) + (evens // 8)[:, None]
                fifth = tl.load(fifths_ptr + fifth_byte, mask=w_mask, other=0).to(tl.int32)
                bit = (evens % 8)[:, None]
                low |= ((fifth >> bit) & 1) << 4
                high |= ((fifth >> (bit + 1)) & 1) << 4
            param = param_rows + (evens // group_size)[:, None]
            scale = tl.load(scales_ptr + param, mask=w_mask, other=0.0).to(tl.float32)
            offset = tl.load(offsets_ptr + param, mask=w_mask, other=0.0).to(tl.float32)
            w_even = _round(low.to(tl.float32) * scale + offset, x_ptr.dtype.element_ty)
            w_odd = _round(high.to(tl.float32) * scale + offset, x_ptr.dtype.element_ty)
            acc += tl.dot(x_even, w_even, input_precision="ieee")
            acc += tl.dot(x_odd, w_odd, input_precision="ieee")
    out_mask = row_mask[:, None] & col_mask[None, :]
    out_offsets = (split * M + rows.to(tl.int64))[:, None] * N + cols[None, :]
    tl.store(out_ptr + out_offsets, _round(acc, out_ptr.dtype.element_ty), mask=out_mask)
