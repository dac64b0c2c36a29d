"""The compiled in-place decode kernel agrees with the reference backend."""

import pytest
import torch

from llmserve.attention.backends.torch_sdpa import TorchSDPABackend
from llmserve.attention.kv_format import get_kv_cache_format
from llmserve.forward_context import AttentionMetadata, PrefillSpan
from llmserve.kernels.cpu_ops import load_cpu_ops

pytestmark = pytest.mark.cpu_kernels

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
    place by the kernel, equal the reference backend's prefill path (head_dim 64 and 128: a vector path,
    test_float32_and_bf16_models_take_a_vector_path_over_every_cache_format; 32: the portable one)."""
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


# Verification spans (k drafts + 1 queries) alone in a batch of 1 or 2, contexts across block boundaries
# and long ones: work items of many query rows (6 at a time in the V pass) and, with few (sequence, KV
# head) pairs for the threads, pairs split by query rows.
SMALL_BATCH_SPANS = [
    [(2, 17)],
    [(3, 3)],
    [(4, 47)],
    [(5, 250)],
    [(8, 16)],
    [(8, 1000)],
    [(6, 511)],
    [(4, 33), (8, 300)],
    [(2, 1000), (7, 65)],
    [(8, 800), (8, 801)],
]


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}threads")
def threads(request):
    """The kernel splits work by the number of threads: 1, this machine's 2, and more than it has."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("spans", SMALL_BATCH_SPANS)
