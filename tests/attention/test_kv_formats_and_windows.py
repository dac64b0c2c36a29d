"""8-bit KV caches and sliding windows in both attention backends.

Oracle: dense attention over every position of each sequence with an explicit mask (causal, sinks,
window), computed in float64 from the K/V the cache actually holds (dequantized for 8-bit caches).
Blocks that left the window are pointed at a block full of NaN, so a backend that reads one fails.
"""

import pytest
import torch

from llmserve.attention.backends.torch_sdpa import TorchSDPABackend
from llmserve.attention.kv_format import get_kv_cache_format
from llmserve.attention.window import decode_context_positions, prefill_context_positions
from llmserve.forward_context import AttentionMetadata, PrefillSpan

BLOCK = 8
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 32
SCALE = HEAD_DIM**-0.5


def paged_case(
    decode_lens, prefills, sinks=0, window=0, kv_dtype="auto", seed=0, head_dim=HEAD_DIM, dtype=torch.float32
):
    """Random K/V for every position of each sequence in a paged cache; new tokens are each
    sequence's last positions (decodes: one; prefills: (num_queries, seq_len)). Returns the backend
    inputs, the dense K/V as stored (dequantized) per sequence, and the block tables (after eviction)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = get_kv_cache_format(kv_dtype)
    lens = list(decode_lens) + [n for _, n in prefills]
    new_counts = [1] * len(decode_lens) + [q for q, _ in prefills]
    max_blocks = max(-(-n // BLOCK) for n in lens)
    num_blocks = len(lens) * max_blocks + 1  # the last block is the NaN block
    nan_block = num_blocks - 1
    tables = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * max_blocks].view(
        len(lens), max_blocks
    )
    dense = [
        tuple(torch.randn(n, KV_HEADS, head_dim, generator=gen).to(dtype) for _ in range(2)) for n in lens
    ]
    caches = [
        torch.full((num_blocks * BLOCK, KV_HEADS, head_dim), float("nan"), dtype=dtype) for _ in range(2)
    ]
    for seq, n in enumerate(lens):
        slots = tables[seq, torch.arange(n) // BLOCK] * BLOCK + torch.arange(n) % BLOCK
        caches[0][slots], caches[1][slots] = dense[seq]
    if fmt.is_quantized:  # NaN rows quantize to NaN scales: still poison
        caches = [fmt.quantize(c) for c in caches]
        dense = [tuple(fmt.dequantize(fmt.quantize(x), torch.float32) for x in kv) for kv in dense]
    # Blocks no query of this step can see (all their positions in [sinks, first query - window]) go.
    for seq, (n, q) in enumerate(zip(lens, new_counts, strict=True)):
        first_visible = n - q - window + 1 if window else 0
        for block in range(-(-sinks // BLOCK), max(first_visible, 0) // BLOCK):
            tables[seq, block] = nan_block
    queries = torch.randn(sum(new_counts), HEADS, head_dim, generator=gen).to(dtype)
    new_rows = [torch.arange(n - q, n) for n, q in zip(lens, new_counts, strict=True)]
    key = torch.cat([dense[s][0][rows] for s, rows in enumerate(new_rows)])
    value = torch.cat([dense[s][1][rows] for s, rows in enumerate(new_rows)])
    if fmt.is_quantized:  # write the original floats: re-quantizing them gives the stored codes
        key, value = key.clone(), value.clone()
    slot = lambda seq, pos: tables[seq, pos // BLOCK] * BLOCK + pos % BLOCK  # noqa: E731
    slot_mapping = torch.cat([slot(s, rows) for s, rows in enumerate(new_rows)])
    metadata = build_metadata(tables, lens, new_counts, len(decode_lens), sinks, window, slot_mapping, slot)
    return queries, key, value, caches, metadata, dense, lens, new_counts, tables


def build_metadata(tables, lens, new_counts, num_decodes, sinks, window, slot_mapping, slot):
    """What the model runner builds, through the same window helpers."""
    import numpy as np

    decode_lens = np.array(lens[:num_decodes])
    positions, valid = decode_context_positions(decode_lens, sinks, window)
    positions = torch.from_numpy(positions)
    decode_slots = torch.stack([slot(i, positions[i]) for i in range(num_decodes)])
    spans, start = [], num_decodes
    for seq in range(num_decodes, len(lens)):
        live = prefill_context_positions(lens[seq], new_counts[seq], sinks, window)
        pos = torch.arange(lens[seq]) if live is None else torch.from_numpy(live)
        end = start + new_counts[seq]
        spans.append(PrefillSpan(start, end, slot(seq, pos), None if live is None else pos))
        start = end
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decode_tokens=num_decodes,
        decode_context_slots=decode_slots,
        decode_context_mask=torch.from_numpy(valid)[:, None, None, :],
        prefills=spans,
        decode_block_tables=tables[:num_decodes].contiguous(),
        decode_seq_lens=torch.tensor(lens[:num_decodes], dtype=torch.int64),
        block_size=BLOCK,
        sliding_window=window,
        attention_sinks=sinks,
    )


def dense_reference(queries, dense, lens, new_counts, sinks, window, scale=SCALE):
    """Masked attention over all positions, float64."""
    out, row = [], 0
    group = HEADS // KV_HEADS
    for (keys, values), n, q in zip(dense, lens, new_counts, strict=True):
        k = keys.double().repeat_interleave(group, dim=1)  # [n, heads, d]
        v = values.double().repeat_interleave(group, dim=1)
        query_pos, key_pos = torch.arange(n - q, n)[:, None], torch.arange(n)[None, :]
        mask = key_pos <= query_pos
        if window:
            mask &= (query_pos - key_pos < window) | (key_pos < sinks)
        scores = torch.einsum("qhd,khd->hqk", queries[row : row + q].double(), k) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", probs, v))
        row += q
    return torch.cat(out)


def run(backend, case):
    queries, key, value, caches, metadata = case[:5]
    return backend.forward(queries, key, value, caches[0].clone(), caches[1].clone(), metadata, SCALE)


def with_short_spans_in_kernel(metadata, tables, lens, new_counts, decode_lens, prefills, backend):
    """The batch as the in-place backend sees it: decodes and the spans short enough for its kernel
    (CASES list those first) in one call, with query_starts; longer spans stay prefills."""
    short = [count <= backend.max_decode_query_len for count in new_counts]
    num_short = short.index(False) if False in short else len(short)
    # the spans that fit go to the kernel (all but CASES[2]'s 20-token one)
    assert num_short - len(decode_lens) == sum(q <= backend.max_decode_query_len for q, _ in prefills)
    starts = torch.tensor([0, *new_counts[:num_short]]).cumsum(0)
    return AttentionMetadata(
        slot_mapping=metadata.slot_mapping,
        num_decode_tokens=int(starts[-1]),
        decode_context_slots=None,
        decode_context_mask=None,
        prefills=metadata.prefills[num_short - len(decode_lens) :],
        decode_block_tables=tables[:num_short].contiguous(),
        decode_seq_lens=torch.tensor(lens[:num_short], dtype=torch.int64),
        decode_query_starts=starts,
        block_size=BLOCK,
        sliding_window=metadata.sliding_window,
        attention_sinks=metadata.attention_sinks,
    )


CASES = [  # (decode_lens, prefills, sinks, window)
    ([1, 9, 40, 77], [(5, 30), (12, 12)], 0, 0),
    ([1, 9, 40, 77, 16, 17], [(5, 60), (12, 12), (3, 40)], 4, 16),
    ([30, 77, 100], [(20, 90)], 0, 24),
    ([5, 33, 64], [(7, 70)], 10, 9),
]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize(("decode_lens", "prefills", "sinks", "window"), CASES)
def test_torch_backend_matches_dense_masked_reference(kv_dtype, decode_lens, prefills, sinks, window):
    case = paged_case(decode_lens, prefills, sinks, window, kv_dtype)
    expected = dense_reference(case[0], *case[5:8], sinks, window)
    actual = run(TorchSDPABackend(kv_dtype), case)
    torch.testing.assert_close(actual.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize(("decode_lens", "prefills", "sinks", "window"), CASES)
def test_kernel_matches_torch_backend(kv_dtype, decode_lens, prefills, sinks, window):
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend

    case = paged_case(decode_lens, prefills, sinks, window, kv_dtype, seed=1)
    expected = run(TorchSDPABackend(kv_dtype), case)
    actual = run(CPUPagedBackend(kv_dtype), case)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("kv_dtype", "bound"), [("int8", 0.02), ("fp8", 0.08)])
def test_8bit_attention_close_to_float(kv_dtype, bound):
    """Against attention over the unquantized floats: max |error| of outputs whose entries are ~N(0, 1/n)."""
    decode_lens, prefills = [17, 64, 200], [(9, 90)]
    exact = run(TorchSDPABackend(), paged_case(decode_lens, prefills))
    quantized = run(TorchSDPABackend(kv_dtype), paged_case(decode_lens, prefills, kv_dtype=kv_dtype))
    error = (quantized - exact).abs().max().item()
    assert error < bound, error
    assert error > 0  # the quantized path really ran


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantize_round_trip_bounds(kv_dtype):
    fmt = get_kv_cache_format(kv_dtype)
    rows = torch.randn(500, KV_HEADS, HEAD_DIM) * torch.logspace(-3, 2, 500)[:, None, None]
    packed = fmt.quantize(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (500, KV_HEADS, HEAD_DIM + 2)
    restored = fmt.dequantize(packed, torch.float32)
    # The stored scale is float16 (rounded by at most 2^-11 relative), at least its smallest normal.
    scale = (rows.abs().amax(-1, keepdim=True) / fmt.code_max).clamp_min(torch.finfo(torch.float16).tiny)
    scale = scale * (1 + 2**-11)
    # int8: uniform levels, half a step. fp8: 3 mantissa bits, half an ulp is 1/16 relative; the
    # subnormal step is 2^-9 of the scale.
    int8_bound = scale * 0.5 * (1 + 1e-5)
    bound = int8_bound if kv_dtype == "int8" else rows.abs() / 16 + scale * 2**-10 + 1e-7
    assert ((restored - rows).abs() <= bound).all()
    zeros = fmt.dequantize(fmt.quantize(torch.zeros(3, 1, 8)), torch.float32)
    assert torch.equal(zeros, torch.zeros(3, 1, 8))


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize(("decode_lens", "prefills", "sinks", "window"), CASES)
def test_kernel_spans_match_dense_reference(kv_dtype, decode_lens, prefills, sinks, window):
    """Short spans (up to the kernel's limit) in the kernel with the decodes: causal within the span,
    sinks and window per query, 8-bit rows dequantized; long spans stay prefills."""
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend

    queries, key, value, caches, metadata, dense, lens, new_counts, tables = paged_case(
        decode_lens, prefills, sinks, window, kv_dtype, seed=2
    )
    backend = CPUPagedBackend(kv_dtype)
    in_kernel = with_short_spans_in_kernel(metadata, tables, lens, new_counts, decode_lens, prefills, backend)
    expected = dense_reference(queries, dense, lens, new_counts, sinks, window)
    actual = backend.forward(queries, key, value, caches[0].clone(), caches[1].clone(), in_kernel, SCALE)
    torch.testing.assert_close(actual.double(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.cpu_kernels
@pytest.mark.parametrize(("decode_lens", "prefills", "sinks", "window"), CASES)
def test_bf16_fast_path_with_windows_matches_dense_reference(decode_lens, prefills, sinks, window):
    """bfloat16 and head_dim 64: decodes and short spans in the AVX-512 BF16 path of the kernel (where
    the CPU has it), long spans in the prefill kernel or SDPA, all with sinks and windows; against
    float64 attention over the same bf16 values (NaN blocks catch a read of an evicted block)."""
    from llmserve.attention.backends.cpu_paged import CPUPagedBackend

    queries, key, value, caches, metadata, dense, lens, new_counts, tables = paged_case(
        decode_lens, prefills, sinks, window, seed=3, head_dim=64, dtype=torch.bfloat16
    )
    backend = CPUPagedBackend()
    in_kernel = with_short_spans_in_kernel(metadata, tables, lens, new_counts, decode_lens, prefills, backend)
    expected = dense_reference(queries, dense, lens, new_counts, sinks, window, scale=64**-0.5)
    actual = backend.forward(queries, key, value, caches[0].clone(), caches[1].clone(), in_kernel, 64**-0.5)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.double(), expected, atol=1.5e-2, rtol=1.5e-2)
