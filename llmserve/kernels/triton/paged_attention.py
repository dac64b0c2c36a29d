"""Paged attention in Triton: every row of a step in one launch, K/V read in place through block tables.

Sequence s owns the query rows [query_starts[s], query_starts[s + 1]), the last n_s of its
seq_lens[s] positions: decodes, speculative verify spans, prompt chunks and prefix-cache hits are all
the same case, so a step needs one launch and no per-sequence host loop. Query j of s sits at
p = seq_len - n_s + j and sees keys k <= p; with a window w only p - k < w, except the first `sinks`.

A program takes a tile of one sequence's query tokens for one KV head, with all of that head's query
heads as rows (GQA), so each K/V tile is loaded once for the group; it finds its sequence by a binary
search over query_starts, so the launch reads no device value on the host and a CUDA graph can hold
it. For steps of few query rows over long contexts each program also takes only a share of the KV
tiles ("flash decoding"): the shares' partial max, sum and accumulator go to a buffer that a second
small kernel merges. 8-bit caches (attention/kv_format.py) are dequantized tile by tile.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30  # wider than any context: "no window" needs no branch in the masks
_KV_CODE_DTYPES = {1: torch.int8, 2: torch.float8_e4m3fn}  # kv_format.py's kernel codes of 8-bit rows
_MIN_KEYS_PER_SPLIT = 256  # a split's fixed cost (a partial written, then merged) wants this many keys
_MAX_SPLITS = 16


@triton.jit
def _tanh(x):
    # from exp2, which the interpreter and every GPU have; clamped where tanh is +-1 in float32
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _find_sequence(query_starts_ptr, num_seqs, program, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first program, query_starts[s] // BLOCK_Q + s, is <= program."""
    lo = tl.full([], 0, tl.int32)
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_starts_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        ahead = first <= program
        lo = tl.where(ahead, mid, lo)
        hi = tl.where(ahead, hi, mid - 1)
    return lo


