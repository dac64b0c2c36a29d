"""Reference attention over the paged KV cache in plain PyTorch (the correctness oracle).

Decodes are batched: each decode gathers its context K/V through its block table into one padded
tensor and a single masked SDPA call serves them all. Prefill chunks run one SDPA call per sequence
with a causal mask offset by the context already cached. Faster backends are tested against this.
A token tree's verify span (sample/token_tree.py) carries its own mask (`PrefillSpan.tree_mask`);
this is the only backend that takes one, so steps with a tree run here whatever the engine's backend.

The KV cache format (`kv_format.py`) decides how rows are written and read back: as they are, or
quantized on write and dequantized here, after the gather. With a sliding window (and attention
sinks) the model runner hands over only the live context positions; the prefill mask then also
hides keys that have left a query's window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.attention import low_bit
from llmserve.attention.kv_format import KVCacheFormat, get_kv_cache_format
from llmserve.forward_context import AttentionMetadata, PrefillSpan


class TorchSDPABackend:
    name = "torch"
    needs_gathered_decode = True  # wants decode_context_slots / decode_context_mask in the metadata
    max_decode_query_len = 1  # the batched decode call serves single-token rows; longer spans are prefills

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        self.kv_format: KVCacheFormat = get_kv_cache_format(kv_cache_dtype)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_slots, num_kv_heads, row] (row: see kv_format.py)
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,  # this layer's own sliding window (LocalAttention); 0: the engine's, if any
        softcap: float = 0.0,  # soft-cap of the scores (0: none)
        recent: tuple[torch.Tensor, ...] | None = None,  # int4/int2: windows and sinks (low_bit.py)
    ) -> torch.Tensor:
        if self.kv_format.is_low_bit:
            return self._low_bit(query, key, value, key_cache, value_cache, recent, metadata, scale, softcap)
        self.kv_format.write(key_cache, metadata.slot_mapping, key)
        self.kv_format.write(value_cache, metadata.slot_mapping, value)
        num_decodes = metadata.num_decode_tokens
        options = (window or metadata.sliding_window, softcap)
        if not metadata.prefills:  # all decodes (most steps): no output buffer to fill piecewise
            return self._decode(query, key_cache, value_cache, metadata, scale, *options)
        output = torch.empty_like(query)
        if num_decodes:
            output[:num_decodes] = self._decode(
                query[:num_decodes], key_cache, value_cache, metadata, scale, *options
            )
        for span in metadata.prefills:
            output[span.query_start : span.query_end] = self._prefill(
                query[span.query_start : span.query_end],
                key_cache,
                value_cache,
                span,
                metadata,
                scale,
                *options,
            )
        return output

    def _low_bit(
        self, query, key, value, key_cache, value_cache, recent, metadata: AttentionMetadata, scale, softcap
    ):
        """A 4-bit or 2-bit cache (attention/low_bit.py): the reference on every span."""
        plan, block, fmt = metadata.recent_kv, metadata.block_size, self.kv_format
        first_prefill = len(plan.computed) - len(metadata.prefills)
        prefills = range(first_prefill, len(plan.computed))
        earlier = [(recent[0][rows], recent[1][rows]) for rows in plan.earlier_rows]  # before the writes
        low_bit.write_step(fmt, key_cache, value_cache, key, value, recent, plan, block)
        output = torch.empty_like(query)
        if first_prefill:
            rows = metadata.num_decode_tokens
            output[:rows] = self._low_bit_decode(
                query[:rows], key_cache, value_cache, recent, metadata, scale, softcap
            )
        for span, i, rows in zip(metadata.prefills, prefills, earlier, strict=True):
            span_rows = slice(span.query_start, span.query_end)
            parts = low_bit.LowBitSpan(
                key[span_rows], value[span_rows], key_cache, value_cache, recent, rows, plan.tables[i],
                plan.sink_entries[i], plan.computed[i], block,
            )  # fmt: skip
            output[span_rows] = self._low_bit_prefill(query[span_rows], parts, scale, softcap)
        return output

    def _low_bit_prefill(self, query, span: low_bit.LowBitSpan, scale: float, softcap: float) -> torch.Tensor:
        return low_bit.prefill(self.kv_format, query, span, scale, softcap)

    def _low_bit_decode(
        self, query, key_cache, value_cache, recent, metadata: AttentionMetadata, scale, softcap
    ):
        return low_bit.decode(self.kv_format, query, key_cache, value_cache, recent, metadata, scale, softcap)

    def _decode(
        self, query, key_cache, value_cache, metadata: AttentionMetadata, scale: float, window=0, softcap=0.0
    ) -> torch.Tensor:
        slots = metadata.decode_context_slots
        valid = metadata.decode_context_mask.view(slots.shape[0], slots.shape[1], 1, 1)
        read = self.kv_format.read
        # Padding slots may hold anything (even NaN): zero them, since 0 * NaN survives the mask.
        keys = read(key_cache, slots, query.dtype).masked_fill_(~valid, 0).transpose(1, 2)
        values = read(value_cache, slots, query.dtype).masked_fill_(~valid, 0).transpose(1, 2)
        mask = metadata.decode_context_mask
        if window and not metadata.sliding_window:  # a layer's own window over the whole context
            columns = torch.arange(slots.shape[1], device=slots.device)
            in_window = columns[None, :] >= (metadata.decode_seq_lens - window)[:, None]
            mask = mask & in_window[:, None, None, :]
        out = attend(query.unsqueeze(2), keys, values, mask, scale, softcap)  # [B, heads, 1, head_dim]
        return out.squeeze(2)

    def _prefill(
        self,
        query,
        key_cache,
        value_cache,
        span: PrefillSpan,
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        num_queries = query.shape[0]
        context_len = span.context_slots.shape[0]
        read = self.kv_format.read
        keys = read(key_cache, span.context_slots, query.dtype).transpose(0, 1).unsqueeze(0)
        values = read(value_cache, span.context_slots, query.dtype).transpose(0, 1).unsqueeze(0)
        queries = query.transpose(0, 1).unsqueeze(0)  # [1, heads, q, head_dim]
        if span.tree_mask is not None:  # a token tree's verify span: each draft sees its ancestors only
            out = attend(queries, keys, values, span.tree_mask, scale, softcap)
        elif (
            context_len == num_queries
            and span.context_positions is None
            and context_len <= (window or context_len)
        ):
            if not softcap:
                out = F.scaled_dot_product_attention(
                    queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                causal = torch.ones(num_queries, context_len, dtype=torch.bool, device=query.device).tril()
                out = attend(queries, keys, values, causal, scale, softcap)
        else:
            mask = _prefill_mask(span, num_queries, metadata, query.device, window)
            out = attend(queries, keys, values, mask, scale, softcap)
        return out.squeeze(0).transpose(0, 1)


def attend(query, keys, values, mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """Masked attention; with a soft-cap, written out (SDPA has none): scores in float32, capped,
    masked, softmax, as HF's eager Gemma 2 attention."""
    if not softcap:
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    groups = query.shape[-3] // keys.shape[-3]
    keys = keys.repeat_interleave(groups, dim=-3)
    values = values.repeat_interleave(groups, dim=-3)
    scores = (query @ keys.transpose(-1, -2)).float().mul_(scale / softcap).tanh_().mul_(softcap)
    scores = scores.masked_fill_(~mask, float("-inf"))
    return scores.softmax(dim=-1).to(values.dtype) @ values


def _prefill_mask(
    span: PrefillSpan, num_queries: int, metadata: AttentionMetadata, device: torch.device, window: int = 0
) -> torch.Tensor:
    """[q, ctx] True where query i may see key j: causal, and within sinks + window if any.

    The queries are the span's last positions; keys are position-ordered (a gap where blocks left the
    window), so the causal part is the usual offset triangle."""
    key_pos = span.context_positions
    if key_pos is None:
        key_pos = torch.arange(span.context_slots.shape[0], device=device)
    query_pos = key_pos[-num_queries:]
    mask = key_pos[None, :] <= query_pos[:, None]
    if window:
        in_window = query_pos[:, None] - key_pos[None, :] < window
        mask &= in_window | (key_pos[None, :] < metadata.attention_sinks)
    return mask
