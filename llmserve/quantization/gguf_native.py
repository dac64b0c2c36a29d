"""`--quantization gguf`: a GGUF's Q4_0, Q4_1 and Q8_0 blocks read straight into the engine's formats.

No detour through float and no second rounding: a block's float16 `d` (and `m`) become float32
scales (and offsets) exactly, its codes become our codes. llama.cpp's blocks hold 32 weights:

    Q4_0: d, 16 bytes of nibbles    w = d * (q - 8)    -> Int4Weight(scale d, offset -8d)
    Q4_1: d, m, 16 bytes of nibbles w = d * q + m      -> Int4Weight(scale d, offset m)
    Q8_0: d, 32 int8                w = d * q          -> Int8Weight(group 32, scale d)

The nibbles of a block are elements 0..15 in the low halves of its 16 bytes and 16..31 in the high
halves. Tensors of other types (float, K-quants) are not read here: their layers stay in float.
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.config import ModelArchConfig
from llmserve.model_loader import gguf_loader
from llmserve.quantization.formats import Int4Weight, Int8Weight, QuantizedWeight

BLOCK = 32
_HALF = 2  # bytes of a float16


def read_quantized_tensors(path: str, arch: ModelArchConfig) -> dict[str, QuantizedWeight]:
    """Every Q4_0/Q4_1/Q8_0 tensor of the GGUF at `path`, under its HF name, in HF's row order."""
    reader = gguf_loader.open_gguf(path)
    weights: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        name = gguf_loader.hf_name(tensor.name)
        reader_fn = _READERS.get(tensor.tensor_type.name)
        if name is None or reader_fn is None:
            continue
        rows, cols = (int(dim) for dim in reversed(tensor.shape))
        blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, cols // BLOCK, -1)
        weights[name] = _hf_rows(reader_fn(blocks), name, arch, path)
    return weights


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


def _read_q8_0(blocks: np.ndarray) -> Int8Weight:
    codes = np.ascontiguousarray(blocks[..., _HALF:]).view(np.int8)
    return Int8Weight(torch.from_numpy(codes.reshape(codes.shape[0], -1)), _halves(blocks, 0), BLOCK)


_READERS = {"Q4_0": _read_q4_0, "Q4_1": _read_q4_1, "Q8_0": _read_q8_0}
SUPPORTED_TYPES = tuple(_READERS)


def _hf_rows(weight: QuantizedWeight, name: str, arch: ModelArchConfig, path: str) -> QuantizedWeight:
    """Undo llama.cpp's q/k row permutation, which moves whole rows and so commutes with blocks."""
    order = np.arange(weight.shape[0])
    hf_order = gguf_loader._to_hf_layout(name, order, arch, path)  # noqa: SLF001 (the same rule as floats)
    if np.array_equal(hf_order, order):
        return weight
    return weight.rows(torch.from_numpy(np.ascontiguousarray(hf_order)))
