"""Round-trip error bounds of each format, kernels against their own dequantized weight, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from llmserve.config.quantization import QuantizationConfig, resolve_group_size
from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.quantization.checkpoint import load_quantized, save_quantized, save_quantized_stream
from llmserve.quantization.formats import Int8Weight, concat_rows, quantize_int4, quantize_int8
from llmserve.quantization.gptq import gptq_quantize
from llmserve.quantization.kernels import (
    Int4PackedKernel,
    Int8GroupedPackedKernel,
    Int8PackedKernel,
    RoundedInputKernel,
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


@pytest.mark.parametrize(
    ("kind", "group", "rtn"),
    [("int8", None, lambda w: quantize_int8(w)), ("int4", 32, lambda w: quantize_int4(w, 32))],
)
def test_gptq_with_uncorrelated_inputs_is_rtn(weight, kind, group, rtn):
    """A diagonal Hessian gives no column anything to compensate: GPTQ must round to nearest."""
    hessian = torch.diag(torch.rand(128) + 0.5)
    q, expected = gptq_quantize(weight, hessian, group, kind=kind), rtn(weight)
    assert type(q) is type(expected) and q.group_size == expected.group_size
    assert torch.equal(q.qweight, expected.qweight)
    torch.testing.assert_close(q.scales, expected.scales, rtol=0, atol=0)


def test_gptq_int8_per_channel_keeps_the_single_packed_call(weight):
    torch.manual_seed(1)
    x = torch.randn(512, 128) @ torch.randn(128, 128)  # correlated inputs: errors get compensated
    q = gptq_quantize(weight, 2 * x.t() @ x / 512, None, kind="int8")
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (96, 1)
    assert q.qweight.abs().max() <= 127
    kernel = select_kernel(q, torch.bfloat16, torch.device("cpu"))
    assert type(kernel) in (RoundedInputKernel, Int8PackedKernel)
    scales = kernel.small_batch_scales if type(kernel) is RoundedInputKernel else kernel.scales
    assert scales.dim() == 1  # a scale per output row
    # The objective GPTQ minimizes: the output error on its own calibration inputs.
    gptq_error = (x @ (q.dequantize() - weight).t()).pow(2).mean()
    rtn_error = (x @ (quantize_int8(weight).dequantize() - weight).t()).pow(2).mean()
    assert gptq_error < 0.8 * rtn_error


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
        (lambda w: quantize_int8(w, 16), Int8GroupedPackedKernel),  # GGUF Q6_K's groups
        (lambda w: quantize_int4(w, 32), Int4PackedKernel),
        (lambda w: quantize_int4(w, 64), Int4PackedKernel),
    ],
)
def test_packed_kernels_multiply_by_the_quantized_weight(weight, make, kernel_cls):
    """PyTorch's packed ops, where the compiled kernels do not serve: the canonical weight with scales
    (and offsets) rounded to bfloat16 once."""
    q = make(weight)
    kernel = kernel_cls(q, torch.bfloat16)
    torch.testing.assert_close(kernel.dequantize(torch.float32), q.dequantize(), rtol=0.02, atol=0.02)
    x = torch.randn(9, 128).to(torch.bfloat16)
    expected = x.double() @ kernel.dequantize(torch.float32).double().t()
    out = kernel(x)
    assert out.dtype == torch.bfloat16 and out.shape == (9, 96)
    torch.testing.assert_close(out.double(), expected, rtol=0.02, atol=0.05)


def test_int8_packed_kernel_takes_a_weight_at_an_unaligned_address(weight):
    """Checkpoints load as views into one buffer; `_weight_int8pack_mm` crashed on such a weight."""
    q = quantize_int8(weight)
    buffer = torch.zeros(q.qweight.numel() + 40, dtype=torch.int8)
    unaligned = buffer[40:].view(q.shape)
    unaligned.copy_(q.qweight)
    assert unaligned.data_ptr() % 64 != 0
    kernel = Int8PackedKernel(Int8Weight(unaligned, q.scales, q.group_size), torch.bfloat16)
    x = torch.randn(9, 128).to(torch.bfloat16)
    expected = x.double() @ kernel.dequantize(torch.float32).double().t()
    torch.testing.assert_close(kernel(x).double(), expected, rtol=0.02, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "make",
    [
        lambda w: quantize_int8(w),
        lambda w: quantize_int8(w, 32),
        lambda w: quantize_int8(w, 16),
        lambda w: quantize_int4(w, 32),
    ],
    ids=["int8", "int8-groups-of-32", "int8-groups-of-16", "int4"],
)
def test_compiled_kernels_take_every_row_count_where_the_build_takes_the_dtype(weight, make, dtype):
    """On the CPU the compiled int8/int4 kernels' packed copy is the layer's only one. Where this
    build's kernels take `dtype` inputs (bf16; float32 at the AVX2 level) they serve every row count,
    multiplying by the format's own W, the input rounded to 8 bits per 32 columns, each row as it
    would run alone; other dtypes multiply by the weight rebuilt from the packed copy."""
    q = make(weight)
    kernel = select_kernel(q, dtype, torch.device("cpu"))
    x = torch.randn(40, 128).to(dtype)
    if load_cpu_ops() is None:
        assert type(kernel) is not RoundedInputKernel
        return
    assert type(kernel) is RoundedInputKernel
    assert {name for name, _ in kernel.named_buffers()} == {"small_batch_qweight", "small_batch_scales"}
    assert torch.equal(kernel.dequantize(torch.float32), q.dequantize())
    if not kernel.takes(dtype):  # float32 where the build's kernels take bf16 only
        assert not kernel.batch_invariant
        torch.testing.assert_close(kernel(x), x @ q.dequantize().t())
        return
    assert kernel.batch_invariant
    out = kernel(x)
    assert out.dtype == dtype and out.shape == (40, 96)
    expected = x.double() @ q.dequantize().double().t()
    step = (
        x.float().view(40, -1, 32).abs().amax(dim=-1, keepdim=True).expand(40, 4, 32).reshape(40, 128) / 127
    )
    rounding = step.double() / 2 @ q.dequantize().double().abs().t()
    output_rounding = 2**-8 * expected.abs() if dtype == torch.bfloat16 else 0
    assert ((out.double() - expected).abs() <= 1e-5 + output_rounding + rounding).all()
    for first, count in [(0, 1), (3, 9), (12, 28)]:  # decode-sized and prefill-sized batches
        assert torch.equal(kernel(x[first : first + count]), out[first : first + count])
    if dtype == torch.float32 or q.kind == "int8":  # an output projection's logits: the same sums, unrounded
        logits = kernel.logits(x)
        assert logits.dtype == torch.float32 and torch.equal(logits.to(dtype), out)


def test_checkpoint_round_trip(tmp_path, weight):
    weights = {"a": quantize_int4(weight, 32), "b": quantize_int8(weight)}
    save_quantized(str(tmp_path), weights, {"method": "int4"}, {"norm.weight": torch.ones(4)})
    loaded, floats, info = load_quantized(str(tmp_path))
    assert info["method"] == "int4" and torch.equal(floats["norm.weight"], torch.ones(4))
    for name, original in weights.items():
        assert type(loaded[name]) is type(original) and loaded[name].group_size == original.group_size
        assert torch.equal(loaded[name].dequantize(), original.dequantize())


def test_a_streamed_checkpoint_is_written_in_files_as_its_weights_come(tmp_path, weight):
    """`save_quantized_stream` writes (name, weight) pairs as a generator makes them, a file whenever
    about `shard_bytes` have gathered (the generator is never run ahead), and reads back equal."""
    weights = {f"layer{i}": quantize_int4(weight, 32) if i % 2 else quantize_int8(weight) for i in range(5)}
    made = []

    def pairs():
        for name, original in weights.items():
            made.append((name, len(list(tmp_path.glob("*.safetensors")))))  # files written before it
            yield name, original

    one = sum(t.numel() * t.element_size() for t in (weights["layer0"].qweight, weights["layer0"].scales))
    save_quantized_stream(str(tmp_path), pairs(), {"method": "gguf-native"}, shard_bytes=one)
    info = json.loads((tmp_path / "quantization.json").read_text())
    assert len(info["files"]) == 5 and sorted(p.name for p in tmp_path.glob("*.safetensors")) == info["files"]
    loaded, floats, _ = load_quantized(str(tmp_path))
    assert made == [(name, i) for i, name in enumerate(weights)]  # each file written before the next pair
    assert sorted(loaded) == sorted(weights) and not floats
    for name, original in weights.items():
        assert type(loaded[name]) is type(original) and torch.equal(
            loaded[name].dequantize(), original.dequantize()
        )


def test_a_streamed_cache_entry_is_read_back_and_a_bad_tensor_is_raised_once(tmp_path, weight, monkeypatch):
    """`methods._cached` writes a source's pairs into the weights cache as they come and serves what it
    wrote; an error of the source itself (a bad tensor) is raised as it is, after one pass over the
    source, not taken for an unwritable cache."""
    from types import SimpleNamespace

    from llmserve.quantization import methods

    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"not read")
    config = SimpleNamespace(path=str(source))
    weights = {"a": quantize_int4(weight, 32), "b": quantize_int8(weight)}
    passes = []

    def good():
        passes.append("good")
        yield from weights.items()

    served = methods._cached(config, "entry", good)
    assert passes == ["good"] and sorted(served) == ["a", "b"]
    assert all(torch.equal(served[k].dequantize(), w.dequantize()) for k, w in weights.items())
    assert sorted(methods._cached(config, "entry", good)) == ["a", "b"] and passes == ["good"]  # a hit

    def bad():
        passes.append("bad")
        yield "a", weights["a"]
        raise ValueError("tensor b: a bad block")

    with pytest.raises(ValueError, match="a bad block"):
        methods._cached(config, "other", bad)
    assert passes == ["good", "bad"]


def test_group_size_resolution():
    assert resolve_group_size(None, (576, 1536, 576)) == 64  # SmolLM2: 128 does not divide 576
    assert resolve_group_size(None, (4096, 11008)) == 128
    assert resolve_group_size(None, (576, 1536, 576), (384, 192, 768, 768)) == 64  # SmolLM2 on 2 ranks
    assert resolve_group_size(None, (4096, 11008), (1024,) * 4 + (2752,) * 4) == 64  # 4 ranks: 2752 = 43 x 64
    with pytest.raises(ValueError, match="does not divide the layer width 576"):
        resolve_group_size(128, (576,))
    with pytest.raises(ValueError, match="must be one of"):
        resolve_group_size(48, (576,))
    with pytest.raises(ValueError, match="quantization must be one of int8, int8-rtn, int4, awq, gptq, gguf"):
        QuantizationConfig.create("int3", None, (64,))
    assert QuantizationConfig.create(None, None, (64,)) is None
