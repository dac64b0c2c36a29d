"""The compiled in-place decode kernel agrees with the reference backend."""

import pytest
import torch

from llmserve.attention.backends.torch_sdpa import TorchSDPABackend
from llmserve.kernels.cpu_ops import load_cpu_ops
from llmserve.worker.forward_context import AttentionMetadata, PrefillSpan

pytestmark = pytest.mark.skipif(load_cpu_ops() is None, reason="no C++ compiler for the CPU kernel")

BLOCK = 16


def random_batch(dtype, decode_lens, prefill_spans, heads=9, kv_heads=3, head_dim=64, seed=0):
    """A paged cache with random contents and random (non-contiguous) block tables; returns the
    backend inputs and the tables."""
    gen = torch.Generator().manual_seed(seed)
    lens = decode_lens + [ctx for _, ctx in prefill_spans]
    max_blocks = max(-(-n // BLOCK) for n in lens)
    num_blocks = len(lens) * max_blocks + 7
    key_cache = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: len(lens) * max_blocks].view(len(lens), max_blocks)
    context_slots = [
        (tables[i, torch.arange(n) // BLOCK] * BLOCK + torch.arange(n) % BLOCK) for i, n in enumerate(lens)
    ]
    num_tokens = len(decode_lens) + sum(q for q, _ in prefill_spans)
    query = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    # each new token's slot: the last positions of its sequence
    slot_mapping = [context_slots[i][-1] for i in range(len(decode_lens))]
    spans, start = [], len(decode_lens)
    for j, (q, ctx) in enumerate(prefill_spans):
        seq = len(decode_lens) + j
        slot_mapping.extend(context_slots[seq][ctx - q :].tolist())
        spans.append(PrefillSpan(start, start + q, context_slots[seq]))
        start += q
    max_ctx = max(decode_lens, default=1)
    pos = torch.arange(max_ctx)
    d = len(decode_lens)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([int(s) for s in slot_mapping]),
        num_decode_tokens=d,
        decode_context_slots=(tables[:d, pos // BLOCK] * BLOCK + pos % BLOCK) if d else None,
        decode_context_mask=(pos[None, :] < torch.tensor(decode_lens)[:, None])[:, None, None, :]
        if d
        else None,
        prefills=spans,
        decode_block_tables=tables[:d].contiguous() if d else None,
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int64) if d else None,
        block_size=BLOCK,
    )
    return query, key, value, key_cache, value_cache, metadata, tables


def with_spans_in_kernel(metadata, decode_lens, prefill_spans, tables):
    """The same batch as the in-place backend sees it when every span is short enough for the kernel:
    decodes and spans together, each span's queries at rows query_starts[i]..query_starts[i+1]-1."""
    counts = [1] * len(decode_lens) + [q for q, _ in prefill_spans]
    lens = decode_lens + [ctx for _, ctx in prefill_spans]
    starts = torch.tensor([0, *counts]).cumsum(0)
    return AttentionMetadata(
        slot_mapping=metadata.slot_mapping,
        num_decode_tokens=int(starts[-1]),
        decode_context_slots=None,
        decode_context_mask=None,
        prefills=[],
        decode_block_tables=tables[: len(lens)].contiguous(),
        decode_seq_lens=torch.tensor(lens, dtype=torch.int64),
        decode_query_starts=starts,
        block_size=BLOCK,
    )


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("decode_lens", [[1], [15, 16, 17], [33, 100, 250, 511, 2, 64]])
def test_decode_matches_reference(dtype, atol, decode_lens):
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend

    inputs = random_batch(dtype, decode_lens, prefill_spans=[(5, 40), (17, 17)])
    query, key, value, key_cache, value_cache, metadata, _ = inputs
    scale = 64**-0.5
    expected = TorchSDPABackend().forward(
        query, key, value, key_cache.clone(), value_cache.clone(), metadata, scale
    )
    actual = CPUPagedBackend().forward(
        query, key, value, key_cache.clone(), value_cache.clone(), metadata, scale
    )
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=atol)


def test_gqa_group_of_one_and_plain_multi_head():
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend

    for heads, kv_heads in ((4, 4), (8, 1)):
        q, k, v, kc, vc, md, _ = random_batch(
            torch.float32, [20, 47], [], heads=heads, kv_heads=kv_heads, head_dim=32
        )
        expected = TorchSDPABackend().forward(q, k, v, kc.clone(), vc.clone(), md, 0.2)
        actual = CPUPagedBackend().forward(q, k, v, kc.clone(), vc.clone(), md, 0.2)
        torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 128, 32])
@pytest.mark.parametrize("spans", [[(4, 40), (16, 16), (2, 300)], [(9, 9), (6, 150), (1, 1), (16, 33)]])
def test_short_spans_in_kernel_match_reference(dtype, atol, head_dim, spans):
    """Speculative verification and short prompt tails: several causal queries per sequence, read in
    place by the kernel, equal the reference backend's prefill path (bf16: the AVX-512 BF16 path
    for head_dim 64 and 128 where the CPU has it, the portable one otherwise)."""
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend

    decode_lens = [1, 17, 64, 129]
    query, key, value, key_cache, value_cache, metadata, tables = random_batch(
        dtype, decode_lens, spans, head_dim=head_dim
    )
    scale = head_dim**-0.5
    expected = TorchSDPABackend().forward(
        query, key, value, key_cache.clone(), value_cache.clone(), metadata, scale
    )
    in_kernel = with_spans_in_kernel(metadata, decode_lens, spans, tables)
    actual = CPUPagedBackend().forward(
        query, key, value, key_cache.clone(), value_cache.clone(), in_kernel, scale
    )
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=atol)


def test_kernel_rejects_inconsistent_query_starts():
    ops = load_cpu_ops()
    query = torch.randn(3, 9, 64)
    cache = torch.randn(32, 3, 64)
    tables, lens = torch.zeros(2, 2, dtype=torch.int64), torch.tensor([5, 6])
    with pytest.raises(RuntimeError, match="query_starts"):
        ops.paged_attention(query, cache, cache, tables, lens, torch.tensor([0, 1, 2]), 16, 0.125, 0, 0, 0)
