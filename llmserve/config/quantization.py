"""`--quantization`: which weight-quantization method, resolved before the engine is built.

Kept free of heavy imports: `llmserve.config` imports this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

METHODS = ("int8", "int8-rtn", "int4", "awq", "gptq", "gguf")
GROUP_SIZES = (32, 64, 128)  # the sizes the packed int4 CPU kernel accepts that we offer
# int4 groups run along the input: under tensor parallelism a rank's columns must hold whole ones
GROUPED_METHODS = ("int4", "gptq", "awq")
CALIBRATED_METHODS = ("int8", "gptq", "awq")  # run the float model over calibration text at load
CHECKPOINT = "checkpoint"  # method of a directory written by `llmserve quantize`
PREQUANTIZED = "prequantized"  # a checkpoint published quantized: its own codes (model_loader)
# where int4/int8 codes have kernels of their own (quantization/kernels.py); elsewhere a quantized
# layer rebuilds its float weight every forward, slower than the float model the loader decoded
PACKED_KERNEL_DEVICES = ("cpu",)
# GGUF tensor types whose blocks `--quantization gguf` keeps (quantization/gguf_native.py reads them)
GGUF_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
GGUF_BLOCK_COLUMNS = 32  # a rank's share of a layer's input must hold whole groups of every type above
# levels whose int8/int4 kernels take bf16 inputs only (kernels/csrc/linear_quantized.cpp: the AVX-512
# BF16/VNNI code); the other levels run the AVX2 code, which takes float32 too
BF16_ONLY_INT_KERNEL_LEVELS = ("avx512_bf16", "amx")


def int_kernels_take(dtype: torch.dtype, level: str | None) -> bool:
    """Whether the compiled int8/int4 kernels of instruction-set `level` take inputs of `dtype` (else a
    quantized layer multiplies by its float weight rebuilt at every call)."""
    if level is None:
        return False
    return dtype == torch.bfloat16 or (dtype == torch.float32 and level not in BF16_ONLY_INT_KERNEL_LEVELS)


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # one of METHODS, "checkpoint" (a saved quantized checkpoint in `path`) or "prequantized"
    group_size: int  # int4 group-wise methods: input channels sharing one scale and offset (prequantized: 0)
    path: str | None = None  # checkpoint: the directory `llmserve quantize` wrote

    @staticmethod
    def create(
        value: str | None,
        group_size: int | None,
        in_features: tuple[int, ...],
        shard_in_features: tuple[int, ...] = (),
        checkpoint_method: str | None = None,
        device_type: str = "cpu",
    ) -> QuantizationConfig | None:
        """`value`: a method name or a checkpoint directory; `in_features`: every quantized layer's
        input width, so that "auto" (None) picks the largest group size dividing them all; under
        tensor parallelism `shard_in_features`: each rank's share of the row-parallel layers' input
        width, which the groups of the methods that quantize a shard (int4) or cut one (gptq, awq)
        must divide too. `checkpoint_method`: a pre-quantized model's quant_method, whose own codes
        serve when `value` is None on a device of PACKED_KERNEL_DEVICES (`device_type`; elsewhere,
        and with "none": all dequantized; a method: quantizes them again)."""
        if value is None and checkpoint_method is not None:
            return QuantizationConfig(PREQUANTIZED, 0) if device_type in PACKED_KERNEL_DEVICES else None
        if value is None or value in ("", "none"):
            return None
        if value not in METHODS and not os.path.isdir(value):
            raise ValueError(
                f"quantization must be one of {', '.join(METHODS)}, none or a directory written by "
                f"`llmserve quantize`; got {value!r}"
            )
        shares = shard_in_features if value in GROUPED_METHODS else ()
        return QuantizationConfig(
            method=value if value in METHODS else CHECKPOINT,
            group_size=resolve_group_size(group_size, in_features, shares),
            path=None if value in METHODS else os.path.abspath(value),
        )


def resolve_group_size(
    group_size: int | None, in_features: tuple[int, ...], shard_in_features: tuple[int, ...] = ()
) -> int:
    widths = in_features + shard_in_features
    if group_size is None:  # the largest offered size that divides every layer's input width
        fitting = [size for size in GROUP_SIZES if all(width % size == 0 for width in widths)]
        if not fitting:
            shares = f" and their tensor-parallel shares {shard_in_features}" if shard_in_features else ""
            raise ValueError(
                f"no int4 group size of {GROUP_SIZES} divides the layer widths {in_features}{shares}"
            )
        return fitting[-1]
    if group_size not in GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {GROUP_SIZES}, got {group_size}")
    bad = [width for width in in_features if width % group_size]
    if bad:
        raise ValueError(f"quantization_group_size {group_size} does not divide the layer width {bad[0]}")
    bad = [width for width in shard_in_features if width % group_size]
    if bad:
        raise ValueError(
            f"quantization_group_size {group_size} does not divide {bad[0]}, a tensor-parallel rank's "
            "share of the input width of o_proj or down_proj"
        )
    return group_size
