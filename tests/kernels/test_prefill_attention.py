"""The blocked bf16 prefill attention kernel agrees with attention computed in float32."""

import pytest
import torch
import torch.nn.functional as F

from llmserve.attention.backends.torch_sdpa import TorchSDPABackend
from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.worker.forward_context import AttentionMetadata, PrefillSpan

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(
    ops is None or not ops.prefill_attention_supported(),
    reason="needs the compiled kernel on an AVX-512 BF16 CPU",
)


def random_problem(num_queries, context, heads=9, kv_heads=3, head_dim=64, seed=0):
    """bf16 queries, and a pool larger than the context whose rows sit at shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = context + 41
    key_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    value_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_slots, generator=gen)[:context]
    # a view with a token stride wider than its heads, as the q part of a fused qkv projection is
    fused = torch.randn(num_queries, heads + 2 * kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    query = fused[:, :heads]
    return query, key_cache, value_cache, slots


def float_reference(query, key_cache, value_cache, slots, scale):
    """Causal attention in float32 of the bf16 inputs: the queries are the last positions."""
    num_queries, context = query.shape[0], slots.shape[0]
    keys = key_cache[slots].float().transpose(0, 1)
    values = value_cache[slots].float().transpose(0, 1)
    query_pos = torch.arange(context - num_queries, context)
    mask = torch.arange(context)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize(
    ("num_queries", "context"),
    [(1, 1), (17, 17), (31, 31), (32, 32), (33, 33), (100, 100), (513, 513), (20, 300), (64, 97), (5, 70)],
)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 64), (8, 1, 64), (4, 2, 128)])
def test_matches_float_reference(num_queries, context, heads, kv_heads, head_dim):
    """Spans from one token to past several 32-key tiles, whole prompts and chunks after a cached
    prefix, GQA groups of 3, 1 and 8: within what bf16 rounding of the output and of the
    probabilities allows (PyTorch's own bf16 SDPA is held to the same bound)."""
    query, key_cache, value_cache, slots = random_problem(num_queries, context, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    expected = float_reference(query, key_cache, value_cache, slots, scale)
    actual = ops.prefill_attention(query, key_cache, value_cache, slots, scale)
    assert actual.shape == (num_queries, heads, head_dim) and actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, atol=1.2e-2, rtol=1.6e-2)
    # the bound is not loose: PyTorch's bf16 flash attention lands in it too
    keys = key_cache[slots].transpose(0, 1).unsqueeze(0)
    values = value_cache[slots].transpose(0, 1).unsqueeze(0)
    query_pos = torch.arange(context - num_queries, context)
    mask = torch.arange(context)[None, :] <= query_pos[:, None]
    torch_bf16 = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )[0].transpose(0, 1)
    torch.testing.assert_close(torch_bf16.float(), expected, atol=1.2e-2, rtol=1.6e-2)


def test_large_scores_do_not_overflow():
    """Scores in the hundreds (outlier activations) still give a normalized, finite softmax."""
    query, key_cache, value_cache, slots = random_problem(70, 150, seed=3)
    query = (query.float() * 30).to(torch.bfloat16)
    expected = float_reference(query, key_cache, value_cache, slots, 0.125)
    actual = ops.prefill_attention(query, key_cache, value_cache, slots, 0.125)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual.float(), expected, atol=1.2e-2, rtol=1.6e-2)


def test_backend_sends_long_bf16_spans_to_the_kernel():
    """The in-place backend's prefill path (a 40-token span, longer than its decode kernel takes)
    equals the reference backend within bf16 tolerance, and does go through the new kernel."""
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend

    query, key_cache, value_cache, slots = random_problem(40, 90)
    query = query.contiguous()
    key = torch.randn(40, 3, 64).to(torch.bfloat16)
    value = torch.randn(40, 3, 64).to(torch.bfloat16)
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
    torch.testing.assert_close(actual.float(), expected.float(), atol=1.2e-2, rtol=1.6e-2)


def test_rejects_bad_input():
    query, key_cache, value_cache, slots = random_problem(4, 10)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.prefill_attention(query, key_cache, value_cache, slots + 1000, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.prefill_attention(query.float(), key_cache.float(), value_cache.float(), slots, 0.125)
    with pytest.raises(RuntimeError, match="include the queries"):
        ops.prefill_attention(query, key_cache, value_cache, slots[:3], 0.125)
