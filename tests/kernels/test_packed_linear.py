"""float32 linear layers on the CPU (PackedLinear): the compiled float32 kernel at every row count
(1-8 rows in one pass, more in row tiles), oneDNN on a packed copy where the build has no kernel."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels import small_batch_linear
from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.kernels.small_batch_linear import (
    MAX_ROWS,
    PackedLinear,
    use_small_batch_linear,
)

ops = load_cpu_ops()
needs_kernel = pytest.mark.cpu_kernels("avx2")


@needs_kernel
@pytest.mark.parametrize("rows", [*range(1, MAX_ROWS + 1), 9, 13, 43, 130])  # 130: several row panels
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (13, 64), (3, 1536), (1001, 7)])
def test_kernel_matches_float64_reference(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    actual = ops.small_batch_linear_f32(x, ops.small_batch_pack_f32(w), out_features)
    assert actual.dtype == torch.float32 and actual.shape == (rows, out_features)
    exact = x.double() @ w.double().T
    # one FMA chain per output: at most ~K float32 roundings of the running sum
    bound = in_features * 2**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((actual.double() - exact).abs() <= bound).all()


@needs_kernel
def test_kernel_row_does_not_depend_on_the_others():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(MAX_ROWS, 576, generator=gen)
    w = ops.small_batch_pack_f32(torch.randn(100, 576, generator=gen))
    for rows in range(1, MAX_ROWS + 1):
        together = ops.small_batch_linear_f32(x[:rows].contiguous(), w, 100)
        for row in range(rows):
            alone = ops.small_batch_linear_f32(x[row : row + 1].contiguous(), w, 100)
            assert torch.equal(alone[0], together[row])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 5, 8])
def test_bf16_weights_give_the_float32_result_of_their_values(rows):
    """bf16 -> float32 is exact, so the kernel on a bf16 copy computes what it computes on the same
    values stored as float32, bit for bit; only the bytes read halve."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen)
    w = (torch.randn(1001, 576, generator=gen) * 0.05).bfloat16()
    packed = ops.small_batch_pack_f32(w)
    assert packed.dtype == torch.bfloat16
    actual = ops.small_batch_linear_f32(x, packed, 1001)
    assert actual.dtype == torch.float32
    assert torch.equal(actual, ops.small_batch_linear_f32(x, ops.small_batch_pack_f32(w.float()), 1001))


@needs_kernel
@torch.no_grad()
def test_a_module_may_keep_its_kernel_weights_in_bf16():
    model = nn.ModuleDict({"proj": nn.Linear(64, 96)})
    use_small_batch_linear(model, float32_kernel_weights=torch.bfloat16)
    proj, x = model["proj"], torch.randn(3, 64)
    assert proj.small_batch_weight.dtype == torch.bfloat16
    for _ in range(2):
        expected = F.linear(x, proj.weight.bfloat16().float(), proj.bias)
        torch.testing.assert_close(proj(x), expected, atol=1e-5, rtol=1e-5)
        proj.weight.mul_(2)  # packed again, still in bf16
    assert proj.small_batch_weight.dtype == torch.bfloat16


@needs_kernel
def test_kernel_rejects_what_it_does_not_serve():
    w = ops.small_batch_pack_f32(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="at least one row"):
        ops.small_batch_linear_f32(torch.randn(0, 32), w, 16)
    with pytest.raises(RuntimeError, match="float32"):
        ops.small_batch_linear_f32(torch.randn(2, 32).bfloat16(), w, 16)
    with pytest.raises(RuntimeError, match="packed by small_batch_pack_f32"):
        ops.small_batch_linear_f32(torch.randn(2, 32), w, 20)


def _swapped_model() -> nn.ModuleDict:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"embed": nn.Embedding(100, 64), "proj": nn.Linear(64, 96), "head": nn.Linear(64, 100)}
    )
    model["head"].weight = model["embed"].weight  # tied, as SmolLM2's lm_head
    assert use_small_batch_linear(model) == 2
    assert type(model["proj"]) is PackedLinear and type(model["head"]) is PackedLinear
    return model


@torch.no_grad()
def test_matches_f_linear_and_keeps_tied_weights():
    model = _swapped_model()
    assert model["head"].weight is model["embed"].weight
    for rows in (1, 3, 8, 40):
        x = torch.randn(rows, 64)
        for name in ("proj", "head"):
            module = model[name]
            torch.testing.assert_close(
                module(x), F.linear(x, module.weight, module.bias), atol=1e-5, rtol=1e-5
            )


