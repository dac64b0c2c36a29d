"""Matmul kernels for quantized weights, chosen per (format, device, activation dtype).

On a CPU the compiled int8/int4 kernels (`RoundedInputKernel`) take every row count: bfloat16
activations, and float32 ones at the AVX2 level (which CPUs without native bf16 may run). They round
the input to 8 bits per 32 columns and multiply with integer dot products, streaming the packed
codes at batch 1 and running several times faster than the dequantized GEMM or PyTorch's packed
ops at batch sizes above (docs/quantization.md: how the kernels work). Where they do not serve (a
width not a multiple of 32, an int8 code of -128), bf16 takes PyTorch's packed ops and float32
dequantizes on the fly. On CUDA the Triton kernel (`TritonKernel`) multiplies by tiles of W rebuilt
from the codes in registers; other devices dequantize on the fly (correct, a memory saving only).

Contract: a kernel maps x [..., in] to x @ W.T [..., out] in x's dtype, and `dequantize()` returns
the W it multiplies by (what the tests compare a float run against).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.kernels.logits import float32_logits
from llmserve.quantization.formats import Int4Weight, Int8Weight, QuantizedWeight, StackedRows

_INT4_INNER_K_TILES = 1  # the CPU packing ignores tiling beyond this; any value >= 1 is accepted
_INT4_CENTER = 8  # tinygemm's dequantization: w = (q - 8) * scale + zero


class LinearKernel(nn.Module):
    """One quantized weight, prepared for one kernel; tensors are buffers so `.to()` moves them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T in float32, for an output projection (models/layers/lm_head.py says why); kernels
        with a float32-output path of their own override it."""
        if x.dtype == torch.float32:
            return self(x)
        return float32_logits(x, self.dequantize(x.dtype))

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor | None:
        """Rows `index` of `dequantize(torch.float32)` (any shape of index, rows last), rebuilt from
        those rows alone, bit for bit; None where this kernel's copy cannot give them exactly (its
        scales rounded to the activation dtype)."""
        return None


class DequantizeKernel(LinearKernel):
    """Any format, any device: rebuild the float weight, then `F.linear`."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind, self.group_size = weight.kind, weight.group_size
        self.bits = weight.bits
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales.to(dtype))
        offsets = weight.offsets.to(dtype) if isinstance(weight, Int4Weight) else None
        self.register_buffer("offsets", offsets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._weight().dequantize(dtype)

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor | None:
        if self.scales.dtype != torch.float32:  # rounded to the activation dtype: not the file's values
            return None
        rows = self._weight().rows(index.reshape(-1)).dequantize(torch.float32)
        return rows.view(*index.shape, rows.shape[-1])

    def _weight(self) -> QuantizedWeight:
        if self.kind == "int8":
            return Int8Weight(self.qweight, self.scales, self.group_size)
        return Int4Weight(self.qweight, self.scales, self.offsets, self.group_size, self.bits)


class RoundedInputKernel(LinearKernel):
    """The compiled int8/int4 kernels (kernels/csrc/linear_quantized.cpp) on the CPU, their packed copy
    the layer's only one. Inputs of a dtype this build's kernels take (bfloat16; float32 too at the
    AVX2 level) run them at every row count, rounded to 8 bits per 32 columns, each row's output
    independent of the batch it came in (`batch_invariant`); other dtypes multiply by the float
    weight rebuilt from the packed copy (`small_batch_dequantize_*`: W = q * scale (+ offset), as the
    weight's own `dequantize`)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind, self.group_size = weight.kind, weight.group_size
        self.bits = weight.bits  # int4's 4 or 5 (a plane of fifth bits after the nibbles)
        ops = load_cpu_ops()
        codes = weight.qweight.contiguous()
        self._float_out = None
        if isinstance(weight, Int4Weight):
            self._kernel = ops.small_batch_linear_int4
            self._unpack = functools.partial(ops.small_batch_dequantize_int4, bits=weight.bits)
            packed, scales = ops.small_batch_pack_int4(
                codes, weight.scales.float(), weight.offsets.float(), bits=weight.bits
            )
        else:
            self._kernel = ops.small_batch_linear_int8
            self._float_out = ops.small_batch_linear_int8_float_out
            self._unpack = ops.small_batch_dequantize_int8
            packed = ops.small_batch_pack_int8(codes)
            if weight.group_size == weight.shape[1]:  # per channel
                scales = weight.scales[:, 0].float().contiguous()
            else:
                scales = ops.small_batch_pack_int8_group_scales(weight.scales.float().contiguous())
        self.register_buffer("small_batch_qweight", packed)
        # [N], per 16/32 columns packed, or int4's params; factored by super-blocks where exact
        self.register_buffer("small_batch_scales", factored_scales(self.kind, self.group_size, scales))
        self.out_features = weight.shape[0]
        self._takes = {d for d in (torch.bfloat16, torch.float32) if ops.small_batch_linear_int8_supported(d)}
        self.batch_invariant = dtype in self._takes  # the model's activations run the kernel

    @staticmethod
    def serves(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
        if device.type != "cpu" or _small_batch_int8_ops(weight.qweight) is None:
            return False
        if isinstance(weight, Int4Weight):
            return weight.group_size % 32 == 0
        return weight.group_size in (16, 32, weight.shape[1])

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether inputs of `dtype` run the compiled kernel (else the rebuilt float weight)."""
        return dtype in self._takes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._unpack(self.small_batch_qweight, self.small_batch_scales, self.out_features).to(dtype)

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the float32 weight, read from the packed copy by the compiled dequantizer (its
        rows, in the dequantize's arithmetic: equal to `dequantize(torch.float32)[index]`)."""
        flat = index.reshape(-1).long()
        rows = self._unpack(self.small_batch_qweight, self.small_batch_scales, self.out_features, rows=flat)
        return rows.view(*index.shape, rows.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in self._takes:
            return F.linear(x, self.dequantize(x.dtype))
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = self._kernel(flat, self.small_batch_qweight, self.small_batch_scales, self.out_features)
        return out.view(*x.shape[:-1], -1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's float32 sums, unrounded: int8's float32-out entry point, or the forward of
        float32 x (which writes them)."""
        if x.dtype == torch.float32 and x.dtype in self._takes:
            return self(x)
        if self._float_out is None or x.dtype not in self._takes:
            return super().logits(x)
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = self._float_out(flat, self.small_batch_qweight, self.small_batch_scales, self.out_features)
        return out.view(*x.shape[:-1], -1)


class GroupedExpertsKernel:
    """One projection of every expert of a mixture-of-experts layer in one compiled call
    (`grouped_linear_int8/int4`: the kernels of RoundedInputKernel over a run of experts, each
    expert's rows against its own weights, every (expert, block of 32 output rows) one work item
    shared out to the threads). The experts' packed copies are stacked [E, ...] once and each
    expert's RoundedInputKernel keeps a view of its slice as its buffer, so the layer holds one copy
    and its buffers list each byte once (the stack is a plain attribute, not a buffer: these
    kernels serve the CPU only, so the layer never moves). A row's output is the one its expert's
    kernel gives it alone, bit for bit."""

    def __init__(self, kernels: list[RoundedInputKernel]) -> None:
        first = kernels[0]
        self.out_features, self.kind = first.out_features, first.kind
        self._takes = first._takes
        # float16 scales where exact for every value of an expert (half_if_exact): a layer whose
        # experts differ stacks them all in float32, exactly
        scale_dtypes = {kernel.small_batch_scales.dtype for kernel in kernels}
        scale_dtype = scale_dtypes.pop() if len(scale_dtypes) == 1 else torch.float32
        self.qweight = torch.stack([kernel.small_batch_qweight for kernel in kernels])
        self.scales = torch.stack([kernel.small_batch_scales.to(scale_dtype) for kernel in kernels])
        for expert, kernel in enumerate(kernels):
            kernel.small_batch_qweight, kernel.small_batch_scales = self.qweight[expert], self.scales[expert]
        ops = load_cpu_ops()
        self._kernel = ops.grouped_linear_int4 if self.kind == "int4" else ops.grouped_linear_int8

    @staticmethod
    def of(kernels: list[LinearKernel]) -> GroupedExpertsKernel | None:
        """The grouped kernel over `kernels` where each is a RoundedInputKernel of one layout (kind,
        bits, group size, packed and scale shapes); None otherwise (experts of different GGUF block
        types, or one whose int8 codes reach -128 and so take another kernel): those layers run
        expert by expert."""
        if not kernels or not all(isinstance(kernel, RoundedInputKernel) for kernel in kernels):
            return None
        if any(not kernel.small_batch_scales.is_floating_point() for kernel in kernels):
            # an expert whose scales the packer kept in float16 (all zero, say) beside factored ones:
            # factored too where its values allow, so that the stack keeps one layout
            for kernel in kernels:
                if kernel.small_batch_scales.is_floating_point():
                    scales = kernel.small_batch_scales.float()
                    kernel.small_batch_scales = factored_scales(kernel.kind, kernel.group_size, scales)

        def layout(kernel: RoundedInputKernel) -> tuple:
            packed, scales = kernel.small_batch_qweight, kernel.small_batch_scales
            return (kernel.kind, kernel.bits, kernel.group_size, kernel.out_features, packed.shape,
                    packed.dtype, scales.shape, scales.is_floating_point())  # fmt: skip

        return GroupedExpertsKernel(kernels) if len({layout(k) for k in kernels}) == 1 else None

    def takes(self, dtype: torch.dtype) -> bool:
        return dtype in self._takes

    def __call__(self, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x [T, in] with expert e's rows at [ends[e - 1], ends[e]) (ends[-1] = 0; int64 [E]) ->
        [T, out] in x's dtype."""
        return self._kernel(x.contiguous(), ends, self.qweight, self.scales, self.out_features)


class TritonKernel(LinearKernel):
    """Any format on CUDA: the Triton kernel (kernels/triton/quantized_linear.py) rebuilds each tile of W
    from the codes it keeps (int4 two to a byte, 5-bit with a plane of fifth bits, int8 one a byte) and
    multiplies in registers, so the layer holds about its codes' size and never a float copy of W."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        from llmserve.kernels.triton import quantized_linear

        self._linear = quantized_linear.quantized_linear
        self.group_size, self.bits = weight.group_size, weight.bits
        if isinstance(weight, Int4Weight):
            codes, fifths = quantized_linear.pack_int4(weight.qweight.contiguous(), weight.bits)
            offsets = _half_if_exact(weight.offsets)
        else:
            codes, fifths, offsets = weight.qweight.contiguous(), None, None
        self.register_buffer("codes", codes)
        self.register_buffer("fifths", fifths)
        self.register_buffer("scales", _half_if_exact(weight.scales))
        self.register_buffer("offsets", offsets)

    @staticmethod
    def serves(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
        """CUDA, float activations, whole bytes of codes (K a multiple of 8) in groups of an even size."""
        return (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and weight.shape[1] % 8 == 0
            and weight.group_size % 2 == 0
            and importlib.util.find_spec("triton") is not None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, x.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's float32 sums, unrounded."""
        return self._run(x, torch.float32)

    def _run(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = self._linear(
            flat, self.codes, self.fifths, self.scales, self.offsets, self.group_size, self.bits, out_dtype
        )
        return out.view(*x.shape[:-1], out.shape[-1])  # a step of no rows too

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._weight().dequantize(torch.float32).to(dtype)

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of `dequantize(torch.float32)`, unpacked from those rows alone."""
        rows = self._weight(index.reshape(-1)).dequantize(torch.float32)
        return rows.view(*index.shape, rows.shape[-1])

    def _weight(self, index: torch.Tensor | None = None) -> QuantizedWeight:
        """The format's form of rows `index` (all by default), scales and offsets in float32 as read."""

        def pick(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return tensor if tensor is None or index is None else tensor[index]

        scales = pick(self.scales).float()
        if self.bits == 8:
            return Int8Weight(pick(self.codes), scales, self.group_size)
        from llmserve.kernels.triton.quantized_linear import unpack_int4

        codes = unpack_int4(pick(self.codes), pick(self.fifths))
        return Int4Weight(codes, scales, pick(self.offsets).float(), self.group_size, self.bits)


SUPER_GROUPS = 8  # int4 groups of a K-quant super-block (Q4_K: 8 x 32 columns)
SCALE_SUPER_GROUPS = 16  # int8 groups of 16 columns in one (Q6_K, Q3_K)
_PROBE_RUNS = 64  # runs tried against every code first: values that do not factor fail there
# the code a run's value of largest magnitude may take, most likely first: a K-quant's largest 6-bit
# scale 63 (Q4_K, Q5_K), Q6_K's -128 and Q3_K's -32
_UNSIGNED_PEAKS = (*range(63, 0, -1), *range(64, 256))
_SIGNED_PEAKS = (-128, -32, *(c for c in range(-127, 0) if c != -32), *range(1, 128))


def factored_scales(kind: str, group_size: int, scales: torch.Tensor) -> torch.Tensor:
    """A RoundedInputKernel's packed scales (int4's parameters) factored where exact: int4's by
    `factored_int4_params`, int8's per 16 columns by `factored_int8_scales`; others unchanged."""
    if kind == "int4":
        return factored_int4_params(scales)
    return factored_int8_scales(scales) if group_size == 16 and scales.dim() == 3 else scales


def factored_int4_params(params: torch.Tensor) -> torch.Tensor:
    """int4 parameters as `small_batch_pack_int4` lays them out ([N' / 32, groups, 2, 32], float32),
    factored by super-blocks where that is exact: each run of 8 groups' 32 scales (and 32 offsets) of a
    row as one float16 factor times uint8 codes, uint8 [N' / 32, groups / 8, 5, 128] (linear_quantized.cpp
    says how they lie). A GGUF Q4_K/Q5_K's scales d * sc and offsets -dmin * m (float16 d and dmin,
    6-bit sc and m) factor so: 4.6 bits a weight held instead of 6. Otherwise `params` unchanged (float16
    ones, where the packer found them exact, too)."""
    if params.dtype != torch.float32 or params.shape[1] % SUPER_GROUPS:
        return params
    blocks, supers = params.shape[0], params.shape[1] // SUPER_GROUPS
    found = _factor_runs(params, _int4_runs, _UNSIGNED_PEAKS, 0, 255)
    if found is None:
        return params
    factors, codes = found
    head = factors.view(blocks, supers, 2 * 32).view(torch.uint8)  # [B, S, 128]: scales', offsets'
    body = codes.view(blocks, supers, 2, 32, SUPER_GROUPS).permute(0, 1, 2, 4, 3).reshape(blocks, supers, -1)
    return torch.cat([head, body.to(torch.uint8)], dim=2).view(blocks, supers, 5, 128).contiguous()


def factored_int8_scales(scales: torch.Tensor) -> torch.Tensor:
    """int8 scales per 16 columns as `small_batch_pack_int8_group_scales` lays them out ([N' / 32, K / 16,
    32], float32), factored where exact: each row's 16 scales of a super-block of 256 columns as one
    float16 factor times int8 codes, int8 [N' / 32, K / 256, 576]. A GGUF Q6_K's d * sc (float16 d, 8-bit
    signed sc) and Q3_K's d * (sc - 32) factor so: 8.56 bits a weight held instead of 10. Otherwise
    `scales` unchanged."""
    if scales.dtype != torch.float32 or scales.dim() != 3 or scales.shape[1] % SCALE_SUPER_GROUPS:
        return scales
    blocks, supers = scales.shape[0], scales.shape[1] // SCALE_SUPER_GROUPS
    found = _factor_runs(scales, _int8_runs, _SIGNED_PEAKS, -128, 127)
    if found is None:
        return scales
    factors, codes = found
    head = factors.view(blocks, supers, 32).view(torch.int8)  # [B, S, 64]
    body = codes.view(blocks, supers, 32, SCALE_SUPER_GROUPS).transpose(2, 3).reshape(blocks, supers, -1)
    return torch.cat([head, body.to(torch.int8)], dim=2).contiguous()


def _int4_runs(params: torch.Tensor) -> torch.Tensor:
    """[B, groups, 2, 32] -> runs [B * S * 2 * 32, 8]: each (block, super-block, part, lane)'s 8 groups."""
    blocks, supers = params.shape[0], params.shape[1] // SUPER_GROUPS
    runs = params.view(blocks, supers, SUPER_GROUPS, 2, 32).permute(0, 1, 3, 4, 2)
    return runs.reshape(-1, SUPER_GROUPS)


def _int8_runs(scales: torch.Tensor) -> torch.Tensor:
    """[B, K / 16, 32] -> runs [B * S * 32, 16]: each (block, super-block, lane)'s 16 groups."""
    blocks, supers = scales.shape[0], scales.shape[1] // SCALE_SUPER_GROUPS
    runs = scales.view(blocks, supers, SCALE_SUPER_GROUPS, 32).permute(0, 1, 3, 2)
    return runs.reshape(-1, SCALE_SUPER_GROUPS)


def _factor_runs(
    packed: torch.Tensor, runs_of: Callable, peaks: tuple[int, ...], low: int, high: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`runs_of(packed)` [R, n] -> (float16 factors [R], integer codes [R, n] in low..high) with every
    value factor * code exactly (checked in float32), or None where a run has none. Each run's factor is
    peak / c (peak: its value of largest magnitude) for the first code c of `peaks` that works. A few
    runs of the first block are tried against every code at once first, so that values that do not
    factor (RTN's, AWQ's) cost one small vectorized check at load, not a search."""
    if not _every_run_factors(runs_of(packed[:1])[:_PROBE_RUNS], peaks, low, high):
        return None
    return _search(runs_of(packed), peaks, low, high)


def _exact(
    values: torch.Tensor, factor: torch.Tensor, low: int, high: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether every value of a run [..., n] is `factor` [...] (float16) times an integer code in
    low..high, checked in float32 as the kernels multiply them, [...]; those codes, [..., n])."""
    wide = factor.float()[..., None]
    quotient = torch.round(values / wide)
    exact = ((quotient >= low) & (quotient <= high) & (quotient * wide == values)).all(-1)
    return exact & factor.isfinite() & (factor != 0), quotient


def _peaks(values: torch.Tensor) -> torch.Tensor:
    """Each run's value of largest magnitude, signed."""
    return values.gather(1, values.abs().argmax(1, keepdim=True))[:, 0]


def _every_run_factors(values: torch.Tensor, peaks: tuple[int, ...], low: int, high: int) -> bool:
    peak = _peaks(values)
    live = peak != 0
    factor = (peak[live, None] / torch.tensor(peaks, dtype=torch.float32)).half()  # [runs, codes]
    exact, _ = _exact(values[live, None, :], factor, low, high)
    return bool(exact.any(1).all())


def _search(values: torch.Tensor, peaks: tuple[int, ...], low: int, high: int):
    peak = _peaks(values)
    factors = torch.zeros(len(values), dtype=torch.float16)
    codes = torch.zeros(values.shape, dtype=torch.int16)
    todo = torch.nonzero(peak != 0)[:, 0]  # all-zero runs: factor 0, codes 0
    for code in peaks:
        if not len(todo):
            return factors, codes
        factor = (peak[todo] / code).half()
        exact, quotient = _exact(values[todo], factor, low, high)
        factors[todo[exact]] = factor[exact]
        codes[todo[exact]] = quotient[exact].to(torch.int16)
        todo = todo[~exact]
    return (factors, codes) if not len(todo) else None


def _half_if_exact(values: torch.Tensor) -> torch.Tensor:
    """float16 where every value is exact in it (a GGUF's d and m), else float32."""
    values = values.float()
    half = values.half().contiguous()
    return half if torch.equal(half.float(), values) else values.contiguous()


class Int8PackedKernel(LinearKernel):
    """Per-output-channel int8 where the compiled kernels do not serve: `aten._weight_int8pack_mm`
    (CPU, bf16).

    On torch 2.13 the op crashes (SIGSEGV) on a weight that is not 64-byte aligned, such as a view
    into a larger buffer (safetensors' `load_file` returns those: a checkpoint's or the weights
    cache's int8 layers), so the weight is always copied into a fresh allocation (64-byte aligned)."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", weight.qweight.clone(memory_format=torch.contiguous_format))
        self.register_buffer("scales", weight.scales[:, 0].to(dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        return out.view(*x.shape[:-1], -1)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]


class Int8GroupedPackedKernel(LinearKernel):
    """Group-wise int8 (GGUF Q8_0) where the compiled kernels do not serve: one `_weight_int8pack_mm`
    per input group, summed in float32 (a loop over the few groups, in / 32, never over tokens)."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype) -> None:
        super().__init__()
        rows, cols = weight.shape
        self.group_size = weight.group_size
        grouped = weight.qweight.view(rows, -1, self.group_size).transpose(0, 1).contiguous()
        self.register_buffer("qweight", grouped)  # [groups, out, group_size]
        self.register_buffer("scales", weight.scales.t().to(dtype).contiguous())  # [groups, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = x.reshape(-1, self.qweight.shape[0], self.group_size).transpose(0, 1).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(groups[0], self.qweight[0], self.scales[0]).float()
        for index in range(1, self.qweight.shape[0]):
            out += torch.ops.aten._weight_int8pack_mm(groups[index], self.qweight[index], self.scales[index])
        return out.to(x.dtype).view(*x.shape[:-1], -1)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        grouped = self.qweight.to(dtype) * self.scales.to(dtype)[..., None]
        return grouped.transpose(0, 1).reshape(self.qweight.shape[1], -1)


class Int4PackedKernel(LinearKernel):
    """Group-wise int4 where the compiled kernels do not serve: `aten._weight_int4pack_mm_for_cpu`
    (tinygemm's layout, CPU, bf16).

    tinygemm computes w = (q - 8) * scale + zero from scales_and_zeros [in / group, out, 2], so our
    offset becomes zero = offset + 8 * scale (rounded once, to the activation dtype)."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.group_size = weight.group_size
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.qweight.to(torch.int32), _INT4_INNER_K_TILES
        )
        zeros = weight.offsets + _INT4_CENTER * weight.scales
        scales_and_zeros = torch.stack([weight.scales, zeros], dim=-1).transpose(0, 1).to(dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, self.group_size, self.scales_and_zeros
        )
        return out.view(*x.shape[:-1], -1)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The kernel's own view of W: an identity matrix through it, transposed."""
        cols = self.scales_and_zeros.shape[0] * self.group_size
        eye = torch.eye(cols, dtype=self.scales_and_zeros.dtype, device=self.packed.device)
        return self.forward(eye).t().to(dtype)


def _small_batch_int8_ops(codes: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
    """The compiled kernels, where this build has the int8/int4 kernels for `dtype` inputs and the
    codes suit them: a width that is a multiple of 32, and int8 codes within [-127, 127] (the
    kernel stores q + 128 unsigned; a checkpoint's -128 keeps the packed op)."""
    if codes.device.type != "cpu":
        return None
    ops = load_cpu_ops()
    if ops is None or not ops.small_batch_linear_int8_supported(dtype) or codes.shape[-1] % 32:
        return None
    if codes.dtype == torch.int8 and codes.numel() and int(codes.min()) < -127:
        return None
    return ops


def _packed_cpu(weight: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16


# In order of preference: (applies to weight/dtype/device, kernel class).
_KERNELS: list[tuple[Callable[[QuantizedWeight, torch.dtype, torch.device], bool], type[LinearKernel]]] = [
    (RoundedInputKernel.serves, RoundedInputKernel),
    (TritonKernel.serves, TritonKernel),
    (lambda w, d, dev: _packed_cpu(w, d, dev) and w.kind == "int4" and w.bits == 4, Int4PackedKernel),
    (
        lambda w, d, dev: _packed_cpu(w, d, dev) and w.kind == "int8" and w.group_size == w.shape[1],
        Int8PackedKernel,
    ),
    (lambda w, d, dev: _packed_cpu(w, d, dev) and w.kind == "int8", Int8GroupedPackedKernel),
    (lambda w, d, dev: True, DequantizeKernel),
]


class StackedKernel(LinearKernel):
    """A StackedRows weight (a fused layer whose shards' formats do not join): each part's own kernel
    on the same input, their outputs side by side. The CPU's fused decode stack runs a q/k/v layer of
    two parts on their compiled kernels the same way (models/decode_stack.py)."""

    def __init__(self, weight: StackedRows, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.parts = nn.ModuleList(select_kernel(part, dtype, device) for part in weight.parts)
        # each row's output independent of its batch where every part's is (worker/batch_invariance.py)
        self.batch_invariant = all(getattr(part, "batch_invariant", False) for part in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([part.dequantize(dtype) for part in self.parts])


def select_kernel(
    weight: QuantizedWeight | StackedRows, dtype: torch.dtype, device: torch.device
) -> LinearKernel:
    """The fastest kernel measured for this weight format, activation dtype and device."""
    if isinstance(weight, StackedRows):
        return StackedKernel(weight, dtype, device)
    weight = _to_device(weight, device)
    kernel_cls = next(cls for applies, cls in _KERNELS if applies(weight, dtype, device))
    return kernel_cls(weight, dtype)


def _to_device(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    if isinstance(weight, Int8Weight):
        return Int8Weight(weight.qweight.to(device), weight.scales.to(device), weight.group_size)
    return Int4Weight(
        weight.qweight.to(device),
        weight.scales.to(device),
        weight.offsets.to(device),
        weight.group_size,
        weight.bits,
    )


class QuantizedLinear(nn.Module):
    """Drop-in for `nn.Linear` (no grad) whose weight lives in a quantized kernel."""

    def __init__(
        self,
        weight: QuantizedWeight | StackedRows,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device,
        float_logits: bool = False,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = select_kernel(weight, dtype, torch.device(device))
        self.register_buffer("bias", None if bias is None else bias.detach().to(device, dtype))
        self.float_logits = float_logits  # an output projection: float32 out, unrounded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel.logits(x) if self.float_logits else self.kernel(x)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        kernel = type(self.kernel).__name__
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={kernel}"
