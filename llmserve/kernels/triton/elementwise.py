"""Triton kernels for the per-layer elementwise work on CUDA: RMSNorm (with the residual add), rotary
embedding in place, and the gated MLP activations (SiLU and GELU-tanh times up).

Each replaces a layer's PyTorch formulation (several launches with float32 temporaries between them)
by one launch that reads its rows once. Each computes in float32 and rounds where that formulation
rounds, op for op: on a GPU rotary and the activations agree with it bit for bit, and a norm differs
only where its sum of squares, added in another order, moves a rounding by a unit in the last place. The
wrappers check shapes on the host and never read a tensor's values there: no host syncs, so the
launches can be captured in CUDA graphs. Under TRITON_INTERPRET=1 they run on CPU tensors (the tests).
The function names and arguments are those of the compiled CPU kernels', so a layer calls either
through `self.ops`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A norm's row lives in one program's registers: beyond this it would spill (the layer falls back).
_MAX_NORM_ROW_BYTES = 64 * 1024
_ACTIVATION_BLOCK = 1024
# The interpreter has no libdevice; it computes exp and tanh with numpy instead.
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))
# Op for op like torch's kernels: a fused multiply-add would round differently from their products.
_LAUNCH_OPTIONS = {"enable_fp_fusion": False}


def takes_rows(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: 2-D rows of a float dtype, each row contiguous (a row
    stride of their own: slices of a fused projection are taken as they are)."""
    return all(t.dim() == 2 and t.stride(-1) == 1 and t.dtype in FLOAT_DTYPES for t in tensors)


def norm_takes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether rms_norm / add_rms_norm take these (a row must fit one program)."""
    rows = (x,) if residual is None else (x, residual)
    return (
        takes_rows(*rows)
        and (residual is None or residual.shape == x.shape)
        and weight.dtype in FLOAT_DTYPES
        and weight.shape == x.shape[-1:]
        and weight.is_contiguous()
        and x.shape[-1] * x.element_size() <= _MAX_NORM_ROW_BYTES
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [rows, hidden], as RMSNorm.reference computes it."""
    return _launch_norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += residual in place (rounded to x's dtype), then RMSNorm of the sum."""
    return _launch_norm(x, residual, weight, eps)


def _launch_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(rows,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        hidden,
        1.0 / hidden,  # torch's mean multiplies the sum by the reciprocal of the count
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
        **_LAUNCH_OPTIONS,
    )
    return out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
) -> None:
    """Rotate query [tokens, heads * head_dim] and key [tokens, kv_heads * head_dim] in place, rotate-half
    layout, on each head's first 2 * cos.shape[1] dimensions (the rest of a head passes through):
    token t by row positions[t] of the float32 tables cos and sin [max_positions, rotary_dim / 2].
    Positions are not checked against the tables (that would read them on the host)."""
    tokens = query.shape[0]
    if tokens == 0:
        return
    half = cos.shape[1]
    query_heads, key_heads = query.shape[1] // head_dim, key.shape[1] // head_dim
    _rotary_kernel[(tokens,)](
        positions,
        query,
        key,
        cos,
        sin,
        query.stride(0),
        key.stride(0),
        cos.stride(0),
        query_heads,
        key_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QUERY_HEADS=triton.next_power_of_2(query_heads),
        BLOCK_KEY_HEADS=triton.next_power_of_2(key_heads),
        **_LAUNCH_OPTIONS,
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [rows, 2 * width] = [gate | up]: [rows, width]."""
    return _launch_gated(gate_up, "silu")


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up of gate_up [rows, 2 * width] = [gate | up]: [rows, width]."""
    return _launch_gated(gate_up, "gelu_tanh")


def _launch_gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or width == 0:
        return out
    block = min(triton.next_power_of_2(width), _ACTIVATION_BLOCK)
    # Rows by blocks of a row: a decode step's few rows still spread over many programs.
    _gated_kernel[(rows, triton.cdiv(width, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        width,
        ACTIVATION=activation,
        BLOCK=block,
        **_LAUNCH_OPTIONS,
    )
    return out


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype` (to nearest, ties to even). bfloat16 by hand: the same bits as the
    hardware's conversion, where the interpreter's own conversion truncates."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        # A NaN's low payload bits would carry into the exponent: keep it a quiet NaN.
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    hidden,
    inv_hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x_ptrs = x_ptr + row * x_row_stride + cols
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        summed = _round(x + residual.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(x_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) * inv_hidden
    # The reference rounds the normalized row to x's dtype before it multiplies by the weight.
    normed = _round(x * tl.rsqrt(mean_square + eps), x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _round(weight * normed, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    cos_ptr,
    sin_ptr,
    query_row_stride,
    key_row_stride,
    table_row_stride,
    query_heads,
    key_heads,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QUERY_HEADS: tl.constexpr,
    BLOCK_KEY_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + position * table_row_stride + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + position * table_row_stride + dims, mask=dims < HALF, other=0.0)
    query_row, key_row = query_ptr + token * query_row_stride, key_ptr + token * key_row_stride
    _rotate_heads(query_row, query_heads, cos, sin, HEAD_DIM, HALF, BLOCK_HALF, BLOCK_QUERY_HEADS)
    _rotate_heads(key_row, key_heads, cos, sin, HEAD_DIM, HALF, BLOCK_HALF, BLOCK_KEY_HEADS)


@triton.jit
def _rotate_heads(
    row_ptr,
    heads,
    cos,
    sin,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    """One token's heads [heads, HEAD_DIM] rotated in place: (first, second) halves of the rotated
    dimensions become (first * cos - second * sin, second * cos + first * sin)."""
    head = tl.arange(0, BLOCK_HEADS)[:, None]
    dim = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (head < heads) & (dim < HALF)
    first_ptrs = row_ptr + head * HEAD_DIM + dim
    first = tl.load(first_ptrs, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(first_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]
    dtype: tl.constexpr = row_ptr.dtype.element_ty
    tl.store(first_ptrs, _round(first * cos - second * sin, dtype), mask=mask)
    tl.store(first_ptrs + HALF, _round(second * cos + first * sin, dtype), mask=mask)


@triton.jit
def _gated_kernel(
    gate_up_ptr, out_ptr, row_stride, out_row_stride, width, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate_ptrs = gate_up_ptr + row * row_stride + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + width, mask=mask, other=0.0).to(tl.float32)
    dtype: tl.constexpr = gate_up_ptr.dtype.element_ty
    activated = _silu(gate) if ACTIVATION == "silu" else _gelu_tanh(gate)
    # The reference rounds the activation to the dtype before it multiplies by up.
    out = _round(_round(activated, dtype).to(tl.float32) * up, dtype)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=mask)


@triton.jit
def _silu(x):
    """x / (1 + exp(-x)), torch's formula (an IEEE division, as nvcc compiles torch's)."""
    return tl.div_rn(x, 1.0 + _exp(-x))


@triton.jit
def _gelu_tanh(x):
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as torch's CUDA kernel evaluates it (nvcc
    contracts its x + kappa * x^3 into a fused multiply-add)."""
    cube = x * x * x
    inner = 0.7978845608028654 * tl.fma(0.044715, cube, x)
    return 0.5 * x * (1.0 + _tanh(inner))


@triton.jit
def _exp(x):
    """libdevice's expf on a GPU: the function torch's CUDA kernels call."""
    if _INTERPRETED:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _tanh(x):
    """libdevice's tanhf on a GPU: the function torch's CUDA kernels call."""
    if _INTERPRETED:
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0
    else:
        return libdevice.tanh(x)
