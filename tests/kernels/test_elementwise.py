"""The compiled RMSNorm / rotary / SwiGLU kernels against the PyTorch formulations they replace."""

import pytest
import torch
import torch.nn.functional as F

from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.models.layers.custom_op import bind_kernels
from llmserve.models.layers.norm import RMSNorm
from llmserve.models.layers.rotary import RotaryEmbedding

ops = load_cpu_ops()
pytestmark = pytest.mark.cpu_kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_within_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 association differences, which can move a rounded intermediate by one unit
    in the last place of the dtype, and the result by two (and that rarely: most elements must be
    identical in 16-bit dtypes)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    ulp = {torch.float32: 2**-22, torch.bfloat16: 2**-7, torch.float16: 2**-10}[actual.dtype]
    diff = (actual.double() - expected.double()).abs()
    assert (diff <= 2 * ulp * expected.double().abs() + 1e-6).all(), diff.max()
    if actual.dtype != torch.float32:
        assert (actual != expected).float().mean() < 0.01


def rows_with_stride(tokens: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[tokens, width] rows that are a view into wider rows (as slices of a fused projection are)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, width + 24, generator=gen) * 3).to(dtype)[:, 5 : 5 + width]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 576), (7, 100), (300, 64)])
def test_rms_norm_matches_reference(dtype, tokens, hidden):
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    bind_kernels(norm, torch.device("cpu"))
    norm.weight.data.normal_(generator=torch.Generator().manual_seed(1))
    x = rows_with_stride(tokens, hidden, dtype, seed=tokens)
    assert_within_rounding(ops.rms_norm(x, norm.weight, 1e-5), norm.reference(x))
    assert_within_rounding(norm(x), norm.reference(x))  # the module takes the kernel on the CPU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 200])
def test_add_rms_norm_adds_in_place_and_normalizes_the_sum(dtype, tokens):
    norm = RMSNorm(576, 1e-6).to(dtype)
    bind_kernels(norm, torch.device("cpu"))
    norm.weight.data.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    sublayer_out = rows_with_stride(tokens, 576, dtype, seed=3).contiguous()
    residual = rows_with_stride(tokens, 576, dtype, seed=4)
    residual_before = residual.clone()
    expected_sum = residual + sublayer_out  # the decoder layer's `hidden + attn_out`, rounded once
    normed, summed = norm(sublayer_out, residual=residual)
    assert summed is sublayer_out and torch.equal(summed, expected_sum)
    assert torch.equal(residual, residual_before)  # only the sublayer's own output changes
    assert_within_rounding(normed, norm.reference(expected_sum))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(64, 9, 3), (32, 4, 4), (128, 2, 1)])
def test_rotary_rotates_query_and_key_views_in_place(dtype, head_dim, heads, kv_heads):
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.device("cpu"))
    bind_kernels(rotary, torch.device("cpu"))
    tokens = 23
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    expected_query, expected_key = rotary.reference(positions, query, key, head_dim)
    value_before = value.clone()
    out_query, out_key = rotary(positions, query, key, head_dim)
    assert out_query.data_ptr() == query.data_ptr()  # in place, in the qkv buffer
    assert_within_rounding(out_query, expected_query)
    assert_within_rounding(out_key, expected_key)
    assert torch.equal(value, value_before)


def test_rotary_rejects_positions_past_the_table():
    rotary = RotaryEmbedding(32, 16, 10000.0, None, torch.device("cpu"))
    query, key = torch.randn(2, 64), torch.randn(2, 32)
    with pytest.raises(RuntimeError, match="position out of range"):
        ops.rotary_embedding(torch.tensor([3, 16]), query, key, rotary.cos, rotary.sin, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 1536), (9, 37), (130, 256)])
def test_silu_and_mul_matches_reference(dtype, tokens, inter):
    gate_up = rows_with_stride(tokens, 2 * inter, dtype, seed=inter)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_within_rounding(ops.silu_and_mul(gate_up), F.silu(gate) * up)


def test_silu_and_mul_at_extremes():
    gate = torch.tensor([-1000.0, -100.0, -88.5, -20.0, 0.0, 1e-30, 20.0, 88.5, 100.0, 1e38] * 4)
    gate_up = torch.cat([gate, torch.full_like(gate, 2.0)]).view(1, -1)
    expected = F.silu(gate) * 2.0
    actual = ops.silu_and_mul(gate_up)[0]
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_the_same_function_at_every_position(dtype):
    """The vector body and a row's tail compute alike: an element's result does not depend on where in
    the row it stands (decodes and verify spans of the same tokens must agree bitwise)."""
    gen = torch.Generator().manual_seed(7)
    gate, up = (torch.randn(2, 45, generator=gen) * 4).to(dtype)
    gate[3], up[4] = float("nan"), float("inf")
    for shift in (1, 3, 8):
        shifted = ops.silu_and_mul(torch.cat([gate.roll(shift), up.roll(shift)]).view(1, -1))[0]
        plain = ops.silu_and_mul(torch.cat([gate, up]).view(1, -1))[0]
        torch.testing.assert_close(shifted.roll(-shift), plain, rtol=0, atol=0, equal_nan=True)


def test_layers_choose_their_kernels_once_when_bound():
    """Unbound (or bound to a device without the kernels) a layer runs its PyTorch formulation; bound
    to the CPU it runs the compiled kernel, chosen once: forward asks nothing about the device."""
    from llmserve.models.layers.activation import SiluAndMul

    norm, act = RMSNorm(64, 1e-5), SiluAndMul()
    assert norm._forward_method == norm.forward_native and act._forward_method == act.forward_native
    bind_kernels(torch.nn.ModuleList([norm, act]), torch.device("cpu"))
    assert norm._forward_method == norm.forward_cpu and act._forward_method == act.forward_cpu
    assert norm.ops is ops
    bind_kernels(norm, torch.device("meta"))  # any other device: the PyTorch formulation
    assert norm._forward_method == norm.forward_native and norm.ops is None
    gate_up = torch.randn(3, 64)
    torch.testing.assert_close(act(gate_up), act.forward_native(gate_up))
