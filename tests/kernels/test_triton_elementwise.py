"""The Triton RMSNorm / rotary / gated-activation kernels (the CUDA path) against the layers' PyTorch
formulations, run by the Triton interpreter on CPU tensors: the same kernels a GPU compiles, with numpy
for the arithmetic (and for exp and tanh, which a GPU takes from libdevice). With
LLMSERVE_TEST_DEVICE=cuda they run compiled on a GPU instead, on the same values (drawn on the CPU)."""

import pytest

from tests.triton_interpreter import TEST_DEVICE, triton_loop_bounds, use_interpreter  # noqa: F401

use_interpreter()  # before the kernels are imported: on the CPU they run interpreted

pytest.importorskip("triton", reason="the Triton kernels need triton")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from llmserve.kernels.triton import elementwise  # noqa: E402
from llmserve.models.layers.activation import GeluTanhAndMul, SiluAndMul  # noqa: E402
from llmserve.models.layers.custom_op import bind_kernels  # noqa: E402
from llmserve.models.layers.norm import RMSNorm  # noqa: E402
from llmserve.models.layers.rotary import PartialRotaryEmbedding, RotaryEmbedding  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("LLMSERVE_TEST_DEVICE=cuda but this machine has no CUDA device", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy's exp
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}
# Compiled on a GPU (its rsqrt, exp and tanh are not numpy's) more 16-bit elements move a rounding, by at
# most this many representable values (a GPU run: RMSNorm 1 in bfloat16, 2 in float16; the rest exact).
CUDA_ULPS = {torch.float16: 2, torch.bfloat16: 1}


def assert_within(actual: torch.Tensor, expected: torch.Tensor, ulps: int, atol: float = 0.0) -> None:
    """Within `ulps` units in the last place of the dtype (or atol, where the reference itself is
    cancellation noise); in 16-bit dtypes nearly all elements bit-identical (a float32 difference
    moves a rounding only when it falls on the boundary). Compiled on a GPU, any 16-bit element may
    instead be up to CUDA_ULPS representable values off."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    diff = (actual.double() - expected.double()).abs()
    bound = ulps * EPS[actual.dtype] * expected.double().abs() + atol
    within = diff <= bound
    if actual.dtype != torch.float32 and DEVICE.type == "cuda":
        within |= representable_steps(actual, expected) <= CUDA_ULPS[actual.dtype]
    assert within.all(), (diff - bound).max()
    if actual.dtype != torch.float32 and DEVICE.type == "cpu":
        assert (actual != expected).float().mean() < 0.01


def representable_steps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """How many 16-bit values lie between each pair (their bit patterns in sign-magnitude order)."""

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(actual) - ordered(expected)).abs()


def rows(tokens: int, width: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    """[tokens, width] rows that are a view into wider rows (as slices of a fused projection are), on
    DEVICE (drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    wide = (torch.randn(tokens, width + 19, generator=gen) * scale).to(dtype)
    return wide.to(DEVICE)[:, 7 : 7 + width]


def make_norm(hidden: int, dtype: torch.dtype, eps: float = 1e-5) -> RMSNorm:
    norm = RMSNorm(hidden, eps).to(dtype)
    norm.weight.data.normal_(generator=torch.Generator().manual_seed(hidden))
    return norm.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 576), (5, 960), (4, 1000), (3, 64)])
def test_rms_norm_matches_reference(dtype, tokens, hidden):
    norm = make_norm(hidden, dtype)
    x = rows(tokens, hidden, dtype, seed=tokens)
    expected = norm.reference(x)
    # float32: the sum of squares adds in another order, a few units in rsqrt's last place
    ulps = 1 if dtype != torch.float32 else 8
    assert_within(elementwise.rms_norm(x, norm.weight, 1e-5), expected, ulps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_adds_in_place_and_normalizes_the_sum(dtype):
    norm = make_norm(960, dtype, eps=1e-6)
    sublayer_out = rows(6, 960, dtype, seed=3).contiguous()
    residual = rows(6, 960, dtype, seed=4)
    residual_before = residual.clone()
    expected_sum = residual + sublayer_out  # the decoder layer's `hidden + attn_out`, rounded once
    normed = elementwise.add_rms_norm(sublayer_out, residual, norm.weight, 1e-6)
    assert torch.equal(sublayer_out, expected_sum)  # x itself now holds the sum
    assert torch.equal(residual, residual_before)
    assert_within(normed, norm.reference(expected_sum), ulps=1 if dtype != torch.float32 else 8)


def test_rms_norm_layer_bound_to_the_cuda_path_runs_the_kernel_and_falls_back_off_its_shapes():
    norm = make_norm(576, torch.bfloat16)
    norm.bind(elementwise, "cuda")
    assert norm._forward_method == norm.forward_cuda
    x, residual = rows(3, 576, torch.bfloat16, seed=5).contiguous(), rows(3, 576, torch.bfloat16, seed=6)
    expected_sum = x + residual
    normed, summed = norm(x, residual=residual)
    assert summed is x and torch.equal(summed, expected_sum)
    assert_within(normed, norm.reference(expected_sum), ulps=1)
    batched = x.unsqueeze(0)  # not rows: the kernel would refuse it, the layer takes forward_native
    assert torch.equal(norm(batched), norm.reference(batched))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rope_cls", [RotaryEmbedding, PartialRotaryEmbedding])
def test_rotary_rotates_gqa_query_and_key_views_in_place(dtype, rope_cls):
    """9 query heads and 3 KV heads of 64; positions in no order; the partial rope rotates the first 32
    dimensions of each head and passes the rest."""
    head_dim, heads, kv_heads, tokens, max_positions = 64, 9, 3, 11, 4096
    rotary_dim = head_dim if rope_cls is RotaryEmbedding else 32
    rotary = rope_cls(head_dim, max_positions, 10000.0, None, DEVICE, rotary_dim=rotary_dim)
    rotary.bind(elementwise, "cuda")
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    gen = torch.Generator().manual_seed(rotary_dim)
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen).to(dtype).to(DEVICE)
    positions = torch.randperm(max_positions, generator=gen)[:tokens].to(DEVICE)
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    expected_query, expected_key = rotary.reference(positions, query, key, head_dim)
    value_before = value.clone()
    out_query, out_key = rotary(positions, query, key, head_dim)
    assert out_query.data_ptr() == query.data_ptr() and out_key.data_ptr() == key.data_ptr()  # in qkv
    # the same float32 products and sums as the reference, rounded once: bit for bit
    assert torch.equal(out_query, expected_query) and torch.equal(out_key, expected_key)
    assert torch.equal(value, value_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "width"), [(1, 1000), (5, 576), (3, 1500)])
