"""The AMX linear kernel (rows above 8, on the small-batch kernel's packed weight) against float64."""

import pytest
import torch

from llmserve.kernels.cpu_ops import load_cpu_ops

ops = load_cpu_ops()
pytestmark = pytest.mark.cpu_kernels("amx_bf16")


def _exact_and_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    """x W^T + bias in float64 (bf16 products are exact), and the float32 sums' error bound."""
    exact = x.double() @ w.double().T
    if bias is not None:
        exact = exact + bias.double()
    magnitude = x.double().abs() @ w.double().abs().T
    return exact, magnitude


@pytest.mark.parametrize("rows", [9, 15, 16, 17, 31, 32, 33, 64, 255, 256, 257, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (13, 64), (45, 1536), (576, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    packed = ops.small_batch_pack(w)
    exact, magnitude = _exact_and_bound(x, w, bias)
    sums = ops.amx_linear(x, packed, bias, out_features, True)
    assert sums.dtype == torch.float32 and sums.shape == (rows, out_features)
    assert ((sums.double() - exact).abs() <= 1e-5 * magnitude + 1e-6).all()
    rounded = ops.amx_linear(x, packed, bias, out_features)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, sums.bfloat16())  # the same sums, rounded once


def test_a_row_does_not_depend_on_the_others():
    """Each 32-row block and the zero-padded tail compute a row alike: a row alone gives its bits."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 576, generator=gen).bfloat16()
    packed = ops.small_batch_pack((torch.randn(960, 576, generator=gen) * 0.05).bfloat16())
    together = ops.amx_linear(x, packed, None, 960, True)
    for first, count in [(0, 9), (5, 16), (40, 33), (280, 20), (299, 1)]:
        part = ops.amx_linear(x[first : first + count].contiguous(), packed, None, 960, True)
        assert torch.equal(part, together[first : first + count])


def test_bad_arguments_are_refused_with_a_message():
    packed = ops.small_batch_pack(torch.zeros(64, 64).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_linear(torch.zeros(9, 64), packed, None, 64)
    with pytest.raises(RuntimeError, match="packed by small_batch_pack"):
        ops.amx_linear(torch.zeros(9, 64).bfloat16(), packed, None, 100)
    with pytest.raises(RuntimeError, match="out_features values"):
        ops.amx_linear(torch.zeros(9, 64).bfloat16(), packed, torch.zeros(3), 64)
