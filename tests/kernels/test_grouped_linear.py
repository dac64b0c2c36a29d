"""The grouped int8/int4 kernels (kernels/csrc/linear_quantized.cpp `grouped_linear_int8/int4`): one call
over a mixture-of-experts projection, each expert's rows against its own packed weights, equal bit for
bit to the one-layer kernel over those rows alone, for every packed layout the experts can have."""

import pytest
import torch

from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.quantization.formats import Int4Weight, quantize_int4, quantize_int8
from llmserve.quantization.kernels import GroupedExpertsKernel, RoundedInputKernel

ops = load_cpu_ops()
pytestmark = pytest.mark.cpu_kernels("int8_linear")
DTYPES = [torch.bfloat16, torch.float32]  # float32: where the level's kernels take it (AVX2)
IN, OUT = 96, 70  # 70 rows: three 32-row blocks, the last padded


def _five_bit(weight: torch.Tensor) -> Int4Weight:
    """GGUF Q5_0's shape of weight: codes 0..31, float16 scales d, offsets -16 d."""
    scales = (weight.view(weight.shape[0], -1, 32).abs().amax(-1) / 15 + 1e-3).half().float()
    codes = (weight.view(weight.shape[0], -1, 32) / scales[..., None] + 16).round().clamp(0, 31)
    return Int4Weight(codes.to(torch.uint8).view(weight.shape), scales, -16 * scales, 32, bits=5)


LAYOUTS = {
    "int8 per row": quantize_int8,
    "int8 g32": lambda w: quantize_int8(w, 32),
    "int8 g16": lambda w: quantize_int8(w, 16),
    "int4 g32": lambda w: quantize_int4(w, 32),
    "int4 g96": lambda w: quantize_int4(w, 96),
    "5-bit": _five_bit,
}


def _weights(layout: str, count: int = 6) -> list:
    gen = torch.Generator().manual_seed(len(layout))
    return [LAYOUTS[layout](torch.randn(OUT, IN, generator=gen)) for _ in range(count)]


def _kernels(weights: list, dtype: torch.dtype) -> list[RoundedInputKernel]:
    kernels = [RoundedInputKernel(weight, dtype) for weight in weights]
    if not kernels[0].takes(dtype):
        pytest.skip(f"this level's kernels do not take {dtype} inputs")
    return kernels


def _experts(layout: str, dtype: torch.dtype, count: int = 6) -> list[RoundedInputKernel]:
    return _kernels(_weights(layout, count), dtype)


def _assert_rows_equal_alone(grouped, alone: list[RoundedInputKernel], counts: list[int], dtype) -> None:
    """grouped's output for random rows, counts[e] of them to expert e, equals each expert's own
    kernel (built apart from the stack) over its rows, and over a row alone."""
    x = torch.randn(sum(counts), IN, generator=torch.Generator().manual_seed(7)).to(dtype)
    x[0, :32] = 0  # an all-zero input block: scale 0
    out = grouped(x, torch.tensor(counts).cumsum(0))
    assert out.dtype == dtype and out.shape == (len(x), OUT)
    start = 0
    for kernel, count in zip(alone, counts, strict=True):
        rows = slice(start, start + count)
        if count:
            assert torch.equal(out[rows], kernel(x[rows])), start
            assert torch.equal(out[start : start + 1], kernel(x[start : start + 1]))
        start += count


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("counts", [[3, 0, 9, 1, 0, 5], [0, 0, 1, 0, 0, 0], [40, 2, 0, 0, 7, 1]])
def test_each_experts_rows_equal_its_own_kernel_alone(layout, dtype, counts):
    """Experts with no rows, one row, and more than the kernels' 4-row passes; every row equals the
    one-layer kernel over its expert's rows (which is batch invariant: so does one row alone)."""
    weights = _weights(layout)
    kernels = _kernels(weights, dtype)
    grouped = GroupedExpertsKernel.of(kernels)
    assert grouped is not None
    for kernel in kernels:  # each expert's kernel now reads its slice of the stack
        assert kernel.small_batch_qweight.untyped_storage().data_ptr() == grouped.qweight.data_ptr()
    _assert_rows_equal_alone(grouped, _kernels(weights, dtype), counts, dtype)
    _assert_rows_equal_alone(GroupedExpertsKernel.of(kernels), kernels, counts, dtype)  # the views too


def test_experts_whose_scales_differ_in_dtype_stack_in_float32():
    """Scales are float16 where exact for every value of an expert: experts of one layer may differ,
    and then all stack in float32, exactly."""
    weights = _weights("int4 g32", 4)
    exact = weights[1]
    weights[1] = Int4Weight(exact.qweight, exact.scales.half().float(), exact.offsets.half().float(), 32)
    kernels = _kernels(weights, torch.bfloat16)
    assert {k.small_batch_scales.dtype for k in kernels} == {torch.float16, torch.float32}
    grouped = GroupedExpertsKernel.of(kernels)
    assert grouped is not None and grouped.scales.dtype == torch.float32
    _assert_rows_equal_alone(grouped, _kernels(weights, torch.bfloat16), [2, 5, 0, 1], torch.bfloat16)


def test_experts_without_rows_are_never_read():
    """NaN scales on every expert no row went to leave the output finite."""
    kernels = _experts("int4 g32", torch.bfloat16)
    grouped = GroupedExpertsKernel.of(kernels)
    counts = torch.tensor([0, 4, 0, 0, 2, 0])
    grouped.scales[counts == 0] = float("nan")
    out = grouped(torch.randn(6, IN).bfloat16(), counts.cumsum(0))
    assert out.isfinite().all()


def test_no_rows_give_an_empty_output():
    """A rank under expert parallelism may get no rows at all."""
    grouped = GroupedExpertsKernel.of(_experts("int8 g32", torch.bfloat16))
    out = grouped(torch.empty(0, IN, dtype=torch.bfloat16), torch.zeros(6, dtype=torch.long))
    assert out.shape == (0, OUT)


def test_mixed_layouts_are_not_grouped():
    """A GGUF's experts of different block types (say Q4_K and Q6_K) run expert by expert."""
    mixed = _experts("int8 g32", torch.bfloat16, 2) + _experts("int8 g16", torch.bfloat16, 2)
    assert GroupedExpertsKernel.of(mixed) is None


@pytest.mark.parametrize(
    ("ends", "message"),
    [
        ([2, 1, 4, 4, 4, 4], "must not decrease"),
        ([1, 2, 3, 3, 3, 5], "last end must be x's row count"),
        ([1, 2, 4], r"ends \[E\] int64"),
    ],
)
def test_bad_ends_are_refused(ends, message):
    grouped = GroupedExpertsKernel.of(_experts("int4 g32", torch.bfloat16))
    with pytest.raises(RuntimeError, match=message):
        grouped(torch.randn(4, IN).bfloat16(), torch.tensor(ends))
