"""`--quantization gguf`: a GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K and Q6_K blocks read
straight into the engine's formats.

No detour through float and no second rounding: a block's float16 `d` (and `m`) become float32
scales (and offsets) exactly, its codes become our codes. llama.cpp's blocks hold 32 weights:

    Q4_0: d, 16 bytes of nibbles    w = d * (q - 8)    -> Int4Weight(scale d, offset -8d)
    Q4_1: d, m, 16 bytes of nibbles w = d * q + m      -> Int4Weight(scale d, offset m)
    Q5_0: d, 32 high bits, 16 bytes of nibbles
                                    w = d * (q - 16)   -> Int4Weight(bits 5, scale d, offset -16d), codes q
    Q5_1: d, m, 32 high bits, 16 bytes of nibbles
                                    w = d * q + m      -> Int4Weight(bits 5, scale d, offset m)
    Q8_0: d, 32 int8                w = d * q          -> Int8Weight(group 32, scale d)

The nibbles of a block are elements 0..15 in the low halves of its 16 bytes and 16..31 in the high
halves. Q4_K's super-blocks hold 256 weights as eight sub-blocks of 32 (its own scale and minimum
each, 6-bit codes under two float16 factors):

    Q4_K: d, dmin, 12 bytes of 6-bit (sc, m) x 8, 128 bytes of nibbles
          w = (d * sc) * q - dmin * m  -> Int4Weight(scale d * sc, offset -dmin * m), groups of 32
    Q5_K: as Q4_K, with 32 bytes of fifth bits before the nibbles: q in 0..31 -> Int4Weight(bits 5)

d * sc and dmin * m are exact in float32 (11 by 6 significant bits), so the weights equal the
reference dequantization bit for bit. Q6_K's hold 256 weights as sixteen sub-blocks of 16 under one
float16 factor:

    Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales sc, d
          w = (d * sc) * (q - 32)      -> Int8Weight(scale d * sc, codes q - 32), groups of 16

Q3_K's hold 256 weights as sixteen sub-blocks of 16 under 6-bit signed scales and one float16 factor:

    Q3_K: 32 bytes of high bits, 64 bytes of 2-bit lows, 12 bytes of 6-bit sc x 16, d
          w = (d * (sc - 32)) * q, q in -4..3  -> Int8Weight(scale d * (sc - 32), codes q), groups of 16

(int8 codes: 10 bits a weight held for the file's 3.4, the int8 kernels' speed.) Tensors of other
types (float, Q2_K, whose per-16 offsets only an int4 kernel with groups of 16 could hold exactly, the
IQ types) are not read here: their layers stay in float. A mixture-of-experts file's merged experts
tensors [E, rows, cols] are read as each expert's rows (`gguf_loader.expert_parts`), which
quantization/moe.py fuses per expert.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from llmserve.config import ModelArchConfig
from llmserve.config.quantization import GGUF_BLOCK_TYPES
from llmserve.model_loader import gguf_loader
from llmserve.quantization.formats import Int4Weight, Int8Weight, QuantizedWeight

BLOCK = 32
SUPER_BLOCK = 256  # a K-quant block's weights
_HALF = 2  # bytes of a float16


def read_quantized_tensors(path: str, arch: ModelArchConfig) -> dict[str, QuantizedWeight]:
    """Every tensor of the GGUF at `path` of a type read here (SUPPORTED_TYPES), under its HF name, in HF's
    row order; a merged experts tensor [E, rows, cols] as each expert's weight
    (`mlp.experts.N.up_proj.weight`)."""
    return dict(iter_quantized_tensors(path, arch))


def iter_quantized_tensors(path: str, arch: ModelArchConfig) -> Iterator[tuple[str, QuantizedWeight]]:
    """`read_quantized_tensors`' (name, weight) pairs, each read when asked for (one file tensor at a
    time: the weights cache writes them out as they come, never holding the whole model)."""
    reader = gguf_loader.open_gguf(path)
    for tensor in reader.tensors:
        name = gguf_loader.hf_name(tensor.name)
        reader_fn = _READERS.get(tensor.tensor_type.name)
        if name is None or reader_fn is None:
            continue
        *experts, rows, cols = (int(dim) for dim in reversed(tensor.shape))
        block = SUPER_BLOCK if tensor.tensor_type.name in _SUPER_BLOCK_TYPES else BLOCK
        blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(*experts, rows, cols // block, -1)
        for part_name, part in gguf_loader.expert_parts(name, blocks):
            yield part_name, _hf_rows(reader_fn(part), part_name, arch, path)


def _halves(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 [rows, blocks] (exact)."""
    raw = np.ascontiguousarray(blocks[..., start : start + _HALF]).view(np.float16)[..., 0]
    return torch.from_numpy(raw.astype(np.float32))


