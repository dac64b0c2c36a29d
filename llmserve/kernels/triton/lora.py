"""The LoRA deltas of a step's rows on CUDA, every adapter in one pair of launches (Punica's BGMV): for each
row t whose slot s = token_slots[t] is not negative, out[t] += (A[s] x[t]) Bt[s], shrink then expand.

The arguments are those of the compiled CPU kernel (kernels/csrc/lora.cpp), laid out by lora/weights.py:
A [slots, W, in] and Bt [slots, W, out], a slot's adapter of rank r in its first shards * r columns,
shard p's rank columns feeding only shard p's output rows (Bt's other blocks are never read), widths
[slots] the columns each slot uses (0: no adapter for this layer), shard_starts the shards' first output
rows and out_features. One program per (row, block of columns) or (row, block of outputs): a row's sums
are the same whatever else the step holds (batch invariant), in float32, the delta rounded once as it
joins the output row. The wrapper reads no tensor's values on the host (no syncs). Under
TRITON_INTERPRET=1 it runs on CPU tensors (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.triton.elementwise import _round

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SHRINK_COLUMNS = 32  # columns of A per shrink program
_SHRINK_INPUTS = 128  # inputs per step of its loop
_EXPAND_ELEMENTS = 4096  # (rank x outputs) products per expand program


def takes(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> bool:
    """Whether lora_delta takes these: one float dtype, rows contiguous, the stacks contiguous."""
    return (
        x.dtype in FLOAT_DTYPES
        and out.dtype == a.dtype == bt.dtype == x.dtype
        and x.dim() == out.dim() == 2
        and x.stride(1) == 1
        and out.stride(1) == 1
        and a.is_contiguous()
        and bt.is_contiguous()
    )


def lora_delta(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    token_slots: torch.Tensor,
    widths: torch.Tensor,
    shard_starts: torch.Tensor,
) -> None:
    """out [T, out_features] += each row's delta in place; x [T, in]; token_slots [T] and widths [slots]
    int64, shard_starts [shards + 1] int64, all on x's device. Shapes are checked; values (a slot in
    range, a width a multiple of the shards) are not: that would read them on the host."""
    rows = x.shape[0]
    if not takes(x, out, a, bt) or a.shape[2] != x.shape[1] or bt.shape[2] != out.shape[1]:
        raise ValueError("lora_delta takes x [T, in], out [T, out] and contiguous stacks of one float dtype")
    if out.shape[0] != rows or token_slots.shape != (rows,) or a.shape[:2] != bt.shape[:2]:
        raise ValueError("lora_delta takes one slot per row and stacks A, Bt of one [slots, width]")
    if widths.shape != (a.shape[0],) or shard_starts.dim() != 1 or shard_starts.numel() < 2:
        raise ValueError("lora_delta takes a width per slot and the shards' starts and end")
    if rows == 0:
        return
    width, in_features, out_features = a.shape[1], a.shape[2], bt.shape[2]
    shards = shard_starts.numel() - 1
    hidden = torch.empty((rows, width), dtype=torch.float32, device=x.device)
    block_w = min(triton.next_power_of_2(width), _SHRINK_COLUMNS)
    _shrink_kernel[(rows, triton.cdiv(width, block_w))](
        x,
        a,
        hidden,
        token_slots,
        widths,
        x.stride(0),
        in_features,
        width,
        BLOCK_W=block_w,
        BLOCK_K=min(triton.next_power_of_2(in_features), _SHRINK_INPUTS),
    )
    block_r = triton.next_power_of_2(max(width // shards, 1))  # the largest rank a slot can have
    block_n = max(16, min(triton.next_power_of_2(out_features), _EXPAND_ELEMENTS // block_r))
    _expand_kernel[(rows, triton.cdiv(out_features, block_n))](
        hidden,
        bt,
        out,
        token_slots,
        widths,
        shard_starts,
        out.stride(0),
        out_features,
        width,
        SHARDS=shards,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
    )


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    hidden_ptr,
    slots_ptr,
    widths_ptr,
    x_row_stride,
    in_features,
    width,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """hidden[row, c] = A[slot][c] . x[row] for this program's columns c (0 past the slot's width)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    has_slot = slot >= 0
    slot = tl.maximum(slot, 0)
    used = tl.load(widths_ptr + slot)
    columns = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    column_mask = (columns < used) & has_slot
    a_rows = a_ptr + (slot * width + columns[:, None]) * in_features
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for start in range(0, in_features, BLOCK_K):
        inputs = start + tl.arange(0, BLOCK_K)
        input_mask = inputs < in_features
        xv = tl.load(x_ptr + row * x_row_stride + inputs, mask=input_mask & has_slot, other=0.0)
        av = tl.load(a_rows + inputs[None, :], mask=column_mask[:, None] & input_mask[None, :], other=0.0)
        acc += tl.sum(av.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    tl.store(hidden_ptr + row * width + columns, acc, mask=columns < width)


@triton.jit
def _expand_kernel(
    hidden_ptr,
    bt_ptr,
    out_ptr,
    slots_ptr,
    widths_ptr,
    starts_ptr,
    out_row_stride,
    out_features,
    width,
    SHARDS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[row, j] += sum over c < rank of hidden[row, p r + c] Bt[slot][p r + c][j], p the shard of
    output j (only Bt's blocks read), for this program's outputs j."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    has_slot = slot >= 0
    slot = tl.maximum(slot, 0)
    rank = tl.load(widths_ptr + slot) // SHARDS
    outputs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    output_mask = (outputs < out_features) & has_slot & (rank > 0)
    shard = tl.zeros([BLOCK_N], dtype=tl.int64)
    for p in tl.static_range(1, SHARDS):
        shard += (outputs >= tl.load(starts_ptr + p)).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    columns = shard[None, :] * rank + ranks[:, None]  # [BLOCK_R, BLOCK_N]
    mask = (ranks < rank)[:, None] & output_mask[None, :]
    h = tl.load(hidden_ptr + row * width + columns, mask=mask, other=0.0)
    b = tl.load(bt_ptr + (slot * width + columns) * out_features + outputs[None, :], mask=mask, other=0.0)
    delta = tl.sum(h * b.to(tl.float32), axis=0)
    out_ptrs = out_ptr + row * out_row_stride + outputs
    current = tl.load(out_ptrs, mask=output_mask, other=0.0)
    tl.store(out_ptrs, _round(current.to(tl.float32) + delta, out_ptr.dtype.element_ty), mask=output_mask)