def test_silu_and_mul_matches_the_layer(dtype, tokens, width):
    act = SiluAndMul().to(DEVICE)
    act.bind(elementwise, "cuda")
    gate_up = rows(tokens, 2 * width, dtype, seed=width, scale=4.0)
    expected = act.forward_native(gate_up)
    assert_within(elementwise.silu_and_mul(gate_up), expected, ulps=1 if dtype != torch.float32 else 4)
    assert torch.equal(act(gate_up), elementwise.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "width"), [(1, 1000), (5, 576), (3, 1500)])
def test_gelu_tanh_and_mul_matches_the_layer(dtype, tokens, width):
    act = GeluTanhAndMul().to(DEVICE)
    act.bind(elementwise, "cuda")
    gate_up = rows(tokens, 2 * width, dtype, seed=width, scale=4.0)
    expected = act.forward_native(gate_up)
    # Far below zero 1 + tanh cancels to a few float32 units: an absolute bound there.
    assert_within(elementwise.gelu_tanh_and_mul(gate_up), expected, ulps=2, atol=1e-5)
    assert torch.equal(act(gate_up), elementwise.gelu_tanh_and_mul(gate_up))


def test_silu_and_mul_at_extremes():
    gate = torch.tensor([-1000.0, -100.0, -88.5, -20.0, 0.0, 1e-30, 20.0, 88.5, 100.0, 1e38, float("nan")])
    gate_up = torch.cat([gate, torch.full_like(gate, 2.0)]).view(1, -1).to(DEVICE)
    actual = elementwise.silu_and_mul(gate_up)[0]
    torch.testing.assert_close(actual, SiluAndMul().forward_native(gate_up)[0], equal_nan=True)


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, elementwise._round(x, tl.bfloat16), mask=offsets < n)


def test_bfloat16_rounding_is_torchs():
    """To nearest, ties to even, carries into the exponent, overflow to inf, NaN kept NaN (the
    interpreter's own conversion truncates)."""
    base = 1.0 + 2**-7  # odd last bf16 bit: its tie rounds up, the tie below (even) rounds down
    special = [base + 2**-8, 1.0 + 2**-8, 2 - 2**-9, 3.3895313892515355e38, 3.4e38, 65504.0]
    special += [float("inf"), -float("inf"), float("nan"), -0.0, 1e-40, -1e-40]
    x = torch.cat([torch.tensor(special), torch.randn(500) * 1e3]).float()
    x[-1] = torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32)  # a NaN with a low payload
    x = x.to(DEVICE)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    torch.testing.assert_close(out, x.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)


def test_layers_bind_the_triton_kernels_on_cuda_only(monkeypatch):
    """bind_kernels on a CUDA device picks forward_cuda (device type alone decides; no GPU needed here),
    and forward_native where Triton does not import; a CPU keeps its compiled kernels."""
    import llmserve.models.layers.custom_op as custom_op

    layers = torch.nn.ModuleList([RMSNorm(64, 1e-5), SiluAndMul(), GeluTanhAndMul()])
    bind_kernels(layers, torch.device("cuda"))
    assert all(layer._forward_method == layer.forward_cuda and layer.ops is elementwise for layer in layers)
    monkeypatch.setattr(custom_op, "load_triton_ops", lambda: None)
    bind_kernels(layers, torch.device("cuda"))
    assert all(layer._forward_method == layer.forward_native for layer in layers)
    monkeypatch.setattr(custom_op, "load_cpu_ops", lambda: "compiled")
    bind_kernels(layers, torch.device("cpu"))
    assert all(layer._forward_method == layer.forward_cpu and layer.ops == "compiled" for layer in layers)
