"""A pre-quantized checkpoint's own codes in the engine's formats, where they fit exactly.

model_loader/prequantized.py unpacks each layer to w = (codes - zeros) * scales. That is

    Int4Weight  for 4-bit codes: offset = -zeros * scales (any zero point, GPTQ v1's 16 included),
                groups of 32, 64 or 128 columns (a larger group, or one per channel, repeats its
                scale over groups of the largest of those dividing it);
    Int8Weight  for 8-bit codes whose zero is 128 in every group (symmetric): codes - 128.

Everything else (asymmetric 8-bit, groups of other sizes, GPTQ desc_act, compressed-tensors'
actorder "group", FP8) stays float: the loader has already dequantized it into the float model.
"""

from __future__ import annotations

import logging

import torch

from llmserve.config.quantization import PACKED_KERNEL_DEVICES
from llmserve.model_loader import hf_loader
from llmserve.model_loader.prequantized import (
    FloatLinear,
    IntegerLinear,
    decode_layers,
    read_quantization,
    split_checkpoint,
)
from llmserve.quantization.formats import Int4Weight, Int8Weight, QuantizedWeight

logger = logging.getLogger("llmserve")

_INT4_GROUPS = (128, 64, 32)  # the group sizes the int4 kernels take, largest first
_INT8_ZERO = 128


def checkpoint_layers(path: str) -> tuple[dict[str, QuantizedWeight], dict[str, str]]:
    """(layers whose codes the kernels take, by HF module name; the others' formats, by name). The
    loader has decoded the checkpoint once already; float layers are only named here, not decoded."""
    spec = read_quantization(hf_loader.read_config(path), path)
    if spec is None:
        raise ValueError(f"quantization prequantized: {path} has no quantization_config")
    _, layers = split_checkpoint(hf_loader.read_weights(path))
    kept: dict[str, QuantizedWeight] = {}
    dequantized: dict[str, str] = {}
    for module, layer in decode_layers(layers, spec):
        weight = kernel_weight(layer) if isinstance(layer, IntegerLinear) else None
        if weight is not None:
            kept[module] = weight
        else:
            dequantized[module] = layer.format if isinstance(layer, FloatLinear) else _why_float(layer)
    return kept, dequantized


def kernel_weight(layer: IntegerLinear) -> QuantizedWeight | None:
    """`layer` in the engine's int4/int8 format, exactly; None where none holds it."""
    if layer.bits == 8:
        if not bool((layer.zeros == _INT8_ZERO).all()):
            return None
        codes = (layer.codes.to(torch.int16) - _INT8_ZERO).to(torch.int8)
        return Int8Weight(codes, layer.scales.contiguous(), layer.group_size)
    group = next((size for size in _INT4_GROUPS if layer.group_size % size == 0), None)
    if layer.bits != 4 or group is None:
        return None
    repeat = layer.group_size // group
    scales = layer.scales.repeat_interleave(repeat, 1).contiguous()
    offsets = (-layer.zeros * layer.scales).repeat_interleave(repeat, 1).contiguous()
    return Int4Weight(layer.codes, scales, offsets, group)


def _why_float(layer: IntegerLinear) -> str:
    if layer.bits == 8:
        return "int8 with zero points"
    return f"int{layer.bits} groups of {layer.group_size}"


def log_served_float(method: str, dtype: torch.dtype, device: torch.device) -> None:
    """One line: a pre-quantized checkpoint served as the float model the loader decoded, and why."""
    why = (
        "--quantization none"
        if device.type in PACKED_KERNEL_DEVICES
        else f"no int4/int8 kernel on {device.type}: its codes would be dequantized at every forward"
    )
    logger.info(
        "checkpoint quantization %s: served as its float model, every layer dequantized to %s (%s)",
        method,
        str(dtype).removeprefix("torch."),
        why,
    )


def log_dequantized(method: str, kept: int, dequantized: dict[str, str], dtype: torch.dtype) -> None:
    """One line: which layers of which formats the load dequantized (none: nothing to say)."""
    if not dequantized:
        return
    by_format: dict[str, list[str]] = {}
    for name, fmt in dequantized.items():
        by_format.setdefault(fmt, []).append(name)
    parts = [
        f"{fmt}: {len(names)} ({names[0]}{', ...' if len(names) > 1 else ''})"
        for fmt, names in by_format.items()
    ]
    logger.info(
        "checkpoint quantization %s: %d layers kept quantized, %d checkpoint layers dequantized to %s "
        "at load (%s)",
        method,
        kept,
        len(dequantized),
        str(dtype).removeprefix("torch."),
        "; ".join(parts),
    )