def _nibbles(packed: np.ndarray) -> torch.Tensor:
    """[rows, blocks, 16] bytes -> [rows, blocks * 32] codes 0..15 (low halves first)."""
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    return torch.from_numpy(codes.reshape(codes.shape[0], -1))


def _read_q4_0(blocks: np.ndarray) -> Int4Weight:
    scales = _halves(blocks, 0)
    return Int4Weight(_nibbles(blocks[..., _HALF:]), scales, -8.0 * scales, BLOCK)


def _read_q4_1(blocks: np.ndarray) -> Int4Weight:
    return Int4Weight(_nibbles(blocks[..., 2 * _HALF :]), _halves(blocks, 0), _halves(blocks, _HALF), BLOCK)


def _read_q5_0(blocks: np.ndarray) -> Int4Weight:
    """Element i's fifth bit is bit i of the block's little-endian 32-bit word after d. d * q is exact
    in float32 (11 by 5 significant bits) and -16 d too, so d * q + (-16 d) rounds once, as d * (q - 16)."""
    scales = _halves(blocks, 0)
    return Int4Weight(_five_bit_codes(blocks[..., _HALF:]), scales, -16.0 * scales, BLOCK, bits=5)


def _read_q5_1(blocks: np.ndarray) -> Int4Weight:
    """Q5_0's codes after d and m: w = d * q + m (the reference's rounding: d * q exact, plus m)."""
    codes = _five_bit_codes(blocks[..., 2 * _HALF :])
    return Int4Weight(codes, _halves(blocks, 0), _halves(blocks, _HALF), BLOCK, bits=5)


def _five_bit_codes(high_and_nibbles: np.ndarray) -> torch.Tensor:
    """[rows, blocks, 4 + 16]: a little-endian word of fifth bits (bit i: element i's), then nibbles."""
    high = np.ascontiguousarray(high_and_nibbles[..., :4]).view("<u4")
    fifth = (high >> np.arange(BLOCK, dtype=np.uint32)) & 1  # [rows, blocks, 32]
    fifths = (fifth.reshape(len(high_and_nibbles), -1) << 4).astype(np.uint8)
    return torch.from_numpy(_nibbles(high_and_nibbles[..., 4:]).numpy() | fifths)


def _read_q8_0(blocks: np.ndarray) -> Int8Weight:
    codes = np.ascontiguousarray(blocks[..., _HALF:]).view(np.int8)
    return Int8Weight(torch.from_numpy(codes.reshape(codes.shape[0], -1)), _halves(blocks, 0), BLOCK)


def _read_q4_k(blocks: np.ndarray) -> Int4Weight:
    """[rows, super-blocks, 144] -> groups of 32: scale d * sc and offset -dmin * m per sub-block."""
    return _k_quant_groups(blocks, blocks[..., 2 * _HALF + 12 :], None)


def _read_q5_k(blocks: np.ndarray) -> Int4Weight:
    """[rows, super-blocks, 176] -> 5-bit codes in groups of 32, scale d * sc and offset -dmin * m as
    Q4_K's. The 32 bytes after the scales hold the fifth bits: bit s of byte l is that of element l of
    sub-block s; the 128 bytes of nibbles follow, laid out as Q4_K's."""
    fifths = blocks[..., 2 * _HALF + 12 : 2 * _HALF + 44]
    return _k_quant_groups(blocks, blocks[..., 2 * _HALF + 44 :], fifths)


