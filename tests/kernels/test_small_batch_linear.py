"""The small-batch bf16 linear kernel against F.linear, and the module swap that uses it."""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.kernels.small_batch_linear import (
    AMX_MAX_ROWS,
    MAX_ROWS,
    LogitsLinear,
    SmallBatchLinear,
    use_small_batch_linear,
)
from llmserve.models.layers.lm_head import LMHead
from llmserve.quantization.formats import Int4Weight, Int8Weight

ops = load_cpu_ops()
pytestmark = pytest.mark.cpu_kernels("bf16_linear")


@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (13, 64), (3, 1536), (49152, 576)])
def test_matches_float64_reference(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    exact = (
        x.double() @ w.double().T
    )  # bf16 products are exact; only the float32 sums and the final rounding differ
    actual = ops.small_batch_linear(x, ops.small_batch_pack(w), out_features)
    assert actual.dtype == torch.bfloat16 and actual.shape == (rows, out_features)
    bound = 2**-8 * exact.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert ((actual.double() - exact).abs() <= bound).all()
    # and within rounding of torch's own bf16 linear
    torch.testing.assert_close(actual.float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)


def test_a_row_does_not_depend_on_the_others():
    """Verifying drafts (several rows) or a decode batch (tiles of 8 rows) must give each row the bits
    that decoding it alone gives; and the bf16 output is the float32 variant's sums rounded."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(43, 576, generator=gen).bfloat16()
    w = ops.small_batch_pack((torch.randn(100, 576, generator=gen) * 0.05).bfloat16())
    together = ops.small_batch_linear(x, w, 100)
    for row in range(43):
        assert torch.equal(ops.small_batch_linear(x[row : row + 1], w, 100)[0], together[row])
    assert torch.equal(together, ops.small_batch_linear_float_out(x, w, 100).bfloat16())


def test_rejects_what_it_does_not_serve():
    w = ops.small_batch_pack(torch.randn(8, 64).bfloat16())
    with pytest.raises(RuntimeError, match="at least 1 row"):
        ops.small_batch_linear(torch.randn(0, 64).bfloat16(), w, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.small_batch_pack(torch.randn(8, 48).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.small_batch_linear(torch.randn(1, 64), w, 8)
    with pytest.raises(RuntimeError, match="packed by small_batch_pack"):
        ops.small_batch_linear(torch.randn(1, 64).bfloat16(), torch.randn(8, 64).bfloat16(), 8)


def test_module_swap_keeps_tied_weights_and_frees_the_others():
    """A swapped layer's packed copies take every row count, so the checkpoint's weight is freed
    unless another module shares it (the tied head's, which the embedding looks rows up in)."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"embed": nn.Embedding(100, 64), "proj": nn.Linear(64, 96, bias=True), "odd": nn.Linear(40, 8)}
    ).bfloat16()
    head = nn.Linear(64, 100, bias=False).bfloat16()
    head.weight = model["embed"].weight  # tied, as in small Llamas
    model["head"] = head
    reference = {name: module for name, module in model.items()}
    x = torch.randn(4, 64).bfloat16()
    before = F.linear(x, model["proj"].weight, model["proj"].bias)
    assert use_small_batch_linear(model) == 2  # "odd" (40 inputs) stays a plain nn.Linear
    assert type(model["proj"]) is SmallBatchLinear and type(model["odd"]) is nn.Linear
    assert model["head"].weight is model["embed"].weight
    assert all(model[name] is module for name, module in reference.items())
    assert model["proj"].weight is None  # its packed copies take every row count
    assert "proj.weight" not in dict(model.named_parameters())
    torch.testing.assert_close(model["proj"](x).float(), before.float(), atol=3e-2, rtol=2e-2)
    assert model["proj"](x[:0]).shape == (0, 96)


@pytest.mark.parametrize("rows", [9, 40, 256, 700])
def test_without_amx_every_row_count_runs_the_kernel_a_row_as_it_runs_alone(rows):
    """Without AMX the kernel takes every row count (decode batches and prompt chunks) on the layer's
    only copy (no oneDNN copy, the weight freed): each row gets the bits it gets decoded alone, within
    bf16 rounding of F.linear; a batch dimension passes through."""
    torch.manual_seed(rows)
    model = _model_with_a_tied_linear()
    weight = model["proj"].weight.detach().clone()
    assert use_small_batch_linear(model, amx=False) == 2
    layer = model["proj"]
    assert layer.kernel_max_rows == sys.maxsize and layer.packed_weight is None and layer.weight is None
    assert model["head"].packed_weight is None and model["head"].weight is model["embed"].weight
    x = torch.randn(rows, 64).bfloat16()
    out = layer(x)
    assert torch.equal(out[rows // 2], layer(x[rows // 2 : rows // 2 + 1])[0])
    assert torch.equal(
        out, ops.small_batch_linear(x, layer.small_batch_weight, layer.out_features) + layer.bias
    )
    torch.testing.assert_close(out, F.linear(x, weight, layer.bias), atol=3e-2, rtol=2e-2)
    assert torch.equal(layer(x[None]), out[None])


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 17, 64, 130])
@pytest.mark.parametrize(("out_features", "in_features"), [(49152, 576), (13, 64), (100, 1536)])
def test_float_out_keeps_the_float32_sums_at_any_row_count(rows, out_features, in_features):
    """The logits variant: the same products and float32 sums, not rounded to bf16, for any rows."""
    gen = torch.Generator().manual_seed(rows * 5 + out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    actual = ops.small_batch_linear_float_out(x, ops.small_batch_pack(w), out_features)
    assert actual.dtype == torch.float32 and actual.shape == (rows, out_features)
    exact = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T)  # float32 summation error only
    assert ((actual.double() - exact).abs() <= bound).all()


def test_float_out_rows_do_not_depend_on_the_others_and_round_to_the_bf16_kernel():
    """Decode (1 row), verification (a few) and a batch (tiles of 8) give a row the same logits, and
    up to 8 rows those logits rounded are the bf16 kernel's output."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(37, 576, generator=gen).bfloat16()
    w = ops.small_batch_pack((torch.randn(300, 576, generator=gen) * 0.05).bfloat16())
    together = ops.small_batch_linear_float_out(x, w, 300)
    for first, count in [(0, 1), (3, 5), (8, 8), (13, 24), (36, 1)]:
        part = ops.small_batch_linear_float_out(x[first : first + count].contiguous(), w, 300)
        assert torch.equal(part, together[first : first + count])
    assert torch.equal(ops.small_batch_linear(x[:8].contiguous(), w, 300), together[:8].bfloat16())


@pytest.mark.parametrize("out_features", [8208, 8200])
def test_float_out_streamed_past_the_caches_is_what_a_row_alone_gets(out_features):
    """Above 1 MiB the logits bypass the cache (aligned rows only: 8,208 columns are, 8,200 are not);
    every row, the partial last block's included, holds what computing it alone (cached) gives."""
    gen = torch.Generator().manual_seed(out_features)
    x = torch.randn(40, 576, generator=gen).bfloat16()
    w = ops.small_batch_pack((torch.randn(out_features, 576, generator=gen) * 0.05).bfloat16())
    together = ops.small_batch_linear_float_out(x, w, out_features)
    assert together.numel() * 4 > 1 << 20
    for row in (0, 17, 39):
        assert torch.equal(
            ops.small_batch_linear_float_out(x[row : row + 1].contiguous(), w, out_features),
            together[row : row + 1],
        )


def test_output_projection_becomes_logits_linear_and_writes_float32():
    torch.manual_seed(1)
    model = nn.ModuleDict({"embed": nn.Embedding(100, 64), "proj": nn.Linear(64, 96)}).bfloat16()
    head = LMHead(64, 100, bias=False).bfloat16()
    head.weight = model["embed"].weight  # tied
    model["head"] = head
    odd = LMHead(40, 10, bias=False).bfloat16()  # an input width the kernel does not take
    model["odd"] = odd
    assert use_small_batch_linear(model) == 2
    assert type(model["head"]) is LogitsLinear and model["head"].weight is model["embed"].weight
    assert getattr(model["head"], "packed_weight", None) is None  # no oneDNN copy for the head
    empty = model["head"](torch.randn(0, 64).bfloat16())  # a step with no row to score
    assert empty.shape == (0, 100) and empty.dtype == torch.float32
    assert type(model["odd"]) is LMHead
    for rows in (1, 8, 9, 50):
        x = torch.randn(rows, 64).bfloat16()
        logits = model["head"](x)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, x.float() @ model["embed"].weight.float().T, atol=1e-5, rtol=1e-5)
    x = torch.randn(3, 40).bfloat16()
    assert model["odd"](x).dtype == torch.float32  # the fallback multiplies in float32
    torch.testing.assert_close(model["odd"](x), x.float() @ odd.weight.float().T)


