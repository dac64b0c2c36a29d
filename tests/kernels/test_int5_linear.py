"""The int4 kernels' 5-bit variant (GGUF Q5_0: codes 0..31 packed as int4's nibbles plus a plane of
fifth bits, kernels/csrc/linear_quantized.cpp) against a float64 reference of the same rounded input
and dequantized weight, at every row count; each row's output independent of the rows around it."""

import pytest
import torch

from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.quantization.formats import Int4Weight
from llmserve.quantization.kernels import RoundedInputKernel
from tests.kernels.test_small_batch_linear import _rounded_input

ops = load_cpu_ops()
pytestmark = pytest.mark.cpu_kernels("int8_linear")
DTYPES = [torch.bfloat16, torch.float32]  # float32: where the level's kernels take it (AVX2)


def _q5_0(out_features: int, in_features: int, seed: int, group: int = 32) -> Int4Weight:
    """A GGUF Q5_0-like weight: codes 0..31, float16 scales d, offsets -16 d (exact in float16 too)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 32, (out_features, in_features), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out_features, in_features // group, generator=gen) * 0.02 + 1e-3).half().float()
    return Int4Weight(codes, scales, -16 * scales, group, bits=5)


def _pack(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.small_batch_pack_int4(weight.qweight, weight.scales, weight.offsets, bits=5)


def _reference(x: torch.Tensor, weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rounded input times W in float64, the same product's magnitude)."""
    w = weight.dequantize(torch.float64)
    rounded, _ = _rounded_input(x)
    return rounded @ w.T, rounded.abs() @ w.abs().T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("out_features", "in_features", "group"), [(45, 576, 32), (7, 64, 32), (70, 1536, 64), (33, 32, 32)]
)
def test_five_bit_matches_its_rounded_input_reference_at_every_row_count(
    dtype, out_features, in_features, group
):
    """Every row count 1..40 and a large one, odd output sizes (padded 32-row blocks), groups of 32
    (Q5_0's) and 64; float16 parameters (a GGUF file's)."""
    if not ops.small_batch_linear_int8_supported(dtype):
        pytest.skip(f"this level's kernels do not take {dtype} inputs")
    weight = _q5_0(out_features, in_features, out_features + in_features, group)
    packed, params = _pack(weight)
    padded = -(-out_features // 32) * 32
    assert packed.shape == (padded, in_features * 5 // 8) and params.dtype == torch.float16
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(group)).to(dtype)
    x[0, :32] = 0  # an all-zero input block: scale 0
    expected, magnitude = _reference(x, weight)  # each row rounded on its own: slices hold per row
    relative = 2**-8 if dtype == torch.bfloat16 else 0.0  # bf16 out: the final rounding
    for rows in [*range(1, 41), 300]:
        actual = ops.small_batch_linear_int4(x[:rows].contiguous(), packed, params, out_features)
        assert actual.dtype == dtype and actual.shape == (rows, out_features)
        bound = relative * expected[:rows].abs() + 1e-5 * magnitude[:rows]
        assert ((actual.double() - expected[:rows]).abs() <= bound).all(), rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_output_does_not_depend_on_the_rows_around_it(dtype):
    if not ops.small_batch_linear_int8_supported(dtype):
        pytest.skip(f"this level's kernels do not take {dtype} inputs")
    weight = _q5_0(100, 576, 5)
    packed, params = _pack(weight)
    x = torch.randn(43, 576, generator=torch.Generator().manual_seed(6)).to(dtype)
    together = ops.small_batch_linear_int4(x, packed, params, 100)
    for row in range(43):
        alone = ops.small_batch_linear_int4(x[row : row + 1].contiguous(), packed, params, 100)
        assert torch.equal(alone[0], together[row])
    shuffled = torch.randperm(43, generator=torch.Generator().manual_seed(7))
    assert torch.equal(
        ops.small_batch_linear_int4(x[shuffled].contiguous(), packed, params, 100), together[shuffled]
    )
    assert torch.equal(  # the same rows beside other ones
        ops.small_batch_linear_int4(torch.cat([x[:3], torch.randn(2, 576).to(dtype)]), packed, params, 100)[
            :3
        ],
        together[:3],
    )


def test_codes_below_16_give_the_int4_kernels_outputs():
    """A 5-bit weight whose fifth bits are all zero is an int4 weight: the same outputs bit for bit,
    and float32 parameters (inexact in float16) give the float32 path's."""
    weight = _q5_0(70, 576, 8)
    weight.qweight &= 0x0F
    weight.offsets += 1e-7  # not exact in float16: float32 parameters
    packed, params = _pack(weight)
    int4_packed, int4_params = ops.small_batch_pack_int4(weight.qweight, weight.scales, weight.offsets)
    assert params.dtype == torch.float32 and torch.equal(params, int4_params)
    blocks = packed.view(3, -1)  # 3 blocks of 32 rows: each one's nibbles, then its (zero) fifth bits
    assert torch.equal(blocks[:, : 32 * 288], int4_packed.view(3, -1)) and not blocks[:, 32 * 288 :].any()
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(9)).bfloat16()
    assert torch.equal(
        ops.small_batch_linear_int4(x, packed, params, 70),
        ops.small_batch_linear_int4(x, int4_packed, int4_params, 70),
    )


