"""Writes and reference reads of a 4-bit or 2-bit KV cache (KIVI, attention/kv_format.py).

A step first quantizes the blocks its new rows complete into the pool (gathered from the window and the
new rows, `RecentKVPlan`; a sequence's first block without its sinks, whose outlier channels would
widen every channel's range), then writes the new rows that stay in the window (worker/recent_kv.py)
and the sinks it is the first to compute. Positions are read quantized only once the span of
R = LOW_BIT_WINDOW_BLOCKS blocks they belong to is complete (KIVI's residual: up to R blocks' worth of
recent tokens in full precision, quantized together when the span fills). A query at position p sees
- positions 0 .. LOW_BIT_SINK_TOKENS - 1 from its sink entry once its first span is complete (from its
  window before), in full precision;
- positions from (p + 1) // (R * block) * (R * block) on (the window), in full precision;
- the rest of its context dequantized from the pool;
so a prompt scored in chunks sees exactly what it would see one token at a time, and a prefix hit of
whole spans (core/prefix_cache.py) what it would have computed. Computed in float32 (the oracle of the
compiled kernels), one call for all decodes and one per prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.attention.kv_format import LowBitKVCacheFormat
from llmserve.config.kv_cache_dtype import LOW_BIT_SINK_TOKENS, LOW_BIT_WINDOW_BLOCKS
from llmserve.forward_context import AttentionMetadata, RecentKVPlan

Recent = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # windows K, V; sinks K, V


def window_rows(slots, positions, block: int):
    """Flat window rows of `positions` for sequences in window `slots` (broadcast; tensors or numpy
    arrays alike: the input builder plans with it on the host)."""
    places = slots * LOW_BIT_WINDOW_BLOCKS + (positions // block) % LOW_BIT_WINDOW_BLOCKS
    return places * block + positions % block


def write_step(
    fmt: LowBitKVCacheFormat,
    key_cache,
    value_cache,
    key,
    value,
    recent: Recent,
    plan: RecentKVPlan,
    block: int,
) -> None:
    """The step's completed blocks into the pool, then its rows that stay in the window, and new sinks."""
    count = plan.sealed_blocks.numel()
    if count:
        heads, dim = key.shape[1:]
        gathered = []
        for new, window in ((key, recent[0]), (value, recent[1])):
            rows = new.new_empty(count * block, heads, dim)
            rows[plan.sealed_from_window] = window[plan.window_rows]
            rows[plan.sealed_from_new] = new[plan.new_rows]
            rows = rows.view(count, block, heads, dim)
            # the sinks are read from their entries: out of their block's ranges
            rows[plan.sealed_firsts, :LOW_BIT_SINK_TOKENS] = rows[
                plan.sealed_firsts, LOW_BIT_SINK_TOKENS, None
            ]
            gathered.append(rows)
        fmt.write_blocks(key_cache, value_cache, plan.sealed_blocks, *gathered)
    for index, new in enumerate((key, value)):  # sinks first: the window writes may reuse their rows
        recent[2 + index][plan.sinks_from_window] = recent[index][plan.sink_window_rows]
        recent[2 + index][plan.sinks_from_new] = new[plan.sink_new_rows]
        recent[index][plan.window_writes] = new[plan.window_sources]