def _model_with_a_tied_linear() -> nn.ModuleDict:
    model = nn.ModuleDict({"embed": nn.Embedding(200, 64), "proj": nn.Linear(64, 96, bias=True)}).bfloat16()
    head = nn.Linear(64, 200, bias=False).bfloat16()
    head.weight = model["embed"].weight
    model["head"] = head
    return model


@pytest.mark.cpu_kernels("amx_bf16")
@pytest.mark.parametrize("rows", [9, 64, 300, AMX_MAX_ROWS, AMX_MAX_ROWS + 1])
def test_with_amx_rows_above_8_run_on_the_kernels_own_copy_up_to_amx_max_rows(rows):
    """With AMX, 9 to AMX_MAX_ROWS rows run amx_linear on the small-batch layout, within bf16 rounding
    of F.linear; more rows run oneDNN on its copy (exactly F.linear)."""
    torch.manual_seed(rows)
    model = _model_with_a_tied_linear()
    weights = {name: model[name].weight.detach().clone() for name in ("proj", "head")}
    assert use_small_batch_linear(model) == 2
    x = torch.randn(rows, 64).bfloat16()
    for name in ("proj", "head"):
        layer = model[name]
        assert layer.amx and layer.packed_weight is not None, name
        out = layer(x)
        if rows <= AMX_MAX_ROWS:
            amx = ops.amx_linear(x, layer.small_batch_weight, layer.bias, layer.out_features)
            assert torch.equal(out, amx), name
            torch.testing.assert_close(out, F.linear(x, weights[name], layer.bias), atol=2e-2, rtol=2e-2)
        else:
            assert torch.equal(out, F.linear(x, weights[name], layer.bias)), name
    assert torch.equal(model["proj"](x[None]), model["proj"](x)[None])  # a batch dimension passes through


