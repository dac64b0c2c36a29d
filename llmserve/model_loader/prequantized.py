"""Checkpoints published already quantized: config.json's `quantization_config`, decoded at load.

Each format's packed tensors are unpacked here into one plain form per layer, whatever the format:

    IntegerLinear:  w[n, k] = (codes[n, k] - zeros[n, k // group]) * scales[n, k // group]

(unsigned codes; float zeros and scales), or, where the format has no such groups (FP8; GPTQ's
`desc_act` and compressed-tensors' actorder "group" with inputs out of group order: `g_idx`), the
float weight itself. The loader dequantizes
every layer to build the float model; the `prequantized` quantization method
(quantization/methods.py) then swaps in kernels for the layers whose codes fit them.

    gptq                qweight int32 [in / (32/bits), out], packed along input rows, lowest bits first;
                        qzeros int32 [groups, out / (32/bits)] packed along output columns; scales
                        float16 [groups, out]; g_idx [in] (each input row's group). checkpoint_format
                        "gptq" (v1) stores zero - 1, "gptq_v2" the zero itself.
    awq (GEMM)          qweight int32 [in, out / 8] and qzeros [groups, out / 8] packed along output
                        columns, each word's nibbles holding columns 0, 2, 4, 6, 1, 3, 5, 7; scales
                        float16 [groups, out].
    compressed-tensors  pack-quantized: weight_packed int32 [out, in / (32/bits)] of codes q + 2^(bits-1)
                        along input columns, weight_shape, weight_scale [out, groups | 1], optional
                        weight_zero_point packed along output rows, optional weight_g_idx [in]
                        (actorder "group": each input column's group); int-quantized: weight int8
                        (signed codes), weight_scale, optional weight_zero_point; float-quantized:
                        FP8 weight.
    fp8                 weight float8_e4m3fn with weight_scale (per tensor or channel) or
                        weight_scale_inv (one per weight_block_size block): w = weight * scale.

Layers a checkpoint leaves unquantized (`modules_to_not_convert`, `ignore`, the lm_head) are stored
in float and stay so. Activation scales (`input_scale`, ...) are dropped: activations stay float.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.model_loader.errors import ModelLoadError

METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
_AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of 8 sits in nibble _AWQ_COLUMNS[j]
_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
# tensors of a quantized layer, besides `weight`; activation scales are read by no kernel here
_LAYER_SUFFIXES = frozenset(
    {"qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_shape", "weight_scale"}
    | {"weight_zero_point", "weight_scale_inv", "weight_g_idx"}
)
_MARKERS = ("qweight", "weight_packed", "weight_scale", "weight_scale_inv")  # a layer is quantized
_DROPPED = frozenset(
    {"input_scale", "output_scale", "k_scale", "v_scale", "kv_scale", "input_zero_point"}
    | {"input_global_scale", "weight_global_scale"}
)


@dataclass(frozen=True)
class CheckpointQuantization:
    """What config.json's `quantization_config` says about how the weights are packed."""

    method: str  # one of METHODS
    bits: int  # bits per integer code (8 for FP8)
    zeros_minus_one: bool = False  # GPTQ v1 stores each zero point minus one
    block: tuple[int, int] | None = None  # FP8: rows and columns sharing one weight_scale_inv

    @property
    def name(self) -> str:
        return f"{self.method} ({self.bits}-bit)" if self.method != "fp8" else "fp8"


@dataclass(frozen=True)
class IntegerLinear:
    """One layer's integer codes, unpacked: w = (codes - zeros) * scales, group-wise along inputs."""

    codes: torch.Tensor  # uint8 [out, in], 0 .. 2**bits - 1
    scales: torch.Tensor  # float32 [out, in // group_size]
    zeros: torch.Tensor  # float32 [out, in // group_size], on the codes' unsigned scale
    group_size: int
    bits: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.codes.shape
        codes = self.codes.float().view(rows, -1, self.group_size)
        return ((codes - self.zeros[..., None]) * self.scales[..., None]).view(rows, cols).to(dtype)


@dataclass(frozen=True)
class FloatLinear:
    """A layer whose format has no contiguous integer groups: its weight, dequantized at load."""

    format: str  # why it is float, for the load's log line ("fp8", "gptq desc_act")
    # the float32 [out, in] weight, computed only when asked: naming the format costs nothing
    compute: Callable[[], torch.Tensor]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.compute().to(dtype)


DecodedLinear = IntegerLinear | FloatLinear


