"""Rotary position embeddings (rotate-half layout), with the rope_scaling variants Llama uses."""

from __future__ import annotations

import math

import torch

from llmserve.models.layers.custom_op import CustomOp


def rope_inverse_frequencies(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    )
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


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
        self, head_dim: int, max_positions: int, base: float, scaling: dict | None, device: torch.device
    ) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, base, scaling).to(device)
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
        # Not a registered buffer: derived, never loaded, and must survive meta-device construction.
        self.cos = freqs.cos()
        self.sin = freqs.sin()

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

    def reference(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The PyTorch formulation: the oracle for the compiled kernel, and the CUDA path."""
        cos = self.cos[positions].unsqueeze(1)  # [tokens, 1, head_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(query, cos, sin, head_dim), _rotate(key, cos, sin, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    shape = x.shape
    x = x.view(shape[0], -1, head_dim)
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype).view(shape)