def _rounded_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 kernel's input, emulated: each row in blocks of 32 columns rounded to 8-bit codes
    with scale max|x| / 127 (float32 arithmetic, round half to even), back in float64; and each
    element's rounding step (its block's scale)."""
    blocks = x.float().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    rounded = (torch.round(blocks * inverse).double() * scale.double()).view(x.shape)
    return rounded, scale.double().expand_as(blocks).reshape(x.shape)


@pytest.mark.cpu_kernels("int8_linear")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 37])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (7, 32), (576, 1536), (45, 64)])
def test_int8_matches_its_rounded_input_reference(rows, out_features, in_features):
    """Exact int32 block sums of the 8-bit input codes times the weight codes, scaled: within float32
    accumulation and the final bf16 rounding of the emulated product; and close to the exact one."""
    gen = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    x[0, :32] = 0  # an all-zero block has scale 0
    codes = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = torch.rand(out_features, generator=gen) * 0.01 + 1e-4
    rounded, step = _rounded_input(x)
    expected = (rounded @ codes.double().T) * scales.double()
    actual = ops.small_batch_linear_int8(x, ops.small_batch_pack_int8(codes), scales, out_features)
    assert actual.dtype == torch.bfloat16 and actual.shape == (rows, out_features)
    magnitude = (x.double().abs() @ codes.double().abs().T) * scales.double()
    assert ((actual.double() - expected).abs() <= 2**-8 * expected.abs() + 1e-5 * magnitude).all()
    # without the input rounding: off by at most half a step per input element
    exact = (x.double() @ codes.double().T) * scales.double()
    rounding = (step / 2 @ codes.double().abs().T) * scales.double()
    assert ((actual.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-5 * magnitude + rounding).all()
    # rows are independent of one another
    assert torch.equal(
        ops.small_batch_linear_int8(x[-1:], ops.small_batch_pack_int8(codes), scales, out_features)[0],
        actual[-1],
    )


@pytest.mark.cpu_kernels("int8_linear")
@pytest.mark.parametrize("rows", [1, 4, 6, 37])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size"),
    [(960, 576, 64), (7, 64, 32), (576, 1536, 128), (40, 256, 256)],
)
def test_int4_matches_its_rounded_input_reference(rows, out_features, in_features, group_size):
    """W = q * scale + offset per (row, group of columns), times the input rounded to 8 bits per 32
    columns: within float32 sums and the final bf16 rounding of the emulated product."""
    gen = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    groups = in_features // group_size
    scales = torch.rand(out_features, groups, generator=gen) * 0.02 + 1e-3
    offsets = -8 * scales + torch.randn(out_features, groups, generator=gen) * 1e-3
    weight = (
        codes.double().view(out_features, groups, -1) * scales.double()[..., None]
        + offsets.double()[..., None]
    )
    weight = weight.view(out_features, in_features)
    packed, params = ops.small_batch_pack_int4(codes, scales, offsets)
    actual = ops.small_batch_linear_int4(x, packed, params, out_features)
    assert actual.dtype == torch.bfloat16 and actual.shape == (rows, out_features)
    rounded, _ = _rounded_input(x)
    expected = rounded @ weight.T
    magnitude = rounded.abs() @ weight.abs().T
    assert ((actual.double() - expected).abs() <= 2**-8 * expected.abs() + 1e-5 * magnitude).all()
    assert torch.equal(ops.small_batch_linear_int4(x[-1:], packed, params, out_features)[0], actual[-1])


@pytest.mark.cpu_kernels("int8_linear")
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize(("out_features", "in_features"), [(576, 1536), (45, 64)])
@pytest.mark.parametrize("group", [32, 16])
def test_int8_with_a_scale_per_group_of_columns(rows, out_features, in_features, group):
    """GGUF Q8_0's and Q5_0's layout (a scale per 32 columns) and Q6_K's (per 16): the rounded input
    times codes scaled per (row, group)."""
    gen = torch.Generator().manual_seed(rows * 3 + out_features + group)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    codes = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = torch.rand(out_features, in_features // group, generator=gen) * 0.01 + 1e-4
    weight = (codes.double().view(out_features, -1, group) * scales.double()[..., None]).view(
        out_features, in_features
    )
    packed_scales = ops.small_batch_pack_int8_group_scales(scales)
    actual = ops.small_batch_linear_int8(x, ops.small_batch_pack_int8(codes), packed_scales, out_features)
    rounded, _ = _rounded_input(x)
    expected = rounded @ weight.T
    magnitude = rounded.abs() @ weight.abs().T
    assert ((actual.double() - expected).abs() <= 2**-8 * expected.abs() + 1e-5 * magnitude).all()


@pytest.mark.cpu_kernels("int8_linear")
def test_quantized_input_edge_cases_zero_tiny_and_nan_blocks():
    """An all-zero or denormal-sized input block contributes nothing; a NaN reaches its outputs."""
    codes = torch.randint(-127, 128, (40, 96), dtype=torch.int8)
    packed, scales = ops.small_batch_pack_int8(codes), torch.rand(40) + 0.5
    x = torch.randn(3, 96).bfloat16()
    x[0, :32] = 0
    x[1, 32:64] = 1e-38  # a scale of max / 127 would have an infinite inverse
    x[2, 64] = float("nan")
    out = ops.small_batch_linear_int8(x, packed, scales, 40).double()
    rounded, _ = _rounded_input(x[:2])
    rounded[1, 32:64] = 0
    expected = (rounded @ codes.double().T) * scales.double()
    magnitude = (rounded.abs() @ codes.double().abs().T) * scales.double()
    assert ((out[:2] - expected).abs() <= 2**-8 * expected.abs() + 1e-5 * magnitude).all()
    assert out[2].isnan().all()


@pytest.mark.cpu_kernels("int8_linear")
def test_int8_rejects_what_it_does_not_serve():
    codes = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    packed = ops.small_batch_pack_int8(codes)
    with pytest.raises(RuntimeError, match="at least one row"):
        ops.small_batch_linear_int8(torch.randn(0, 64).bfloat16(), packed, torch.ones(8), 8)
    with pytest.raises(RuntimeError, match=r"\[-127, 127\]"):
        ops.small_batch_pack_int8(torch.full((8, 64), -128, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="packed by small_batch_pack_int8"):
        ops.small_batch_linear_int8(torch.randn(1, 64).bfloat16(), codes, torch.ones(8), 8)
    nibbles = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 32 columns"):
        ops.small_batch_pack_int4(nibbles, torch.ones(8, 4), torch.zeros(8, 4))
    with pytest.raises(RuntimeError, match=r"\[0, 15\]"):
        ops.small_batch_pack_int4(nibbles + 16, torch.ones(8, 2), torch.zeros(8, 2))
    packed, params = ops.small_batch_pack_int4(nibbles, torch.ones(8, 2), torch.zeros(8, 2))
    with pytest.raises(RuntimeError, match="packed by small_batch_pack_int4"):
        ops.small_batch_linear_int4(torch.randn(1, 64).bfloat16(), packed, params, 40)


@pytest.mark.cpu_kernels("int8_linear")
@pytest.mark.parametrize("grouped", [False, True])
def test_int8_float_out_serves_any_rows_and_rounds_to_the_bf16_kernel(grouped):
    """A quantized output projection's logits: the int8 kernel's float32 sums at any row count, each
    row independent of the others, and up to 8 rows its bf16 output is those sums rounded."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(21, 96, generator=gen).bfloat16()
    codes = torch.randint(-127, 128, (70, 96), generator=gen, dtype=torch.int8)
    packed = ops.small_batch_pack_int8(codes)
    if grouped:
        scales = ops.small_batch_pack_int8_group_scales(torch.rand(70, 3, generator=gen) * 0.01 + 1e-4)
    else:
        scales = torch.rand(70, generator=gen) * 0.01 + 1e-4
    together = ops.small_batch_linear_int8_float_out(x, packed, scales, 70)
    assert together.dtype == torch.float32 and together.shape == (21, 70)
    for first, count in [(0, 1), (2, 7), (9, 12)]:
        part = ops.small_batch_linear_int8_float_out(
            x[first : first + count].contiguous(), packed, scales, 70
        )
        assert torch.equal(part, together[first : first + count])
    assert torch.equal(
        ops.small_batch_linear_int8(x[:8].contiguous(), packed, scales, 70), together[:8].bfloat16()
    )


