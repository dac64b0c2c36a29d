"""Scales factored by super-blocks (`factored_int4_params`, `factored_int8_scales`,
kernels/csrc/linear_quantized.cpp): a GGUF Q4_K/Q5_K's scales d * sc and offsets -dmin * m, and a Q6_K's or
Q3_K's int8 scales d * sc, held as float16 factors per 256 columns times byte codes (Q4_K 4.6 bits a weight
instead of 6, Q6_K 8.6 instead of 10), giving the float32 scales' outputs bit for bit in every kernel that
reads them."""

import pytest
import torch

from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.quantization.formats import Int4Weight, Int8Weight, quantize_int4, quantize_int8
from llmserve.quantization.kernels import (
    GroupedExpertsKernel,
    RoundedInputKernel,
    factored_int4_params,
    factored_int8_scales,
)

ops = load_cpu_ops()
pytestmark = pytest.mark.cpu_kernels("int8_linear")
DTYPES = [torch.bfloat16, torch.float32]  # float32: where the level's kernels take it (AVX2)


def _k_quant(out_features: int, in_features: int, seed: int, bits: int = 4) -> Int4Weight:
    """A Q4_K-like weight (Q5_K-like at bits 5): groups of 32, scale d * sc and offset -dmin * m with a
    float16 d and dmin per 256 columns and 6-bit sc and m, whose largest is 63 as llama.cpp writes them
    in most super-blocks but not all (a run whose codes top out lower takes another factor)."""
    gen = torch.Generator().manual_seed(seed)
    supers = in_features // 256

    def factored(scale: float) -> torch.Tensor:
        codes = torch.randint(0, 64, (out_features, supers, 8), generator=gen).float()
        codes[:, ::2, 0] = 63
        factor = (torch.rand(out_features, supers, 1, generator=gen) * scale + 1e-5).half().float()
        return (factor * codes).view(out_features, -1)

    codes = torch.randint(0, 1 << bits, (out_features, in_features), generator=gen, dtype=torch.uint8)
    return Int4Weight(codes, factored(2e-3), -factored(1e-3), 32, bits)