@triton.jit(do_not_specialize=["num_seqs", "window", "sinks"])
def _paged_attention_kernel(
    out_ptr,  # [tokens, heads, head_dim] (one split) ...
    part_acc_ptr,  # ... or the splits' partials: [tokens, heads, splits, HEAD_DIM_PAD] float32
    part_max_ptr,  # [tokens, heads, splits] float32 (log2 domain)
    part_sum_ptr,
    q_ptr,
    k_cache_ptr,  # [slots, kv_heads, row]: plain rows, or an 8-bit cache viewed as its codes
    v_cache_ptr,
    k_scale_ptr,  # 8-bit caches: [slots, kv_heads] float16 scales (a view into the rows)
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_starts_ptr,
    num_seqs,
    score_scale,  # scores * score_scale, then (soft-cap) tanh and * cap_scale: log2 units for exp2
    cap_scale,
    window,
    sinks,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_ks_slot,
    stride_ks_head,
    stride_vs_slot,
    stride_vs_head,
    stride_table,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # rows of a program: BLOCK_Q tokens x GROUP heads, padded to a power of two
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,  # keys per iteration
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    QUANTIZED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SPLIT_KV: tl.constexpr,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq = _find_sequence(query_starts_ptr, num_seqs, program, BLOCK_Q)
    q_begin = tl.load(query_starts_ptr + seq).to(tl.int32)
    q_len = tl.load(query_starts_ptr + seq + 1).to(tl.int32) - q_begin
    q_tile = program - (q_begin // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:  # the grid is sized for the worst case; this program has no queries
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP  # within the sequence's queries
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    position = seq_len - q_len + token
    flat_token = (q_begin + token).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + flat_token[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # Keys these queries may see: up to the last one's position, from the first one's window on, and
    # the sinks; only those are ever read, since blocks outside them may be freed and reused.
    first_position = seq_len - q_len + q_tile * BLOCK_Q
    key_end = tl.minimum(first_position + BLOCK_Q, seq_len)
    key_begin = tl.maximum(first_position - window + 1, 0)
    tile_begin = key_begin // TILE_N
    tile_end = tl.cdiv(key_end, TILE_N)
    per_split = tl.cdiv(tile_end - tile_begin, num_splits)
    lo = tile_begin + split * per_split
    hi = tl.minimum(lo + per_split, tile_end)
    num_sink_tiles = tl.where(split == 0, tl.minimum(tl.cdiv(sinks, TILE_N), tile_begin), 0)
    num_tiles = num_sink_tiles + tl.maximum(hi - lo, 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for i in range(0, num_tiles):
        tile = tl.where(i < num_sink_tiles, i, lo + i - num_sink_tiles)  # the sinks' tiles first
        keys = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = (keys < key_end) & ((keys >= key_begin) | (keys < sinks))
        block = tl.load(block_tables_ptr + seq * stride_table + keys // BLOCK_SIZE, mask=key_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + slot[None, :] * stride_k_slot + kv_head * stride_k_head + dims[:, None],
            mask=dim_ok[:, None] & key_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + slot[:, None] * stride_v_slot + kv_head * stride_v_head + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if QUANTIZED:
            k_scale = tl.load(
                k_scale_ptr + slot * stride_ks_slot + kv_head * stride_ks_head, mask=key_ok, other=0
            )
            v_scale = tl.load(
                v_scale_ptr + slot * stride_vs_slot + kv_head * stride_vs_head, mask=key_ok, other=0
            )
            k = k.to(tl.float32) * k_scale.to(tl.float32)[None, :]
            v = v.to(tl.float32) * v_scale.to(tl.float32)[:, None]
        scores = tl.dot(q, k.to(q.dtype), input_precision="ieee") * score_scale
        if SOFTCAP:
            scores = _tanh(scores) * cap_scale
        in_window = (position[:, None] - keys[None, :] < window) | (keys[None, :] < sinks)
        seen = (keys[None, :] <= position[:, None]) & key_ok[None, :] & in_window
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        m = m_new

    if SPLIT_KV:
        part = (flat_token * tl.num_programs(1) * GROUP + head) * num_splits + split
        tl.store(part_max_ptr + part, m, mask=row_ok)
        tl.store(part_sum_ptr + part, denom, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        tl.store(
            out_ptr + flat_token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_splits,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One (token, head): the splits' partial softmaxes rescaled to their common max and summed."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    part = (token * tl.num_programs(1) + head) * num_splits + splits
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    denom = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    top = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(weight * denom, 0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=split_ok[:, None], other=0.0
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_o_tok + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def paged_attention(
    query: torch.Tensor,  # [tokens, heads, head_dim]
    key_cache: torch.Tensor,  # [slots, kv_heads, row] (row: head_dim, or head_dim + 2 bytes when 8-bit)
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_blocks]
    seq_lens: torch.Tensor,  # [seqs] context lengths, this step's tokens included
    query_starts: torch.Tensor,  # [seqs + 1] sequence s's query rows: [starts[s], starts[s + 1])
    block_size: int,
    scale: float,
    kv_code: int = 0,  # kv_format.py's kernel_code: 0 plain, 1 int8, 2 fp8
    window: int = 0,  # 0: none
    sinks: int = 0,
    softcap: float = 0.0,  # 0: none
    num_splits: int | None = None,  # KV splits per program (None: chosen from the shapes)
) -> torch.Tensor:
    """Attention of every query row over its sequence's paged context, in the query's dtype.

    Rows past query_starts[-1] (padding) are left unwritten. Shapes alone choose the tiles and the
    split, so the call reads nothing back from the device."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = block_tables.shape[0], key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m, block_q, tile_n, few_rows = _tiles(num_tokens, num_seqs, group, head_dim_pad)
    grid_q = num_tokens // block_q + num_seqs  # enough for any split of the tokens into sequences
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = _num_splits(grid_q * num_kv_heads, max_context, query.device) if few_rows else 1
    k_codes, k_scales = _cache_views(key_cache, head_dim, kv_code)
    v_codes, v_scales = _cache_views(value_cache, head_dim, kv_code)
    split_kv = num_splits > 1
    if split_kv:
        parts = (num_tokens, num_heads, num_splits)
        part_acc = torch.empty((*parts, head_dim_pad), dtype=torch.float32, device=query.device)
        part_max = torch.empty(parts, dtype=torch.float32, device=query.device)
        part_sum = torch.empty(parts, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_max = part_sum = out  # not touched
    score_scale, cap_scale = (scale / softcap, softcap * _LOG2E) if softcap else (scale * _LOG2E, 1.0)
    _paged_attention_kernel[(grid_q, num_kv_heads, num_splits)](
        out, part_acc, part_max, part_sum,
        query, k_codes, v_codes, k_scales, v_scales,
        block_tables, seq_lens, query_starts,
        num_seqs, score_scale, cap_scale, window or _NO_WINDOW, sinks,
        *query.stride()[:2], *out.stride()[:2],
        *k_codes.stride()[:2], *v_codes.stride()[:2], *k_scales.stride()[:2], *v_scales.stride()[:2],
        block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE_N=tile_n, BLOCK_SIZE=block_size, QUANTIZED=bool(kv_code), SOFTCAP=bool(softcap),
        SPLIT_KV=split_kv, num_warps=4,
    )  # fmt: skip
    if split_kv:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, num_splits, *out.stride()[:2],
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=1,
        )  # fmt: skip
    return out


def _tiles(num_tokens: int, num_seqs: int, group: int, head_dim_pad: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_Q, TILE_N, few_rows): 16 rows (the smallest dot) when the step is decodes
    and short spans, each then one program per KV head; larger tiles of queries for prompt chunks,
    which reuse each K/V tile across more of them."""
    small_m = max(16, triton.next_power_of_2(group))
    few_rows = num_tokens <= num_seqs * (small_m // group)
    block_m = small_m if few_rows else max(64 if head_dim_pad <= 128 else 32, small_m)
    tile_n = 64 if head_dim_pad <= 128 else 32
    return block_m, block_m // group, tile_n, few_rows


def _num_splits(programs: int, max_context: int, device: torch.device) -> int:
    """KV splits when the (query tile, KV head) programs alone would leave multiprocessors idle: a
    power of two (few compiled variants), each split keeping at least _MIN_KEYS_PER_SPLIT keys."""
    wanted = triton.cdiv(2 * multiprocessors(device), programs)
    splits = min(wanted, max_context // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS)
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1


@functools.cache
def multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter on CPU: any small count


def _cache_views(cache: torch.Tensor, head_dim: int, kv_code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows as the kernel reads them, their [slots, kv_heads] float16 scales): an 8-bit cache's
    uint8 rows viewed as their codes, and the float16 in their last 2 bytes; plain rows twice."""
    if not kv_code:
        return cache, cache
    return cache.view(_KV_CODE_DTYPES[kv_code]), cache.view(torch.float16)[..., head_dim // 2]