@pytest.mark.cpu_kernels("int8_linear")
@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_float32_inputs_where_the_build_takes_them(rows):
    """Where the int8 and int4 kernels take float32 inputs (the AVX2 level, whose models run in float32)
    they round them as they round bf16 ones and write float32; elsewhere they refuse them."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen)
    codes = torch.randint(-127, 128, (70, 576), generator=gen, dtype=torch.int8)
    packed, scales = ops.small_batch_pack_int8(codes), torch.rand(70, generator=gen) * 0.01 + 1e-4
    nibbles = torch.randint(0, 16, (70, 576), generator=gen, dtype=torch.uint8)
    int4_scales = torch.rand(70, 9, generator=gen) * 0.02 + 1e-3
    int4_packed, params = ops.small_batch_pack_int4(nibbles, int4_scales, -8 * int4_scales)
    if not ops.small_batch_linear_int8_supported(torch.float32):
        with pytest.raises(RuntimeError, match="bfloat16 inputs"):
            ops.small_batch_linear_int8(x, packed, scales, 70)
        with pytest.raises(RuntimeError, match="bfloat16 inputs"):
            ops.small_batch_linear_int4(x, int4_packed, params, 70)
        return
    actual = ops.small_batch_linear_int8(x, packed, scales, 70)
    assert actual.dtype == torch.float32
    assert torch.equal(actual, ops.small_batch_linear_int8_float_out(x, packed, scales, 70))
    rounded, _ = _rounded_input(x)
    expected = (rounded @ codes.double().T) * scales.double()
    magnitude = (rounded.abs() @ codes.double().abs().T) * scales.double()
    assert ((actual.double() - expected).abs() <= 1e-5 * magnitude).all()
    weight = (nibbles.double().view(70, 9, 64) - 8) * int4_scales.double()[..., None]
    int4 = ops.small_batch_linear_int4(x, int4_packed, params, 70)
    assert int4.dtype == torch.float32
    expected = rounded @ weight.view(70, 576).T
    assert ((int4.double() - expected).abs() <= 1e-5 * (rounded.abs() @ weight.view(70, 576).abs().T)).all()
    # bf16 inputs given as float32 are rounded to the same codes: the bf16 kernel's sums, unrounded
    as_bf16 = x.bfloat16()
    assert torch.equal(
        ops.small_batch_linear_int8_float_out(as_bf16.float(), packed, scales, 70),
        ops.small_batch_linear_int8_float_out(as_bf16, packed, scales, 70),
    )
    assert torch.equal(
        ops.small_batch_linear_int4(as_bf16.float(), int4_packed, params, 70).bfloat16(),
        ops.small_batch_linear_int4(as_bf16, int4_packed, params, 70),
    )


@pytest.mark.cpu_kernels("int8_linear")
@pytest.mark.parametrize("rows", [1, 5])
def test_scales_exact_in_float16_are_packed_as_float16_with_the_same_outputs(rows):
    """A GGUF file's block scales are float16: packed as such (half the bytes the kernels stream), with
    outputs bit-equal to the same parameters in float32; scales float16 cannot hold stay float32."""
    gen = torch.Generator().manual_seed(rows)
    nibbles = torch.randint(0, 16, (70, 576), generator=gen, dtype=torch.uint8)
    int4_scales = (torch.rand(70, 18, generator=gen) * 0.02 + 1e-3).half().float()
    int4_offsets = (-8 * int4_scales).half().float()
    packed, params = ops.small_batch_pack_int4(nibbles, int4_scales, int4_offsets)
    assert params.dtype == torch.float16
    codes = torch.randint(-127, 128, (70, 576), generator=gen, dtype=torch.int8)
    q8_scales = ops.small_batch_pack_int8_group_scales(
        (torch.rand(70, 18, generator=gen) * 0.01 + 1e-4).half().float()
    )
    assert q8_scales.dtype == torch.float16
    q8_packed = ops.small_batch_pack_int8(codes)
    for dtype in (torch.bfloat16, torch.float32):
        if not ops.small_batch_linear_int8_supported(dtype):
            continue  # float32 inputs: the AVX2 level's kernels only (test_float32_inputs_where_...)
        x = torch.randn(rows, 576, generator=gen).to(dtype)
        assert torch.equal(
            ops.small_batch_linear_int4(x, packed, params, 70),
            ops.small_batch_linear_int4(x, packed, params.float(), 70),
        )
        assert torch.equal(
            ops.small_batch_linear_int8(x, q8_packed, q8_scales, 70),
            ops.small_batch_linear_int8(x, q8_packed, q8_scales.float(), 70),
        )
        assert torch.equal(
            ops.small_batch_linear_int8_float_out(x, q8_packed, q8_scales, 70),
            ops.small_batch_linear_int8_float_out(x, q8_packed, q8_scales.float(), 70),
        )
    inexact = int4_scales.clone()
    inexact[3, 4] += 2**-20
    assert ops.small_batch_pack_int4(nibbles, inexact, int4_offsets)[1].dtype == torch.float32
    tiny = torch.full((70, 18), 1e-9)  # a float16 subnormal: not exact
    assert ops.small_batch_pack_int8_group_scales(tiny).dtype == torch.float32


@pytest.mark.cpu_kernels("int8_linear")
@pytest.mark.parametrize(
    ("kind", "group", "out_features"),
    [("int4", 32, 70), ("int4", 64, 64), ("int8", 32, 50), ("int8", 16, 45), ("int8", None, 33)],
)
def test_packed_weights_read_back_as_the_weights_they_hold(kind, group, out_features):
    """small_batch_dequantize_*: the float32 W of a packed weight (padded rows dropped), equal to the
    formats' own dequantization (q * scale + offset, two roundings), with float16 or float32 scales
    (int8 group None: one float32 scale per row); with `rows`, those rows of it (an embedding's lookups)."""
    gen = torch.Generator().manual_seed(out_features)
    cols = 192
    ids = torch.tensor([[out_features - 1, 0, 31], [32, 31, out_features - 1]])  # block edges, repeats

    def read_back(dequantize, *args, expected: torch.Tensor) -> None:
        assert torch.equal(dequantize(*args, out_features), expected)
        assert torch.equal(dequantize(*args, out_features, rows=ids), expected[ids.reshape(-1)])
        assert dequantize(*args, out_features, rows=torch.empty(0, dtype=torch.long)).shape == (0, cols)
        with pytest.raises(RuntimeError, match=f"row id out of range: {out_features} of {out_features} rows"):
            dequantize(*args, out_features, rows=torch.tensor([0, out_features]))

    if kind == "int4":
        nibbles = torch.randint(0, 16, (out_features, cols), generator=gen, dtype=torch.uint8)
        for half in (False, True):
            scales = torch.rand(out_features, cols // group, generator=gen) * 0.02 + 1e-3
            offsets = -8 * scales + torch.randn(out_features, cols // group, generator=gen) * 1e-3
            if half:
                scales, offsets = scales.half().float(), offsets.half().float()
            packed, params = ops.small_batch_pack_int4(nibbles, scales, offsets)
            assert (params.dtype == torch.float16) == half
            expected = Int4Weight(nibbles, scales, offsets, group).dequantize()
            read_back(ops.small_batch_dequantize_int4, packed, params, expected=expected)
        return
    codes = torch.randint(-127, 128, (out_features, cols), generator=gen, dtype=torch.int8)
    packed = ops.small_batch_pack_int8(codes)
    if group is None:
        scales = torch.rand(out_features, generator=gen) * 0.01 + 1e-4
        expected = Int8Weight(codes, scales[:, None], cols).dequantize()
        read_back(ops.small_batch_dequantize_int8, packed, scales, expected=expected)
        return
    scales = (torch.rand(out_features, cols // group, generator=gen) * 0.01 + 1e-4).half().float()
    packed_scales = ops.small_batch_pack_int8_group_scales(scales)
    assert packed_scales.dtype == torch.float16
    expected = Int8Weight(codes, scales, group).dequantize()
    read_back(ops.small_batch_dequantize_int8, packed, packed_scales, expected=expected)
    read_back(ops.small_batch_dequantize_int8, packed, packed_scales.float(), expected=expected)


def test_freed_weights_still_count_as_the_models_weights():
    """A layer holding only its packed copy still multiplies by its weights: the preemption cost
    model's FLOPs per token (worker/memory_report.weight_count) count them, before and after the swap."""
    from llmserve.worker.memory_report import weight_count

    model = _model_with_a_tied_linear()
    before = weight_count(model)
    assert before == sum(p.numel() for p in model.parameters())
    assert use_small_batch_linear(model, amx=False) == 2 and model["proj"].weight is None
    assert weight_count(model) == before
    empty = model["head"](torch.randn(0, 64).bfloat16())
    assert empty.shape == (0, 200)
