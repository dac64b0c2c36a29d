"""Rotary position embeddings (rotate-half layout), with the rope_scaling variants Llama uses."""

from __future__ import annotations

import math

import torch

from llmserve.config.families import rope_scaling_type
from llmserve.models.layers.custom_op import CustomOp


def rope_inverse_frequencies(
    rotary_dim: int, base: float, scaling: dict | None, max_positions: int = 0
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], the factor cos and sin are multiplied by)."""
    inv_freq = 1.0 / (
        base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim)
    )
    kind = rope_scaling_type(scaling)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_scaling(inv_freq, scaling), 1.0
    return _longrope_scaling(inv_freq, scaling, max_positions)


def _longrope_scaling(
    inv_freq: torch.Tensor, scaling: dict, max_positions: int
) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency divisors, the long set where sequences may outgrow the original
    context. HF picks the set per forward from the sequence's length; a paged cache keeps one set for
    every sequence, so an engine whose max_model_len exceeds the original uses the long set throughout
    (HF's numbers for sequences longer than the original context) and otherwise the short one."""
    original = scaling["original_max_position_embeddings"]
    long = max_positions > original
    factors = scaling["long_factor" if long else "short_factor"]
    factors = torch.tensor(factors, dtype=torch.float32, device="cpu")
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq / factors, attention_factor


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, scaled)


class RotaryEmbedding(CustomOp):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        scaling: dict | None,
        device: torch.device,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, attention_factor = rope_inverse_frequencies(self.rotary_dim, base, scaling, max_positions)
        freqs = torch.outer(
            torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq.to(device)
        )
        # Not a registered buffer: derived, never loaded, and must survive meta-device construction.
        self.cos = freqs.cos() * attention_factor
        self.sin = freqs.sin() * attention_factor

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (query, key) [tokens, heads * head_dim]."""
        return self.reference(positions, query, key, head_dim)

    def forward_cpu(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated in place by one compiled call (query and key are views of the fresh qkv projection,
        so nothing else sees them change)."""
        if query.dim() != 2:
            return self.reference(positions, query, key, head_dim)
        self.ops.rotary_embedding(positions, query, key, self.cos, self.sin, head_dim)
        return query, key

    def forward_cuda(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated in place by one Triton launch, on each head's first rotary_dim dimensions (the
        partial rope's too), as forward_cpu does."""
        if not self.ops.takes_rows(query, key) or query.dtype != key.dtype:
            return self.reference(positions, query, key, head_dim)
        self.ops.rotary_embedding(positions, query, key, self.cos, self.sin, head_dim)
        return query, key

    def reference(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The PyTorch formulation: the oracle for the kernels, and the path without them."""
        cos = self.cos[positions].unsqueeze(1)  # [tokens, 1, head_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(query, cos, sin, head_dim), _rotate(key, cos, sin, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    shape = x.shape
    x = x.view(shape[0], -1, head_dim)
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype).view(shape)


class PartialRotaryEmbedding(RotaryEmbedding):
    """Rope on the first `rotary_dim` dimensions of each head, the rest passed through (Phi-3/4's
    `partial_rotary_factor`); the compiled CPU kernel rotates whole heads, so a CPU runs the reference
    (the Triton kernel of forward_cuda rotates the first rotary_dim)."""

    def forward_cpu(self, positions, query, key, head_dim):
        return self.reference(positions, query, key, head_dim)

    def reference(self, positions, query, key, head_dim):
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return self._partial(query, cos, sin, head_dim), self._partial(key, cos, sin, head_dim)

    def _partial(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
        heads = x.reshape(x.shape[0], -1, head_dim)
        rotated = _rotate(heads[..., : self.rotary_dim], cos, sin, self.rotary_dim)
        return torch.cat((rotated, heads[..., self.rotary_dim :]), dim=-1).view(x.shape[0], -1)