def _k_quant_groups(blocks: np.ndarray, nibbles: np.ndarray, fifths: np.ndarray | None) -> Int4Weight:
    """Q4_K's and Q5_K's shared part: d, dmin and the 6-bit (sc, m) of eight sub-blocks of 32, their
    nibbles in four runs of 32 bytes; `fifths` [rows, supers, 32] (Q5_K) adds each code's fifth bit."""
    rows, supers = blocks.shape[:2]
    d, dmin = _halves(blocks, 0), _halves(blocks, _HALF)
    fields = blocks[..., 2 * _HALF : 2 * _HALF + 12].astype(np.int32)
    first, second, low_high = fields[..., 0:4], fields[..., 4:8], fields[..., 8:12]
    # sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); sub-blocks 4-7: the
    # nibbles of bytes 8-11 (scale low, minimum high) under those bytes' top 2 bits
    sc = np.concatenate([first & 63, (low_high & 15) | ((first >> 6) << 4)], axis=-1)
    m = np.concatenate([second & 63, (low_high >> 4) | ((second >> 6) << 4)], axis=-1)
    scales = d[..., None] * torch.from_numpy(sc.astype(np.float32))
    offsets = -(dmin[..., None] * torch.from_numpy(m.astype(np.float32)))
    # four runs of 32 bytes, each two sub-blocks: its low nibbles, then its high ones
    runs = nibbles.reshape(rows, supers, 4, 1, 32)
    codes = np.concatenate([runs & 0x0F, runs >> 4], axis=3).reshape(rows, supers, 8, 32)
    if fifths is not None:
        codes = codes | ((fifths[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4
    weight = (torch.from_numpy(codes.reshape(rows, -1)), scales.reshape(rows, -1), offsets.reshape(rows, -1))
    return Int4Weight(*weight, BLOCK, bits=4 if fifths is None else 5)


def _read_q3_k(blocks: np.ndarray) -> Int8Weight:
    """[rows, super-blocks, 110] -> int8 codes q in -4..3 in groups of 16, scale d * (sc - 32) (exact in
    float32: 11 by 6 significant bits). A super-block: 32 bytes of high bits (bit b of byte l: that of
    weight 32 b + l), 64 bytes of 2-bit lows (each half of 128 weights: 32 bytes, weights 32 j + l at
    bits 2j of byte l), 12 bytes of sixteen 6-bit scales, then d; q = low - 4 where the high bit is 0."""
    rows, supers = blocks.shape[:2]
    lows = blocks[..., 32:96].reshape(rows, supers, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    highs = blocks[..., :32].reshape(rows, supers, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    codes = (lows & 3).reshape(rows, supers, 256).astype(np.int8) - 4 * (
        1 - (highs & 1).reshape(rows, supers, 256)
    )
    # scale s: its low 4 bits in byte s (s < 8) or the high half of byte s - 8; its top 2 bits at
    # bits 2 (s // 4) of byte 8 + s % 4
    packed = blocks[..., 96:108]
    low_bits = np.concatenate([packed[..., :8] & 15, packed[..., :8] >> 4], axis=-1)
    top_bits = np.concatenate([(packed[..., 8:12] >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    sc = (low_bits | (top_bits << 4)).astype(np.float32) - 32
    scales = _halves(blocks, 108)[..., None] * torch.from_numpy(sc)
    return Int8Weight(torch.from_numpy(codes.astype(np.int8).reshape(rows, -1)), scales.reshape(rows, -1), 16)


def _read_q6_k(blocks: np.ndarray) -> Int8Weight:
    """[rows, super-blocks, 210] -> int8 codes q - 32 in groups of 16, scale d * sc (exact in float32)."""
    rows, supers = blocks.shape[:2]
    # each half of 128 weights: 64 bytes of nibbles (weights 0-63 low, 64-127 high) and 32 bytes
    # holding the weights' top two bits (bits 0-1 for weights 0-31, 2-3 for 32-63, and so on)
    low = blocks[..., :128].reshape(rows, supers, 2, 64)
    high = blocks[..., 128:192].reshape(rows, supers, 2, 32)
    nibbles = np.concatenate([low & 0x0F, low >> 4], axis=-1)
    tops = np.concatenate([(high >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    codes = (nibbles.astype(np.int16) | (tops.astype(np.int16) << 4)) - 32
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    scales = _halves(blocks, 208)[..., None] * torch.from_numpy(sc)
    return Int8Weight(torch.from_numpy(codes.astype(np.int8).reshape(rows, -1)), scales.reshape(rows, -1), 16)


_READERS = {
    "Q4_0": _read_q4_0,
    "Q4_1": _read_q4_1,
    "Q5_0": _read_q5_0,
    "Q5_1": _read_q5_1,
    "Q8_0": _read_q8_0,
    "Q4_K": _read_q4_k,
    "Q5_K": _read_q5_k,
    "Q3_K": _read_q3_k,
    "Q6_K": _read_q6_k,
}
_SUPER_BLOCK_TYPES = frozenset({"Q3_K", "Q4_K", "Q5_K", "Q6_K"})
SUPPORTED_TYPES = GGUF_BLOCK_TYPES  # the config's list, which makes gguf the default: a test checks it


def _hf_rows(weight: QuantizedWeight, name: str, arch: ModelArchConfig, path: str) -> QuantizedWeight:
    """Undo llama.cpp's q/k row permutation, which moves whole rows and so commutes with blocks."""
    order = np.arange(weight.shape[0])
    hf_order = gguf_loader._to_hf_layout(name, order, arch, path)  # noqa: SLF001 (the same rule as floats)
    if np.array_equal(hf_order, order):
        return weight
    return weight.rows(torch.from_numpy(np.ascontiguousarray(hf_order)))
