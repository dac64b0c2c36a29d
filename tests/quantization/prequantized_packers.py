"""Packers of pre-quantized checkpoint formats, written from each format's specification (AutoGPTQ's
and AutoAWQ's layouts; compressed-tensors' own `pack_to_int32`), for tests: each returns a linear
layer's tensors as the format stores them and the float weight they stand for.

Quantization here is plain round-to-nearest in float64 (the formats say how codes are stored, not how
they were chosen); scales are rounded to the stored dtype before the codes are computed.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8
Packed = tuple[dict[str, torch.Tensor], torch.Tensor]


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 unsigned bits, as int32 (the bit pattern kept)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> int32 [R / (32/bits), C]: rows j, j + per, ... in bits j*bits of each word."""
    per = 32 // bits
    words = torch.zeros(codes.shape[0] // per, codes.shape[1], dtype=torch.int64)
    for j in range(per):
        words |= codes[j::per].long() << (bits * j)
    return to_int32(words)


def pack_columns(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] codes -> int32 [R, C / (32/bits)]: nibble i of word c holds column c*per + order[i]."""
    per = 32 // bits
    order = order or tuple(range(per))
    words = torch.zeros(codes.shape[0], codes.shape[1] // per, dtype=torch.int64)
    for i, column in enumerate(order):
        words |= codes[:, column::per].long() << (bits * i)
    return to_int32(words)


def gptq(
    weight: torch.Tensor,
    bits: int = 4,
    group: int = 32,
    sym: bool = True,
    desc_act: bool = False,
    v2: bool = False,
    seed: int = 0,
) -> Packed:
    """GPTQ: qweight along input rows, qzeros along output columns (v1: zero - 1), scales float16
    [groups, out], g_idx [in]; desc_act scatters each group's rows over the input."""
    w = weight.t().double()  # [in, out], GPTQ's orientation
    rows, cols = w.shape
    maxq = 2**bits - 1
    g_idx = torch.arange(rows) // group
    if desc_act:
        g_idx = g_idx[torch.randperm(rows, generator=torch.Generator().manual_seed(seed))]
    groups = rows // group
    scales = torch.empty(groups, cols, dtype=torch.float64)
    zeros = torch.empty(groups, cols, dtype=torch.int64)
    for g in range(groups):
        part = w[g_idx == g]
        if sym:
            scale = 2 * part.abs().amax(0) / maxq
            zero = torch.full((cols,), (maxq + 1) // 2)
        else:
            low, high = part.amin(0).clamp(max=0), part.amax(0).clamp(min=0)
            scale = (high - low) / maxq
            zero = torch.round(-low / scale.half().double()).long()
        scales[g] = scale.half().double()
        zeros[g] = zero
    assert v2 or bool((zeros > 0).all())  # v1 cannot store a zero point of 0
    s, z = scales[g_idx], zeros[g_idx]
    codes = torch.clamp(torch.round(w / s) + z, 0, maxq).long()
    stored_zeros = (zeros - (0 if v2 else 1)) & maxq
    tensors = {
        "qweight": pack_rows(codes, bits),
        "qzeros": pack_columns(stored_zeros, bits),
        "scales": scales.half(),
        "g_idx": g_idx.int(),
    }
    return tensors, ((codes - z) * s).t().float()


def awq(weight: torch.Tensor, group: int = 32) -> Packed:
    """AutoAWQ GEMM: qweight [in, out/8] and qzeros [groups, out/8] in AWQ's column order, scales
    float16 [groups, out]; asymmetric."""
    w = weight.t().double()
    rows, cols = w.shape
    grouped = w.view(rows // group, group, cols)
    low, high = grouped.amin(1), grouped.amax(1)
    scales = ((high - low) / 15).clamp(min=1e-5).half().double()
    zeros = torch.round(-low / scales).clamp(0, 15)
    codes = torch.clamp(torch.round(grouped / scales[:, None]) + zeros[:, None], 0, 15)
    dequantized = ((codes - zeros[:, None]) * scales[:, None]).view(rows, cols).t().float()
    tensors = {
        "qweight": pack_columns(codes.view(rows, cols).long(), 4, AWQ_ORDER),
        "qzeros": pack_columns(zeros.long(), 4, AWQ_ORDER),
        "scales": scales.half(),
    }
    return tensors, dequantized


def ct_int4(
    weight: torch.Tensor, group: int = 32, symmetric: bool = True, actorder_seed: int | None = None
) -> Packed:
    """compressed-tensors pack-quantized (w4a16), packed by compressed-tensors' own pack_to_int32;
    `actorder_seed`: actorder "group", each group's columns scattered over the input by a shuffled
    weight_g_idx [in] (column k uses scale[:, g_idx[k]]; the columns stay in their own order)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    w = weight.double()
    rows, cols = w.shape
    g_idx = torch.arange(cols) // group
    if actorder_seed is not None:
        g_idx = g_idx[torch.randperm(cols, generator=torch.Generator().manual_seed(actorder_seed))]
    scale = torch.empty(rows, cols // group, dtype=torch.float64)
    zero = torch.zeros_like(scale)
    for g in range(cols // group):
        part = w[:, g_idx == g]
        if symmetric:
            scale[:, g] = (part.abs().amax(-1) / 7).half().double()
        else:
            low, high = part.amin(-1).clamp(max=0), part.amax(-1).clamp(min=0)
            scale[:, g] = ((high - low) / 15).half().double()
            zero[:, g] = (torch.round(-low / scale[:, g]) - 8).clamp(-8, 7)
    s, z = scale[:, g_idx], zero[:, g_idx]
    codes = torch.clamp(torch.round(w / s) + z, -8, 7)
    tensors = {
        "weight_packed": pack_to_int32(codes.to(torch.int8), 4),
        "weight_scale": scale.half(),
        "weight_shape": torch.tensor([rows, cols]),
    }
    if not symmetric:
        tensors["weight_zero_point"] = pack_to_int32(zero.to(torch.int8), 4, packed_dim=0)
    if actorder_seed is not None:
        tensors["weight_g_idx"] = g_idx.int()
    return tensors, ((codes - z) * s).float()


def ct_int8(weight: torch.Tensor, per_tensor: bool = False) -> Packed:
    """compressed-tensors int-quantized (w8a8): int8 weight, symmetric, per channel or per tensor."""
    w = weight.double()
    largest = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
    scale = (largest / 127).float().double()
    codes = torch.clamp(torch.round(w / scale), -128, 127)
    stored_scale = scale.float().reshape(1) if per_tensor else scale.float()
    return {"weight": codes.to(torch.int8), "weight_scale": stored_scale}, (codes * scale).float()


def fp8(weight: torch.Tensor, per_channel: bool = False) -> Packed:
    """FP8 e4m3 with weight_scale (compressed-tensors float-quantized)."""
    w = weight.float()
    largest = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = largest / torch.finfo(torch.float8_e4m3fn).max
    codes = (w / (scale if per_channel else scale[0])).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}, codes.float() * (scale if per_channel else scale[0])


def fp8_blocks(weight: torch.Tensor, block: int = 32) -> Packed:
    """FP8 e4m3 with one weight_scale_inv per block x block tile (DeepSeek's and Qwen's FP8)."""
    w = weight.float()
    rows, cols = w.shape
    tiles = w.view(rows // block, block, cols // block, block)
    scale = tiles.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
    codes = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    dequantized = (codes.float() * scale[:, None, :, None]).view(rows, cols)
    return {"weight": codes.view(rows, cols), "weight_scale_inv": scale}, dequantized