def first_window(computed: int, block: int) -> int:
    """The first position a query at `computed` or later may read from the window (at most computed)."""
    span = LOW_BIT_WINDOW_BLOCKS * block
    return min((computed + 1) // span * span, computed)


def decode(
    fmt: LowBitKVCacheFormat,
    query,
    key_cache,
    value_cache,
    recent: Recent,
    metadata: AttentionMetadata,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """One query per sequence, at position length - 1."""
    block, tables, lens = metadata.block_size, metadata.decode_block_tables, metadata.decode_seq_lens
    plan = metadata.recent_kv
    num = tables.shape[0]
    slots, sinks = plan.window_slot_tensor[:num], plan.sink_entry_tensor[:num]
    columns = -(-int(lens.max()) // block)
    positions = torch.arange(columns * block, device=query.device)
    span, num_sinks = LOW_BIT_WINDOW_BLOCKS * block, LOW_BIT_SINK_TOKENS
    window_from = lens // span * span
    in_window = (positions[None, :] >= window_from[:, None]) | (positions < num_sinks)
    valid = positions[None, :] < lens[:, None]
    rows = window_rows(slots[:, None], positions[None, :], block)
    sink_rows = sinks[:, None] * num_sinks + torch.arange(num_sinks, device=query.device)
    from_sinks = (window_from > 0)[:, None, None, None]  # past the first span: the sinks' entry
    context = []
    for index, cache in enumerate((key_cache, value_cache)):
        quantized = fmt.read_blocks(cache, tables[:, :columns], block, keys=index == 0).flatten(1, 2)
        full = recent[index][rows].float()
        full[:, :num_sinks] = torch.where(
            from_sinks, recent[2 + index][sink_rows].float(), full[:, :num_sinks]
        )
        mixed = torch.where(in_window[..., None, None], full, quantized)
        context.append(mixed.masked_fill_(~valid[..., None, None], 0).transpose(1, 2))  # [num, h, ctx, d]
    out = _attend(query.float().unsqueeze(2), context[0], context[1], valid[:, None, None, :], scale, softcap)
    return out.squeeze(2).to(query.dtype)


@dataclass(frozen=True)
class LowBitSpan:
    """One sequence's prompt span over a low-bit cache, as prefill and prefill_segments read it."""

    key: torch.Tensor  # [q, kv_heads, d]: its new rows
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    recent: Recent
    earlier: tuple[
        torch.Tensor, torch.Tensor
    ]  # its window rows from before the step (RecentKVPlan.earlier_rows)
    table: torch.Tensor  # its block table
    sink: int  # its sink entry, read by the queries past the first span
    computed: int  # its tokens cached before this step: the queries are at computed .. computed + q - 1
    block: int


def prefill(fmt: LowBitKVCacheFormat, query, span: LowBitSpan, scale: float, softcap: float) -> torch.Tensor:
    """One sequence's span: query [q, heads, d]."""
    key, value, key_cache, value_cache = span.key, span.value, span.key_cache, span.value_cache
    recent, earlier, table, sink, computed, block = (
        span.recent,
        span.earlier,
        span.table,
        span.sink,
        span.computed,
        span.block,
    )
    num_queries = query.shape[0]
    length = computed + num_queries
    sealed = length // block * block  # positions of complete blocks
    start = first_window(computed, block)
    device = query.device
    context = []
    for index, cache in enumerate((key_cache, value_cache)):
        quantized = torch.zeros(length, *key.shape[1:], device=device)
        quantized[:sealed] = fmt.read_blocks(cache, table[: sealed // block], block, keys=index == 0).flatten(
            0, 1
        )
        full = torch.zeros_like(quantized)
        full[start:] = torch.cat((earlier[index].float(), (key, value)[index].float()))
        sinks = recent[2 + index][sink * LOW_BIT_SINK_TOKENS : (sink + 1) * LOW_BIT_SINK_TOKENS][:length]
        context.append((quantized, full, sinks.float()))
    query_pos = computed + torch.arange(num_queries, device=device)
    keys_pos = torch.arange(length, device=device)
    seen = keys_pos[None, :] <= query_pos[:, None]
    stride = LOW_BIT_WINDOW_BLOCKS * block  # positions per span of window blocks
    window_from = (query_pos + 1) // stride * stride
    use_full = seen & (keys_pos[None, :] >= window_from[:, None])
    num_sinks = min(LOW_BIT_SINK_TOKENS, length)
    use_sinks = seen[:, :num_sinks] & (window_from[:, None] > 0)  # past the first span
    use_quantized = seen & ~use_full
    use_quantized[:, :num_sinks] &= ~use_sinks
    q = query.float().transpose(0, 1)  # [heads, q, d]
    group = query.shape[1] // key.shape[1]
    (kq, kf, ks), (vq, vf, vs) = [
        [part.transpose(0, 1).repeat_interleave(group, 0) for part in parts] for parts in context
    ]
    scores = torch.where(use_full, _capped(q @ kf.transpose(1, 2) * scale, softcap), float("-inf"))
    scores = torch.where(use_quantized, _capped(q @ kq.transpose(1, 2) * scale, softcap), scores)
    sink_scores = _capped(q @ ks.transpose(1, 2) * scale, softcap)
    scores[..., :num_sinks] = torch.where(use_sinks, sink_scores, scores[..., :num_sinks])
    probs = scores.softmax(dim=-1)
    out = (probs * use_quantized) @ vq + (probs * use_full) @ vf + (probs[..., :num_sinks] * use_sinks) @ vs
    return out.transpose(0, 1).to(query.dtype)


def prefill_segments(
    fmt: LowBitKVCacheFormat, span: LowBitSpan
) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """A span's queries cut where their window starts over (every R blocks), each piece with the context
    its queries see, as plain K/V rows in the new rows' dtype: (first query, end query, keys [end position,
    kv_heads, d], values). Its queries are the last of their context: a causal kernel takes each piece."""
    key, value, recent, earlier, computed, block = (
        span.key,
        span.value,
        span.recent,
        span.earlier,
        span.computed,
        span.block,
    )
    num_queries, dtype = key.shape[0], key.dtype
    length = computed + num_queries
    stride = LOW_BIT_WINDOW_BLOCKS * block  # positions per span of window blocks
    sealed = length // block * block
    start = first_window(computed, block)
    parts = []
    for index, (cache, new) in enumerate(((span.key_cache, key), (span.value_cache, value))):
        quantized = fmt.read_blocks(cache, span.table[: sealed // block], block, keys=index == 0).flatten(
            0, 1
        )
        full = torch.cat((earlier[index].to(dtype), new))  # positions start .. length - 1
        sinks = recent[2 + index][span.sink * LOW_BIT_SINK_TOKENS : (span.sink + 1) * LOW_BIT_SINK_TOKENS]
        parts.append((quantized.to(dtype), full, sinks.to(dtype)))
    pieces = []
    first = computed
    while first < length:
        window_from = (first + 1) // stride * stride  # the piece's queries: those whose window starts here
        end = min((window_from + stride) - 1, length)
        context = []
        for quantized, full, sinks in parts:
            rows = torch.empty(end, *key.shape[1:], dtype=dtype, device=key.device)
            rows[:window_from] = quantized[:window_from]
            rows[window_from:] = full[window_from - start : end - start]
            if window_from:
                rows[:LOW_BIT_SINK_TOKENS] = sinks
            context.append(rows)
        pieces.append((first - computed, end - computed, *context))
        first = end
    return pieces


def _attend(query, keys, values, mask, scale: float, softcap: float) -> torch.Tensor:
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = _capped(query @ keys.transpose(-1, -2) * scale, softcap).masked_fill_(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ values


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return scores if not softcap else scores.div(softcap).tanh_().mul_(softcap)
