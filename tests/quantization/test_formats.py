"""Round-trip error bounds of each format, kernels against their own dequantized weight, checkpoints."""

from __future__ import annotations

import pytest
import torch

from llmserve.quantization.checkpoint import load_quantized, save_quantized
from llmserve.quantization.config import QuantizationConfig, resolve_group_size
from llmserve.quantization.formats import concat_rows, quantize_int4, quantize_int8
from llmserve.quantization.kernels import (
    DequantizeKernel,
    Int4PackedKernel,
    Int8GroupedPackedKernel,
    Int8PackedKernel,
    select_kernel,
)


@pytest.fixture
def weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(96, 128) * torch.rand(96, 1)  # rows of different ranges


def test_int8_round_trip_within_half_a_step(weight):
    q = quantize_int8(weight)
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (96, 1)
    error = (q.dequantize() - weight).abs()
    assert torch.all(error <= q.scales / 2 + 1e-7)
    assert torch.allclose(q.scales[:, 0], weight.abs().amax(1) / 127)


def test_int8_grouped_round_trip(weight):
    q = quantize_int8(weight, group_size=32)
    assert q.scales.shape == (96, 4)
    error = (q.dequantize() - weight).abs().view(96, 4, 32)
    assert torch.all(error <= q.scales[..., None] / 2 + 1e-7)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_within_half_a_step_and_exact_extremes(weight, group):
    q = quantize_int4(weight, group)
    assert q.qweight.max() <= 15 and q.scales.shape == (96, 128 // group)
    grouped, restored = weight.view(96, -1, group), q.dequantize().view(96, -1, group)
    assert torch.all((restored - grouped).abs() <= q.scales[..., None] / 2 + 1e-6)
    torch.testing.assert_close(restored.amin(-1), grouped.amin(-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(restored.amax(-1), grouped.amax(-1), rtol=0, atol=1e-6)


def test_concat_rows_fuses_and_refuses_mixed_formats(weight):
    a, b = quantize_int4(weight[:32], 32), quantize_int4(weight[32:], 32)
    torch.testing.assert_close(concat_rows([a, b]).dequantize(), quantize_int4(weight, 32).dequantize())
    assert concat_rows([a, quantize_int8(weight[32:])]) is None
    assert concat_rows([a, quantize_int4(weight[32:], 64)]) is None


@pytest.mark.parametrize(
    ("make", "kernel_cls"),
    [
        (lambda w: quantize_int8(w), Int8PackedKernel),
        (lambda w: quantize_int8(w, 32), Int8GroupedPackedKernel),
        (lambda w: quantize_int4(w, 32), Int4PackedKernel),
        (lambda w: quantize_int4(w, 64), Int4PackedKernel),
    ],
)
def test_packed_kernels_multiply_by_the_quantized_weight(weight, make, kernel_cls):
    q = make(weight)
    kernel = select_kernel(q, torch.bfloat16, torch.device("cpu"))
    assert type(kernel) is kernel_cls
    # The kernel's weight is the canonical one with scales (and offsets) rounded to bfloat16 once.
    torch.testing.assert_close(kernel.dequantize(torch.float32), q.dequantize(), rtol=0.02, atol=0.02)
    x = torch.randn(5, 128).to(torch.bfloat16)
    expected = x.double() @ kernel.dequantize(torch.float32).double().t()
    out = kernel(x)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 96)
    torch.testing.assert_close(out.double(), expected, rtol=0.02, atol=0.05)


def test_float32_dequantizes_on_the_fly(weight):
    q = quantize_int4(weight, 32)
    kernel = select_kernel(q, torch.float32, torch.device("cpu"))
    assert type(kernel) is DequantizeKernel
    x = torch.randn(3, 128)
    torch.testing.assert_close(kernel(x), x @ q.dequantize().t())


def test_checkpoint_round_trip(tmp_path, weight):
    weights = {"a": quantize_int4(weight, 32), "b": quantize_int8(weight)}
    save_quantized(str(tmp_path), weights, {"method": "int4"}, {"norm.weight": torch.ones(4)})
    loaded, floats, info = load_quantized(str(tmp_path))
    assert info["method"] == "int4" and torch.equal(floats["norm.weight"], torch.ones(4))
    for name, original in weights.items():
        assert type(loaded[name]) is type(original) and loaded[name].group_size == original.group_size
        assert torch.equal(loaded[name].dequantize(), original.dequantize())


def test_group_size_resolution():
    assert resolve_group_size(None, (576, 1536, 576)) == 64  # SmolLM2: 128 does not divide 576
    assert resolve_group_size(None, (4096, 11008)) == 128
    with pytest.raises(ValueError, match="does not divide the layer width 576"):
        resolve_group_size(128, (576,))
    with pytest.raises(ValueError, match="must be one of"):
        resolve_group_size(48, (576,))
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, awq, gptq, gguf"):
        QuantizationConfig.create("int3", None, (64,))
    assert QuantizationConfig.create(None, None, (64,)) is None
