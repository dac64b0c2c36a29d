"""The attention module models call: writes new K/V into the paged cache, attends over it."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention.registry import get_attention_backend
from llmserve.forward_context import get_attention_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str = "torch") -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = get_attention_backend(backend)
        # Bound by the model runner to views of the preallocated pool: [num_slots, kv_heads, head_dim].
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.kv_group = 0  # its KV-cache group (config/kv_groups.py), whose block table it reads
        # int4/int2 caches: views of the full-precision windows and sinks (worker/recent_kv.py): K and V
        # rows [slots * window, kv_heads, head_dim], then K and V rows [sink entries, kv_heads, head_dim]
        self.recent_kv: tuple[torch.Tensor, ...] | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return self._attend(query, key, value)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options) -> torch.Tensor:
        """The backend on this layer's heads and KV views; `options`: a layer's own window, soft-cap."""
        num_tokens = query.shape[0]
        metadata = get_attention_metadata(self.kv_group)
        backend = self.backend if metadata.backend is None else metadata.backend  # token trees: the reference
        if self.recent_kv is not None:
            options["recent"] = self.recent_kv
        out = backend.forward(
            query.view(num_tokens, self.num_heads, self.head_dim),
            key.view(num_tokens, self.num_kv_heads, self.head_dim),
            value.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.key_cache,
            self.value_cache,
            metadata,
            self.scale,
            **options,
        )
        return out.view(num_tokens, self.num_heads * self.head_dim)


class LocalAttention(Attention):
    """Attention with options of its own layer: a scale other than head_dim's, a sliding window of
    its layer kind (Gemma's interleaved local and global layers; the KV cache keeps only the window's
    positions where its KV-cache group is a sliding one, else the window only masks), and soft-capped
    scores (Gemma 2: cap * tanh(scores / cap))."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return self._attend(query, key, value, window=self.sliding_window, softcap=self.softcap)