@pytest.mark.parametrize(("out_features", "group"), [(70, 32), (64, 64), (33, 32)])
def test_packed_weights_read_back_as_the_weights_they_hold(out_features, group):
    """small_batch_dequantize_int4(bits=5) and RoundedInputKernel's dequantize and weight_rows give
    Int4Weight.dequantize's values bit for bit (float16 and float32 parameters)."""
    weight = _q5_0(out_features, 192, out_features, group)
    for offsets in (weight.offsets, weight.offsets + 1e-7):
        exact = Int4Weight(weight.qweight, weight.scales, offsets, group, bits=5)
        packed, params = _pack(exact)
        expected = exact.dequantize()
        assert torch.equal(ops.small_batch_dequantize_int4(packed, params, out_features, bits=5), expected)
    kernel = RoundedInputKernel(weight, torch.bfloat16)
    assert torch.equal(kernel.dequantize(torch.float32), weight.dequantize())
    index = torch.tensor([[0, out_features - 1, 31], [32, 5, 0]])
    assert torch.equal(kernel.weight_rows(index), weight.dequantize()[index])


def test_packing_checks_the_codes_width():
    codes = torch.full((8, 64), 31, dtype=torch.uint8)
    ones, zeros = torch.ones(8, 2), torch.zeros(8, 2)
    with pytest.raises(RuntimeError, match=r"5-bit codes must lie in \[0, 31\]"):
        ops.small_batch_pack_int4(codes + 1, ones, zeros, bits=5)
    with pytest.raises(RuntimeError, match=r"int4 codes must lie in \[0, 15\]"):
        ops.small_batch_pack_int4(codes, ones, zeros)
    with pytest.raises(RuntimeError, match="4- or 5-bit"):
        ops.small_batch_pack_int4(codes, ones, zeros, bits=6)
    packed, params = ops.small_batch_pack_int4(codes, ones, zeros, bits=5)
    with pytest.raises(RuntimeError, match="packed by small_batch_pack_int4"):  # a width neither layout has
        ops.small_batch_linear_int4(torch.ones(1, 96).bfloat16(), packed, params, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_codes_and_inputs_do_not_overflow_the_sums(dtype, sign):
    """Every code 31 against inputs that round to +-127 everywhere: the AVX2 level's int16 pair sums
    at their largest (widened to int32 every chunk), exact against the reference."""
    if not ops.small_batch_linear_int8_supported(dtype):
        pytest.skip(f"this level's kernels do not take {dtype} inputs")
    scales = torch.full((64, 1536 // 32), 2.0**-6)
    weight = Int4Weight(torch.full((64, 1536), 31, dtype=torch.uint8), scales, -16 * scales, 32, bits=5)
    packed, params = _pack(weight)
    x = torch.full((3, 1536), sign).to(dtype)
    expected, magnitude = _reference(x, weight)
    actual = ops.small_batch_linear_int4(x, packed, params, 64)
    relative = 2**-8 if dtype == torch.bfloat16 else 0.0
    assert ((actual.double() - expected).abs() <= relative * expected.abs() + 1e-5 * magnitude).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_q5_k_blocks_run_the_five_bit_kernel_at_every_row_count(dtype):
    """GGUF Q5_K read natively (5-bit codes, float32 scale d * sc and offset -dmin * m per 32 columns,
    quantization/gguf_native.py) through RoundedInputKernel: its rounded-input reference at 1-9 rows
    and a batch, a row's output independent of the rows beside it."""
    import numpy as np

    from llmserve.quantization import gguf_native

    if not ops.small_batch_linear_int8_supported(dtype):
        pytest.skip(f"this level's kernels do not take {dtype} inputs")
    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, (45, 2, 176), dtype=np.uint8)
    blocks[..., :4] = rng.uniform(1e-4, 3e-3, (45, 2, 2)).astype(np.float16).view(np.uint8)
    weight = gguf_native._READERS["Q5_K"](blocks)
    kernel = RoundedInputKernel(weight, dtype)
    assert kernel.bits == 5 and kernel.takes(dtype)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(12)).to(dtype)
    expected, magnitude = _reference(x, weight)
    relative = 2**-8 if dtype == torch.bfloat16 else 0.0
    together = kernel(x)
    for rows in [*range(1, 10), 40]:
        actual = kernel(x[:rows])
        bound = relative * expected[:rows].abs() + 1e-5 * magnitude[:rows]
        assert ((actual.double() - expected[:rows]).abs() <= bound).all(), rows
        assert torch.equal(actual, together[:rows])