def read_quantization(config: dict[str, Any], path: str) -> CheckpointQuantization | None:
    """The checkpoint's quantization, None for a float one; a one-line ModelLoadError for a method,
    bit width or packing this loader does not read."""
    spec = config.get("quantization_config")
    if not spec:
        return None
    method = str(spec.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ModelLoadError(
            f"{path}: unsupported quantization_config quant_method {method!r} "
            f"(supported: {', '.join(METHODS)})"
        )
    reader = {"gptq": _gptq_spec, "awq": _awq_spec, "compressed-tensors": _ct_spec, "fp8": _fp8_spec}[method]
    problem, result = reader(spec)
    if problem:
        raise ModelLoadError(f"{path}: quantization_config {method}: {problem}")
    return result


def _gptq_spec(spec: dict) -> tuple[str | None, CheckpointQuantization | None]:
    bits = int(spec.get("bits", 4))
    packing = str(spec.get("checkpoint_format") or spec.get("format") or "gptq").lower()
    if bits not in (4, 8):
        return f"unsupported bits {bits} (supported: 4, 8)", None
    if packing not in ("gptq", "gptq_v2"):
        return f"unsupported checkpoint_format {packing!r} (supported: gptq, gptq_v2)", None
    return None, CheckpointQuantization("gptq", bits, zeros_minus_one=packing == "gptq")


def _awq_spec(spec: dict) -> tuple[str | None, CheckpointQuantization | None]:
    bits, version = int(spec.get("bits", spec.get("w_bit", 4))), str(spec.get("version", "gemm")).lower()
    if bits != 4:
        return f"unsupported bits {bits} (supported: 4)", None
    if version != "gemm":
        return f"unsupported version {version!r} (supported: gemm)", None
    if spec.get("zero_point", True) is False:
        return "zero_point false is not supported", None
    return None, CheckpointQuantization("awq", bits)


def _ct_spec(spec: dict) -> tuple[str | None, CheckpointQuantization | None]:
    groups = [g for g in (spec.get("config_groups") or {}).values() if g.get("weights")]
    kinds = {(int(g["weights"].get("num_bits", 8)), g["weights"].get("type", "int")) for g in groups}
    formats = {g.get("format") or spec.get("format") for g in groups} - {None}
    if len(kinds) != 1:
        return f"needs one weight scheme over its config_groups, found {sorted(kinds) or 'none'}", None
    ((bits, kind),) = kinds
    bad_formats = formats - set(_CT_FORMATS)
    if bad_formats:
        return f"unsupported format {sorted(bad_formats)[0]!r} (supported: {', '.join(_CT_FORMATS)})", None
    if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
        return f"unsupported weights {kind} {bits}-bit (supported: int 4, int 8, float 8)", None
    block = next((g["weights"].get("block_structure") for g in groups), None)
    return None, CheckpointQuantization("compressed-tensors", bits, block=tuple(block) if block else None)


def _fp8_spec(spec: dict) -> tuple[str | None, CheckpointQuantization | None]:
    fmt = str(spec.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        return f"unsupported fmt {fmt!r} (supported: e4m3)", None
    block = spec.get("weight_block_size")
    return None, CheckpointQuantization("fp8", 8, block=tuple(block) if block else None)


# -- decoding ---------------------------------------------------------------------------------------


def split_checkpoint(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(the float tensors, each quantized layer's tensors by suffix), activation scales dropped."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name in tensors:
        module, _, suffix = name.rpartition(".")
        if suffix in _MARKERS:
            layers[module] = {}
    floats: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module, _, suffix = name.rpartition(".")
        if module in layers and (suffix in _LAYER_SUFFIXES or suffix == "weight"):
            layers[module][suffix] = tensor
        elif suffix not in _DROPPED:
            floats[name] = tensor
    return floats, layers


def decode_layers(
    layers: dict[str, dict[str, torch.Tensor]], spec: CheckpointQuantization
) -> Iterator[tuple[str, DecodedLinear]]:
    for module, parts in layers.items():
        with _decoding(module, spec):
            layer = decode_layer(parts, spec)
        yield module, layer


@contextmanager
def _decoding(module: str, spec: CheckpointQuantization) -> Iterator[None]:
    """A layer's tensors that do not fit together: a one-line ModelLoadError naming it."""
    try:
        yield
    except (KeyError, RuntimeError, ValueError) as error:
        raise ModelLoadError(f"quantized layer {module} ({spec.name}): cannot decode ({error})") from None


def decode_layer(parts: dict[str, torch.Tensor], spec: CheckpointQuantization) -> DecodedLinear:
    if "qweight" in parts:
        return _gptq(parts, spec) if spec.method == "gptq" else _awq(parts)
    if "weight_packed" in parts:
        return _ct_packed(parts, spec.bits)
    weight = parts["weight"]
    if weight.dtype in (torch.int8, torch.uint8):
        return _ct_integer(parts, spec.bits)
    return _fp8(parts, spec.block)


def dequantized_weights(
    tensors: dict[str, torch.Tensor],
    spec: CheckpointQuantization,
    dtype: torch.dtype,
    skipped: Callable[[str], bool] = lambda name: False,
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under its HF name, quantized layers' weights in float `dtype`
    (those whose weight's name `skipped` is true of left out: a quantization serves their codes)."""
    floats, layers = split_checkpoint(tensors)
    for module, parts in layers.items():
        if not skipped(f"{module}.weight"):
            with _decoding(module, spec):
                floats[f"{module}.weight"] = decode_layer(parts, spec).dequantize(dtype)
    return floats


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 / bits codes each, lowest bits first, spread along `dim`: the codes, int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        return ((words.unsqueeze(1) >> shifts[None, :, None]) & mask).reshape(-1, words.shape[1])
    return ((words.unsqueeze(2) >> shifts) & mask).reshape(words.shape[0], -1)


def _gptq(parts: dict[str, torch.Tensor], spec: CheckpointQuantization) -> DecodedLinear:
    codes = unpack_int32(parts["qweight"], spec.bits, 0)  # [in, out]
    scales = parts["scales"].float()  # [groups, out]
    zeros = unpack_int32(parts["qzeros"], spec.bits, 1)[:, : scales.shape[1]].float()
    zeros = zeros + 1 if spec.zeros_minus_one else zeros
    rows = codes.shape[0]
    group = rows // scales.shape[0]
    g_idx = parts.get("g_idx")
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(rows) // group):
        return IntegerLinear(codes.t().to(torch.uint8).contiguous(), scales.t(), zeros.t(), group, spec.bits)
    groups = g_idx.long()  # desc_act: input rows in another order than their groups
    return FloatLinear(
        "gptq desc_act", lambda: ((codes.float() - zeros[groups]) * scales[groups]).t().contiguous()
    )


def _awq(parts: dict[str, torch.Tensor]) -> IntegerLinear:
    codes = _awq_columns(parts["qweight"])  # [in, out]
    scales = parts["scales"].float()
    zeros = _awq_columns(parts["qzeros"]).float()
    group = codes.shape[0] // scales.shape[0]
    return IntegerLinear(codes.t().to(torch.uint8).contiguous(), scales.t(), zeros.t(), group, 4)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    nibbles = unpack_int32(packed, 4, 1)
    return nibbles.view(nibbles.shape[0], -1, 8)[:, :, list(_AWQ_COLUMNS)].reshape(nibbles.shape[0], -1)


def _ct_packed(parts: dict[str, torch.Tensor], bits: int) -> DecodedLinear:
    rows, cols = (int(v) for v in parts["weight_shape"].tolist())
    codes = unpack_int32(parts["weight_packed"], bits, 1)[:, :cols]
    scales = _per_row(parts["weight_scale"], rows)
    packed_zeros = parts.get("weight_zero_point")
    if packed_zeros is None:
        zeros = torch.full_like(scales, float(1 << (bits - 1)))
    else:  # packed along output rows, stored as zero + 2^(bits-1): the unsigned zero itself
        zeros = unpack_int32(packed_zeros, bits, 0)[:rows].float()
    return _integer(codes, scales, zeros, bits, parts.get("weight_g_idx"))


def _ct_integer(parts: dict[str, torch.Tensor], bits: int) -> DecodedLinear:
    middle = 1 << (bits - 1)
    codes = parts["weight"].to(torch.int16) + middle
    scales = _per_row(parts["weight_scale"], codes.shape[0])
    zero_point = parts.get("weight_zero_point")
    signed_zeros = torch.zeros_like(scales) if zero_point is None else _per_row(zero_point, codes.shape[0])
    return _integer(codes, scales, signed_zeros + middle, bits, parts.get("weight_g_idx"))


def _integer(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, g_idx: torch.Tensor | None
) -> DecodedLinear:
    """compressed-tensors' codes [out, in]; `g_idx` (actorder "group"): each input column's group."""
    cols = codes.shape[1]
    if cols % scales.shape[1]:
        raise ValueError(f"{scales.shape[1]} scale groups do not divide {cols} input columns")
    zeros = zeros.expand_as(scales).float()
    group = cols // scales.shape[1]
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(cols) // group):
        return IntegerLinear(codes.to(torch.uint8).contiguous(), scales, zeros, group, bits)
    groups = g_idx.long()  # columns out of group order: no contiguous groups for a kernel
    return FloatLinear(
        "compressed-tensors actorder group", lambda: (codes.float() - zeros[:, groups]) * scales[:, groups]
    )


def _per_row(values: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-tensor, per-channel or group-wise parameter as float32 [rows, groups]."""
    values = values.float()
    if values.numel() == 1:
        return values.reshape(1, 1).expand(rows, 1).contiguous()
    return values.reshape(rows, -1)


def _fp8(parts: dict[str, torch.Tensor], block: tuple[int, int] | None) -> FloatLinear:
    weight = parts["weight"]
    rows, cols = weight.shape
    if "weight_scale_inv" in parts:  # block-wise (DeepSeek, Qwen FP8): multiplied, despite the name
        scale = parts["weight_scale_inv"].float()
        block = block or (math.ceil(rows / scale.shape[0]), math.ceil(cols / scale.shape[1]))
        return FloatLinear("fp8 block-wise", lambda: weight.float() * _blocks(scale, block, rows, cols))
    scale = parts["weight_scale"].float()
    if scale.numel() > 1 and scale.shape[0] != rows:  # compressed-tensors' block strategy
        block = block or (math.ceil(rows / scale.shape[0]), math.ceil(cols / scale.shape[1]))
        return FloatLinear("fp8 block-wise", lambda: weight.float() * _blocks(scale, block, rows, cols))
    scale = _per_row(scale, rows)
    return FloatLinear("fp8", lambda: weight.float() * _columns(scale, cols))


def _columns(scale: torch.Tensor, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(math.ceil(cols / scale.shape[1]), 1)[:, :cols]


def _blocks(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