def _pack(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.small_batch_pack_int4(weight.qweight, weight.scales, weight.offsets, bits=weight.bits)


@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize(("out_features", "in_features"), [(70, 512), (33, 256), (8, 2304)])
def test_factored_parameters_give_the_float32_ones_outputs_bit_for_bit(bits, out_features, in_features):
    """Every row count 1..12 and a large one, both input dtypes the level takes, odd output sizes (zero
    rows pad the last block); the weight read back (all rows, chosen rows) is the format's own."""
    weight = _k_quant(out_features, in_features, out_features + bits, bits)
    packed, params = _pack(weight)
    assert params.dtype == torch.float32  # d * sc is not exact in float16
    factored = factored_int4_params(params)
    assert factored.dtype == torch.uint8 and factored.shape == (params.shape[0], in_features // 256, 5, 128)
    assert factored.numel() * 8 / (params.shape[0] * 32 * in_features) == 0.625  # bits a weight
    expected = weight.dequantize()
    assert torch.equal(ops.small_batch_dequantize_int4(packed, factored, out_features, bits=bits), expected)
    rows = torch.tensor([[out_features - 1, 0], [1, out_features // 2]])
    picked = ops.small_batch_dequantize_int4(packed, factored, out_features, bits=bits, rows=rows)
    assert torch.equal(picked, expected[rows.reshape(-1)])
    ran = 0
    for dtype in DTYPES:
        if not ops.small_batch_linear_int8_supported(dtype):
            continue
        x = torch.randn(40, in_features, generator=torch.Generator().manual_seed(bits)).to(dtype)
        x[0, :32] = 0  # an all-zero input block: scale 0
        for count in [*range(1, 13), 40]:
            head = x[:count].contiguous()
            out = ops.small_batch_linear_int4(head, packed, factored, out_features)
            reference = ops.small_batch_linear_int4(head, packed, params, out_features)
            assert torch.equal(out, reference), (dtype, count)
        ran += 1
    assert ran >= 1  # bf16 inputs run at every level


def test_parameters_that_do_not_factor_stay_as_packed():
    """RTN's float32 scales and offsets (no float16 factor times byte codes holds them), float16 ones
    (already 5 bits a weight) and groups in runs other than 8 keep the packer's layout."""
    rtn = quantize_int4(torch.randn(40, 512, generator=torch.Generator().manual_seed(1)), 32)
    params = _pack(rtn)[1]
    assert params.dtype == torch.float32 and factored_int4_params(params) is params
    half = Int4Weight(rtn.qweight, rtn.scales.half().float(), rtn.offsets.half().float(), 32)
    half_params = _pack(half)[1]
    assert half_params.dtype == torch.float16 and factored_int4_params(half_params) is half_params
    narrow = _k_quant(40, 256, 2)
    cut = Int4Weight(narrow.qweight[:, :224], narrow.scales[:, :7], narrow.offsets[:, :7], 32)
    assert factored_int4_params(_pack(cut)[1]).dtype == torch.float32  # 7 groups a row
    late = _k_quant(70, 256, 4)  # factors in its first block, not in its last
    late.scales[65, 3] += 1e-7
    params = _pack(late)[1]
    assert factored_int4_params(params) is params


def test_runs_of_zeros_and_of_one_sign_factor_exactly():
    """All-zero runs (padding rows, a zero sub-block's minimums), positive offsets and a run whose largest
    code is below 63 all factor, read back exactly."""
    weight = _k_quant(40, 512, 5)
    weight.offsets[:, :8] = 0
    weight.offsets[3] = -weight.offsets[3]  # a positive minimum's run
    low = torch.tensor([5.0, 0, 1, 2, 3, 4, 5, 1])  # a run whose largest code is 5
    weight.scales[7, 8:16] = torch.tensor(1.5e-3).half().float() * low
    packed, params = _pack(weight)
    factored = factored_int4_params(params)
    assert factored.dtype == torch.uint8
    assert torch.equal(ops.small_batch_dequantize_int4(packed, factored, 40, bits=4), weight.dequantize())


def test_malformed_factored_parameters_are_refused():
    weight = _k_quant(32, 256, 6)
    packed, params = _pack(weight)
    factored = factored_int4_params(params)
    x = torch.randn(1, 256).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="packed by small_batch_pack_int4"):
        ops.small_batch_linear_int4(x, packed, factored.view(1, 1, 10, 64), 32)
    with pytest.raises(RuntimeError, match="packed by small_batch_pack_int4"):
        ops.small_batch_dequantize_int4(packed, factored[:, :, :4].contiguous(), 32, bits=4)


def _q6_k(out_features: int, in_features: int, seed: int) -> Int8Weight:
    """A Q6_K-like weight: int8 codes -32..31 in groups of 16, scale d * sc with a float16 d per 256
    columns and a signed 8-bit sc, -128 for the run's largest magnitude as llama.cpp writes it (in half
    of the runs; the others top out elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    supers = in_features // 256
    sc = torch.randint(-127, 128, (out_features, supers, 16), generator=gen).float()
    sc[:, ::2, 3] = -128
    d = (torch.rand(out_features, supers, 1, generator=gen) * 2e-4 + 1e-6).half().float()
    codes = torch.randint(-32, 32, (out_features, in_features), generator=gen, dtype=torch.int8)
    return Int8Weight(codes, (d * sc).view(out_features, -1), 16)


@pytest.mark.parametrize(("out_features", "in_features"), [(70, 512), (33, 256), (8, 2304)])
def test_factored_int8_scales_give_the_float32_ones_outputs_bit_for_bit(out_features, in_features):
    """bf16/float32 outputs and the float32-out entry point at every row count 1..12 and a large one;
    the weight read back (all rows, chosen rows) is the format's own."""
    weight = _q6_k(out_features, in_features, out_features)
    packed = ops.small_batch_pack_int8(weight.qweight)
    scales = ops.small_batch_pack_int8_group_scales(weight.scales)
    assert scales.dtype == torch.float32
    factored = factored_int8_scales(scales)
    assert factored.dtype == torch.int8 and factored.shape == (scales.shape[0], in_features // 256, 576)
    assert factored.numel() * 8 / (scales.shape[0] * 32 * in_features) == 0.5625  # bits a weight
    expected = weight.dequantize()
    assert torch.equal(ops.small_batch_dequantize_int8(packed, factored, out_features), expected)
    rows = torch.tensor([out_features - 1, 0, out_features // 2])
    assert torch.equal(
        ops.small_batch_dequantize_int8(packed, factored, out_features, rows=rows), expected[rows]
    )
    ran = 0
    for dtype in DTYPES:
        if not ops.small_batch_linear_int8_supported(dtype):
            continue
        x = torch.randn(40, in_features, generator=torch.Generator().manual_seed(3)).to(dtype)
        for count in [*range(1, 13), 40]:
            head = x[:count].contiguous()
            for entry in (ops.small_batch_linear_int8, ops.small_batch_linear_int8_float_out):
                out = entry(head, packed, factored, out_features)
                assert torch.equal(out, entry(head, packed, scales, out_features)), (dtype, count)
        ran += 1
    assert ran >= 1


@pytest.mark.parametrize(
    ("make", "stored", "bits"), [(_k_quant, torch.uint8, 4.625), (_q6_k, torch.int8, 8.5625)]
)
def test_the_layer_holds_the_factored_copy_and_its_rows(make, stored, bits):
    """RoundedInputKernel keeps the factored scales (its buffers: the codes plus 0.625 bits a weight
    for Q4_K, 0.5625 for Q6_K) and gives the format's weight and rows."""
    weight = make(64, 512, 3)
    kernel = RoundedInputKernel(weight, torch.bfloat16)
    assert kernel.small_batch_scales.dtype == stored
    held = sum(buffer.numel() * buffer.element_size() for buffer in kernel.buffers())
    assert held * 8 / weight.qweight.numel() == bits
    assert torch.equal(kernel.dequantize(torch.float32), weight.dequantize())
    index = torch.tensor([[5, 63], [0, 5]])
    assert torch.equal(kernel.weight_rows(index), weight.dequantize()[index])


def test_int8_scales_that_do_not_factor_stay_as_packed():
    """RTN's group-of-16 scales (no float16 factor holds them) and float16 ones stay as packed."""
    rtn = quantize_int8(torch.randn(40, 512, generator=torch.Generator().manual_seed(2)), 16)
    assert RoundedInputKernel(rtn, torch.bfloat16).small_batch_scales.dtype == torch.float32
    half = Int8Weight(rtn.qweight, rtn.scales.half().float(), 16)
    assert RoundedInputKernel(half, torch.bfloat16).small_batch_scales.dtype == torch.float16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("make", "stored"), [(_k_quant, torch.uint8), (_q6_k, torch.int8)], ids=["q4_k", "q6_k"]
)
def test_grouped_experts_read_factored_scales(dtype, make, stored):
    """A mixture-of-experts projection whose experts are Q4_K-like (Q6_K-like): the stack keeps their
    factored scales, each expert's rows get what its own kernel gives them (an expert with none too),
    and a factored expert beside an RTN one (float32 scales) runs expert by expert."""
    weights = [make(70, 512, seed) for seed in range(4)]
    kernels = [RoundedInputKernel(weight, dtype) for weight in weights]
    if not kernels[0].takes(dtype):
        pytest.skip(f"this level's kernels do not take {dtype} inputs")
    alone = [RoundedInputKernel(weight, dtype) for weight in weights]
    grouped = GroupedExpertsKernel.of(kernels)
    assert grouped is not None and grouped.scales.dtype == stored
    counts = [3, 0, 1, 5]
    x = torch.randn(sum(counts), 512, generator=torch.Generator().manual_seed(9)).to(dtype)
    out = grouped(x, torch.tensor(counts).cumsum(0))
    ends = torch.tensor(counts).cumsum(0).tolist()
    for kernel, start, end in zip(alone, [0, *ends], ends, strict=False):
        assert end == start or torch.equal(out[start:end], kernel(x[start:end]))
    rtn = (
        quantize_int4(torch.randn(70, 512), 32)
        if stored == torch.uint8
        else quantize_int8(torch.randn(70, 512), 16)
    )
    mixed = [RoundedInputKernel(weights[0], dtype), RoundedInputKernel(rtn, dtype)]
    assert GroupedExpertsKernel.of(mixed) is None


def test_an_all_zero_expert_joins_its_factored_siblings():
    """An expert whose parameters are all zero (float16 exact, so the packer keeps them so) beside
    Q4_K-like experts is factored too: the stack keeps one layout and its rows give zeros."""
    weights = [_k_quant(70, 512, seed) for seed in range(2)]
    zero = Int4Weight(
        weights[0].qweight, torch.zeros_like(weights[0].scales), torch.zeros_like(weights[0].offsets), 32
    )
    kernels = [RoundedInputKernel(weight, torch.bfloat16) for weight in [*weights, zero]]
    assert kernels[2].small_batch_scales.dtype == torch.float16
    grouped = GroupedExpertsKernel.of(kernels)
    assert grouped is not None and grouped.scales.dtype == torch.uint8
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out = grouped(x, torch.tensor([1, 2, 3]))
    assert torch.equal(
        out[:2],
        torch.cat([RoundedInputKernel(w, torch.bfloat16)(x[i : i + 1]) for i, w in enumerate(weights)]),
    )
    assert not out[2].any()