def test_small_batch_verification_spans_match_reference(spans, head_dim, threads, dtype, atol):
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend

    query, key, value, key_cache, value_cache, metadata, tables = random_batch(
        dtype, [], spans, head_dim=head_dim, seed=len(spans) + spans[0][1]
    )
    scale = head_dim**-0.5
    expected = TorchSDPABackend().forward(
        query, key, value, key_cache.clone(), value_cache.clone(), metadata, scale
    )
    in_kernel = with_spans_in_kernel(metadata, [], spans, tables)
    actual = CPUPagedBackend().forward(
        query, key, value, key_cache.clone(), value_cache.clone(), in_kernel, scale
    )
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("spans", SMALL_BATCH_SPANS)
def test_span_rows_equal_the_decodes_they_stand_for(spans, head_dim, threads, dtype, kv_dtype):
    """Query i of a span over context n gives bit for bit what a decode of the same query over the
    first n - q + 1 + i positions gives, however the kernel splits and groups the rows, so a
    verified draft's attention is what plain decoding would have computed (8-bit caches too)."""
    ops = load_cpu_ops()
    gen = torch.Generator().manual_seed(head_dim + len(spans))
    max_blocks = max(-(-ctx // BLOCK) for _, ctx in spans)
    num_blocks = len(spans) * max_blocks + 3
    fmt = get_kv_cache_format(kv_dtype)
    key_cache, value_cache = (
        torch.randn(num_blocks * BLOCK, 3, head_dim, generator=gen).to(dtype) for _ in range(2)
    )
    if fmt.is_quantized:
        key_cache, value_cache = fmt.quantize(key_cache), fmt.quantize(value_cache)
    tables = torch.randperm(num_blocks, generator=gen)[: len(spans) * max_blocks].view(len(spans), -1)
    counts = [q for q, _ in spans]
    query = torch.randn(sum(counts), 9, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    span_out = ops.paged_attention(
        query, key_cache, value_cache, tables, torch.tensor([ctx for _, ctx in spans]),
        torch.tensor([0, *counts]).cumsum(0), BLOCK, scale, fmt.kernel_code, 0, 0,
    )  # fmt: skip
    # every query token as a decode of its own, over the context up to its position
    owners = [seq for seq, (q, _) in enumerate(spans) for _ in range(q)]
    decode_lens = [ctx - q + 1 + i for q, ctx in spans for i in range(q)]
    decode_out = ops.paged_attention(
        query, key_cache, value_cache, tables[owners].contiguous(), torch.tensor(decode_lens),
        torch.arange(len(owners) + 1), BLOCK, scale, fmt.kernel_code, 0, 0,
    )  # fmt: skip
    assert torch.equal(span_out, decode_out)


@pytest.mark.parametrize(
    ("decode_lens", "span", "sinks", "window"), [([120], (8, 90), 4, 16), ([300], (5, 260), 0, 24)]
)
def test_split_spans_with_windows_match_dense_reference(decode_lens, span, sinks, window, threads):
    """bf16 with sinks and a sliding window: the span is the batch's shortest sequence, so with 4 threads
    (6 (sequence, KV head) pairs) its KV heads are split by query rows; evicted blocks are NaN."""
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend
    from tests.attention.test_kv_formats_and_windows import (
        dense_reference,
        paged_case,
        with_short_spans_in_kernel,
    )

    queries, key, value, caches, metadata, dense, lens, new_counts, tables = paged_case(
        decode_lens, [span], sinks, window, seed=4, head_dim=64, dtype=torch.bfloat16
    )
    backend = CPUPagedBackend()
    in_kernel = with_short_spans_in_kernel(metadata, tables, lens, new_counts, decode_lens, [span], backend)
    expected = dense_reference(queries, dense, lens, new_counts, sinks, window, scale=64**-0.5)
    actual = backend.forward(queries, key, value, caches[0].clone(), caches[1].clone(), in_kernel, 64**-0.5)
    torch.testing.assert_close(actual.double(), expected, atol=1.5e-2, rtol=1.5e-2)


# ---- every model dtype over every cache format: which kernel runs, and what it promises ----------------

KV_DTYPES = ["auto", "int8", "fp8"]


def kernel_path(dtype, kv_dtype, head_dim):
    return load_cpu_ops().paged_attention_path(dtype, get_kv_cache_format(kv_dtype).kernel_code, head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_and_bf16_models_take_a_vector_path_over_every_cache_format(dtype, kv_dtype, head_dim):
    """Every level the kernels build for has AVX2, FMA and F16C, which the float32-arithmetic path needs
    for float32, bf16, int8 and fp8 rows; only bf16 over a bf16 cache may take AVX-512 BF16's pair
    products instead, where the level has them. Other head sizes keep the portable loops."""
    allowed = {"fma", "bf16_pairs"} if (dtype, kv_dtype) == (torch.bfloat16, "auto") else {"fma"}
    assert kernel_path(dtype, kv_dtype, head_dim) in allowed
    assert kernel_path(dtype, kv_dtype, 32) == "portable"


# (decode_lens, spans, sinks, window): GQA batches with and without sinks and windows, a span longer
# than the backend sends here (the kernel takes any), and batches of two sequences, whose 4 (sequence,
# KV head) pairs the threads split by query rows.
PATH_CASES = [
    ([1, 9, 40, 77], [(5, 30), (12, 12)], 0, 0),
    ([1, 9, 40, 77, 16, 17], [(5, 60), (12, 12), (3, 40)], 4, 16),
    ([30, 77, 100], [(20, 90)], 0, 24),
    ([3], [(8, 300)], 0, 0),
    ([2], [(6, 200)], 4, 32),
]


def path_tolerance(path, dtype):
    """What each path promises against float64 attention over the values the cache holds: float32
    arithmetic (outputs rounded once to bf16 for a bf16 model: half a bf16 step, 2^-8 relative), or
    bf16 probabilities in the pair products."""
    if path == "bf16_pairs":
        return 1.5e-2, 1.5e-2
    return (2e-5, 2e-5) if dtype == torch.float32 else (1e-4, 2**-8)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("decode_lens", "spans", "sinks", "window"), PATH_CASES)
def test_each_path_matches_float64_attention(dtype, kv_dtype, head_dim, decode_lens, spans, sinks, window):
    """The kernel on decodes and spans in one call, causal within a span, sinks and windows per query,
    8-bit rows dequantized as read; blocks that left the window are NaN, so a read of one fails."""
    from tests.attention.test_kv_formats_and_windows import BLOCK as CASE_BLOCK
    from tests.attention.test_kv_formats_and_windows import dense_reference, paged_case

    queries, _, _, caches, _, dense, lens, new_counts, tables = paged_case(
        decode_lens, spans, sinks, window, kv_dtype, seed=len(spans), head_dim=head_dim, dtype=dtype
    )
    scale = head_dim**-0.5
    actual = load_cpu_ops().paged_attention(
        queries, caches[0], caches[1], tables, torch.tensor(lens), torch.tensor([0, *new_counts]).cumsum(0),
        CASE_BLOCK, scale, get_kv_cache_format(kv_dtype).kernel_code, sinks, window,
    )  # fmt: skip
    assert actual.dtype == dtype
    expected = dense_reference(queries, dense, lens, new_counts, sinks, window, scale=scale)
    atol, rtol = path_tolerance(kernel_path(dtype, kv_dtype, head_dim), dtype)
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("head_dim", [128, 32])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_8bit_code_is_read_exactly(dtype, kv_dtype, head_dim):
    """A decode over one position returns that position's value row: rows holding all 256 codes (fp8's
    subnormals and NaN codes included) come back as code times scale, exactly, in every path."""
    fmt = get_kv_cache_format(kv_dtype)
    codes = torch.arange(256, dtype=torch.uint8).view(-1, 1, head_dim)  # one row per sequence
    rows = len(codes)
    scale_bytes = torch.tensor([0.375], dtype=torch.float16).view(torch.uint8)
    values = torch.cat([codes, scale_bytes.expand(rows, 1, 2)], dim=-1).contiguous()
    keys = torch.zeros_like(values)  # codes 0 and scale 0: every score 0
    query = torch.randn(rows, 1, head_dim).to(dtype)
    out = load_cpu_ops().paged_attention(
        query, keys, values, torch.arange(rows).view(rows, 1), torch.ones(rows, dtype=torch.int64),
        torch.arange(rows + 1), 1, 0.1, fmt.kernel_code, 0, 0,
    )  # fmt: skip
    expected = fmt.dequantize(values, torch.float32).to(dtype)
    assert bool(torch.isnan(expected).any()) == (kv_dtype == "fp8")  # 0x7F and 0xFF are fp8's NaNs
    torch.testing.assert_close(out, expected, atol=0, rtol=0, equal_nan=True)


# A token tree's verify span (root + 7 drafts; parents listed first), a chain's and a plain decode together
TREE_PARENTS = [-1, -1, 0, 0, 2, 1, -1]


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 128, 32])
@pytest.mark.parametrize("context", [8, 47, 300])
def test_tree_spans_in_kernel_match_the_reference_tree_mask(dtype, atol, head_dim, context, threads):
    """Each draft of a tree sees the context, the root, its ancestors and itself: the kernel's bits
    (step_inputs._tree_bits, every vector path and the portable one) give the reference backend's dense
    tree mask's attention; a chain's span beside it stays causal, and the masks change the drafts'
    rows (so the comparison can fail)."""
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend
    from llmserve.worker.step_inputs import _tree_bits, _tree_mask

    n = len(TREE_PARENTS)
    spans = [(1 + n, context + n), (5, 60)]
    query, key, value, key_cache, value_cache, metadata, tables = random_batch(
        dtype, [33], spans, head_dim=head_dim, seed=context
    )
    metadata.prefills[0].tree_mask = torch.from_numpy(_tree_mask(TREE_PARENTS, context + n))
    scale = head_dim**-0.5
    expected = TorchSDPABackend().forward(
        query, key, value, key_cache.clone(), value_cache.clone(), metadata, scale
    )
    in_kernel = with_spans_in_kernel(metadata, [33], spans, tables)
    starts = in_kernel.decode_query_starts.numpy()
    in_kernel.decode_tree_masks = torch.from_numpy(_tree_bits({1: TREE_PARENTS}, in_kernel, starts))
    backend = CPUPagedBackend()
    actual = backend.forward(query, key, value, key_cache.clone(), value_cache.clone(), in_kernel, scale)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=atol)
    in_kernel.decode_tree_masks = None
    causal = backend.forward(query, key, value, key_cache.clone(), value_cache.clone(), in_kernel, scale)
    drafts = slice(2, 2 + n)  # rows: the decode, the root, the drafts, the chain's span
    assert not torch.allclose(causal[drafts].float(), actual[drafts].float(), atol=atol, rtol=atol)
    # the decode, the root and the first draft (a child of the root) see what causal rows see
    torch.testing.assert_close(causal[:3].float(), actual[:3].float(), atol=0, rtol=0)
    torch.testing.assert_close(causal[drafts.stop :].float(), actual[drafts.stop :].float(), atol=0, rtol=0)


def test_tree_masks_are_refused_for_too_long_a_span_or_the_wrong_shape():
    ops = load_cpu_ops()
    query = torch.zeros(65, 2, 64)
    cache = torch.zeros(96, 1, 64)
    tables, lens = torch.tensor([[0, 1, 2, 3, 4]]), torch.tensor([65])
    with pytest.raises(RuntimeError, match="at most 64 queries"):
        ops.paged_attention(
            query, cache, cache, tables, lens, torch.tensor([0, 65]), 16, 1.0, 0, 0, 0, torch.full((65,), -1)
        )
    with pytest.raises(RuntimeError, match="int64 \\[num_tokens\\]"):
        ops.paged_attention(
            query, cache, cache, tables, lens, torch.tensor([0, 65]), 16, 1.0, 0, 0, 0, torch.full((2,), -1)
        )