@needs_kernel
@torch.no_grad()
def test_a_row_does_not_depend_on_the_others(monkeypatch):
    """Verifying drafts (several rows) and a prefill must give each row the bits that decoding it
    alone gives, at every row count (one kernel pass up to 8 rows, row tiles and panels above).
    The kernel takes every row count where AVX2 is the best vector unit (kernel_takes_every_row_count);
    the test makes it take them here too, so an AVX-512 CPU tests that kernel instead of skipping."""
    monkeypatch.setattr(small_batch_linear, "kernel_takes_every_row_count", lambda: True)
    proj = _swapped_model()["proj"]
    assert proj.small_batch_weight is not None and proj.packed_weight is None
    x = torch.randn(1100, 64)  # panels of 1024 rows at in_features 64: the last row is in a second
    together = proj(x)
    for rows in (2, MAX_ROWS, MAX_ROWS + 1, 13, 100):
        assert torch.equal(proj(x[:rows]), together[:rows])
    for row in (0, 5, 8, 9, 12, 13, 99, 1023, 1024, 1099):
        assert torch.equal(proj(x[row : row + 1])[0], together[row]), row


@needs_kernel
@torch.no_grad()
def test_above_8_rows_onednn_where_the_kernel_does_not_take_them(monkeypatch):
    """An AVX-512 CPU: the kernel up to 8 rows, oneDNN's copy above (both give each row its own bits
    up to 8; above, the result is F.linear's)."""
    monkeypatch.setattr(small_batch_linear, "kernel_takes_every_row_count", lambda: False)
    proj = _swapped_model()["proj"]
    assert proj.small_batch_weight is not None and proj.packed_weight is not None
    x = torch.randn(40, 64)
    torch.testing.assert_close(proj(x), F.linear(x, proj.weight, proj.bias), atol=1e-5, rtol=1e-5)
    assert torch.equal(proj(x[:3])[1], proj(x[1:2])[0])


@needs_kernel
@torch.no_grad()
def test_inputs_with_leading_dimensions():
    proj = _swapped_model()["proj"]
    x = torch.randn(3, 7, 64)
    torch.testing.assert_close(proj(x), F.linear(x, proj.weight, proj.bias), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_weight_written_or_replaced_after_the_swap_is_packed_again():
    proj = _swapped_model()["proj"]
    x = torch.randn(4, 64)
    proj.weight.mul_(2)
    torch.testing.assert_close(proj(x), F.linear(x, proj.weight, proj.bias), atol=1e-5, rtol=1e-5)
    proj.weight = nn.Parameter(torch.zeros(96, 64))
    torch.testing.assert_close(proj(x), proj.bias.expand(4, 96))


@torch.no_grad()
def test_other_dtypes_fall_back_to_f_linear():
    proj = _swapped_model()["proj"]
    x = torch.randn(2, 64, dtype=torch.float64)
    out = proj.double()(x)
    torch.testing.assert_close(out, F.linear(x, proj.weight, proj.bias))


def test_onednn_row_counts_are_few_and_padding_is_at_most_an_eighth():
    """oneDNN keeps a primitive (~100 KB) for each row count it sees: a server's varied step sizes
    grew its memory by one per new count until the cache was full (the soak's RSS slope)."""
    sizes = {small_batch_linear.onednn_rows(rows) for rows in range(MAX_ROWS + 1, 8193)}
    assert len(sizes) <= 8 * 10  # 8 per octave, 9 to 8,192 rows
    for rows in range(MAX_ROWS + 1, 8193):
        assert rows <= small_batch_linear.onednn_rows(rows) <= rows * 9 // 8
    assert [small_batch_linear.onednn_rows(r) for r in (9, 16, 17, 33, 100, 1025)] == [
        9,
        16,
        18,
        36,
        104,
        1152,
    ]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
@torch.no_grad()
def test_onednn_sees_only_the_rounded_row_counts_and_the_rows_asked_for_come_back(monkeypatch):
    monkeypatch.setattr(small_batch_linear, "kernel_takes_every_row_count", lambda: False)
    seen = []
    pointwise = small_batch_linear._onednn_pointwise
    monkeypatch.setattr(
        small_batch_linear,
        "_onednn_pointwise",
        lambda x, *args: seen.append(x.shape[0]) or pointwise(x, *args),
    )
    proj = _swapped_model()["proj"]
    assert proj.packed_weight is not None
    for shape in [(40, 64), (217, 64), (3, 37, 64)]:
        x = torch.randn(*shape)
        out = proj(x)
        assert out.shape == (*shape[:-1], 96)
        torch.testing.assert_close(out, F.linear(x, proj.weight, proj.bias), atol=1e-5, rtol=1e-5)
        # the zero rows change no bit of the others: the decode stack's unpadded call stays identical
        flat = x.reshape(-1, 64)
        assert torch.equal(out.reshape(-1, 96), pointwise(flat, proj.packed_weight, proj.bias))
    assert seen == [40, 224, 112]  # 217 and 111 rows rounded up
