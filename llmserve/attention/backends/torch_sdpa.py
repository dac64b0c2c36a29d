"""Reference attention over the paged KV cache in plain PyTorch (the correctness oracle).

Decodes are batched: each decode gathers its context K/V through its block table into one padded
tensor and a single masked SDPA call serves them all. Prefill chunks run one SDPA call per sequence
with a causal mask offset by the context already cached. Faster backends are tested against this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.worker.forward_context import AttentionMetadata, PrefillSpan


class TorchSDPABackend:
    name = "torch"
    needs_gathered_decode = True  # wants decode_context_slots / decode_context_mask in the metadata

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        key_cache.index_copy_(0, metadata.slot_mapping, key)
        value_cache.index_copy_(0, metadata.slot_mapping, value)
        output = torch.empty_like(query)
        num_decodes = metadata.num_decode_tokens
        if num_decodes:
            output[:num_decodes] = self._decode(query[:num_decodes], key_cache, value_cache, metadata, scale)
        for span in metadata.prefills:
            output[span.query_start : span.query_end] = self._prefill(
                query[span.query_start : span.query_end], key_cache, value_cache, span, scale
            )
        return output

    def _decode(
        self, query, key_cache, value_cache, metadata: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        slots = metadata.decode_context_slots
        valid = metadata.decode_context_mask.view(slots.shape[0], slots.shape[1], 1, 1)
        # Padding slots may hold anything (even NaN): zero them, since 0 * NaN survives the mask.
        keys = key_cache[slots].masked_fill_(~valid, 0).transpose(1, 2)  # [B, kv_heads, ctx, head_dim]
        values = value_cache[slots].masked_fill_(~valid, 0).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),  # [B, heads, 1, head_dim]
            keys,
            values,
            attn_mask=metadata.decode_context_mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    @staticmethod
    def _prefill(query, key_cache, value_cache, span: PrefillSpan, scale: float) -> torch.Tensor:
        num_queries = query.shape[0]
        context_len = span.context_slots.shape[0]
        keys = key_cache[span.context_slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, head_dim]
        values = value_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
        queries = query.transpose(0, 1).unsqueeze(0)  # [1, heads, q, head_dim]
        if context_len == num_queries:
            out = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            # Query i sits at position context_len - num_queries + i and sees keys up to there.
            query_pos = torch.arange(context_len - num_queries, context_len, device=query.device)
            key_pos = torch.arange(context_len, device=query.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        return out.squeeze(0).transpose(0, 1)
