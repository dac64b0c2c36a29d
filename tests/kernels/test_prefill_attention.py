"""The blocked prefill attention kernels (bf16 products on AMX or AVX-512 BF16; float32 arithmetic on
AVX2 and FMA, over float32 or bf16 tensors) agree with attention computed in a wider type."""

import pytest
import torch
import torch.nn.functional as F

from llmserve.attention.backends.torch_sdpa import TorchSDPABackend
from llmserve.forward_context import AttentionMetadata, PrefillSpan
from llmserve.kernels.cpu_ops import load_cpu_ops

ops = load_cpu_ops()
pytestmark = pytest.mark.cpu_kernels("avx2")  # every AVX-512 BF16 CPU has AVX2 and FMA too
# float32 is held to float32 rounding of sums over a few hundred terms; bf16 to what rounding the output
# (and on AVX-512 BF16 the probabilities) to bf16 allows (PyTorch's own bf16 SDPA is held to the same bound).
TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 1.2e-2, "rtol": 1.6e-2}}
DTYPES = [torch.bfloat16, torch.float32]
# bf16 runs on AMX's tile products where the CPU has them, else on AVX-512 BF16, else in float32
# arithmetic (AVX2): use_amx=True checks the first where the CPU has it, use_amx=False the next one
needs_amx = pytest.mark.cpu_kernels("avx512_bf16", "amx_bf16")
KERNELS = [
    pytest.param((torch.bfloat16, True), marks=needs_amx, id="bf16-amx"),
    pytest.param((torch.bfloat16, False), id="bf16"),
    pytest.param((torch.float32, False), id="float32"),
]


def random_problem(num_queries, context, heads=9, kv_heads=3, head_dim=64, seed=0, dtype=torch.bfloat16):
    """Queries, and a pool larger than the context whose rows sit at shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = context + 41
    key_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:context]
    # a view with a token stride wider than its heads, as the q part of a fused qkv projection is
    fused = torch.randn(num_queries, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    query = fused[:, :heads]
    return query, key_cache, value_cache, slots


def float_reference(query, key_cache, value_cache, slots, scale):
    """Causal attention in float64 of the inputs: the queries are the last positions."""
    num_queries, context = query.shape[0], slots.shape[0]
    keys = key_cache[slots].double().transpose(0, 1)
    values = value_cache[slots].double().transpose(0, 1)
    query_pos = torch.arange(context - num_queries, context)
    mask = torch.arange(context)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        query.double().transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize(
    ("num_queries", "context"),
    [(1, 1), (17, 17), (31, 31), (32, 32), (33, 33), (100, 100), (513, 513), (20, 300), (64, 97), (5, 70)],
)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 64), (8, 1, 64), (4, 2, 128)])
@pytest.mark.parametrize("kernel", KERNELS)
def test_matches_float_reference(num_queries, context, heads, kv_heads, head_dim, kernel):
    """Spans from one token to past several key tiles (16 keys in float32, 32 in bf16), whole prompts
    and chunks after a cached prefix, GQA groups of 3, 1 and 8, query-row blocks cut short at the
    span's end: within the dtype's rounding."""
    dtype, use_amx = kernel
    query, key_cache, value_cache, slots = random_problem(
        num_queries, context, heads, kv_heads, head_dim, dtype=dtype
    )
    scale = head_dim**-0.5
    expected = float_reference(query, key_cache, value_cache, slots, scale)
    actual = ops.prefill_attention(query, key_cache, value_cache, slots, scale, use_amx)
    assert actual.shape == (num_queries, heads, head_dim) and actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected, **TOLERANCE[dtype])
    if dtype == torch.bfloat16 and ops.prefill_attention_path(dtype) == "fma":
        # float32 arithmetic on exact bf16 inputs: one bf16 rounding of the output away from the reference
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-5, rtol=2**-7)
    if dtype == torch.float32:
        return
    # the bf16 bound is not loose: PyTorch's bf16 flash attention lands in it too
    keys = key_cache[slots].transpose(0, 1).unsqueeze(0)
    values = value_cache[slots].transpose(0, 1).unsqueeze(0)
    query_pos = torch.arange(context - num_queries, context)
    mask = torch.arange(context)[None, :] <= query_pos[:, None]
    torch_bf16 = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )[0].transpose(0, 1)
    torch.testing.assert_close(torch_bf16.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("kernel", KERNELS)
def test_large_scores_do_not_overflow(kernel):
    """Scores in the hundreds (outlier activations) still give a normalized, finite softmax. In
    float32 a score near 300 carries a rounding error near 3e-5, which the probabilities inherit:
    PyTorch's float32 SDPA is off by 2.5e-5 here, so the bound is 1e-4 rather than 2e-5."""
    dtype, use_amx = kernel
    query, key_cache, value_cache, slots = random_problem(70, 150, seed=3, dtype=dtype)
    query = (query.float() * 30).to(dtype)
    expected = float_reference(query, key_cache, value_cache, slots, 0.125)
    actual = ops.prefill_attention(query, key_cache, value_cache, slots, 0.125, use_amx)
    assert torch.isfinite(actual).all()
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected, **tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_sends_long_spans_to_the_kernel(dtype):
    """The in-place backend's prefill path (a 40-token span, longer than its decode kernel takes)
    equals the reference backend within the dtype's tolerance, and does go through the new kernel."""
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend

    query, key_cache, value_cache, slots = random_problem(40, 90, dtype=dtype)
    query = query.contiguous()
    key = torch.randn(40, 3, 64).to(dtype)
    value = torch.randn(40, 3, 64).to(dtype)
    metadata = AttentionMetadata(
        slot_mapping=slots[-40:],
        num_decode_tokens=0,
        decode_context_slots=None,
        decode_context_mask=None,
        prefills=[PrefillSpan(0, 40, slots)],
        block_size=16,
    )
    reference = TorchSDPABackend()
    expected = reference.forward(query, key, value, key_cache.clone(), value_cache.clone(), metadata, 0.125)
    backend = CPUPagedBackend()
    calls = []
    real_kernel = backend.ops

    class Spy:
        def __getattr__(self, name):
            if name == "prefill_attention":
                calls.append(name)
            return getattr(real_kernel, name)

    backend.ops = Spy()
    actual = backend.forward(query, key, value, key_cache.clone(), value_cache.clone(), metadata, 0.125)
    assert calls == ["prefill_attention"]
    torch.testing.assert_close(actual.double(), expected.double(), **TOLERANCE[dtype])


def test_rejects_bad_input():
    dtype = next(d for d in (torch.float32, torch.bfloat16) if ops.prefill_attention_supported(d))
    query, key_cache, value_cache, slots = random_problem(4, 10, dtype=dtype)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.prefill_attention(query, key_cache, value_cache, slots + 1000, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.prefill_attention(query.double(), key_cache, value_cache, slots, 0.125)
    with pytest.raises(RuntimeError, match="takes bfloat16"):
        ops.prefill_attention(query.half(), key_cache.half(), value_cache.half(), slots, 0.125)
    with pytest.raises(RuntimeError, match="include the queries"):
        ops.prefill_attention(query, key_cache, value_cache, slots[:3], 0.125)
