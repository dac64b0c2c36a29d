"""The target's whole vocabulary on rank 0, for a draft head under tensor parallelism.

A draft head embeds the tokens it drafts and scores a subset of the vocabulary with the target's
output rows (proposers/draft_head.py). Under tensor parallelism each rank holds one block of those
rows, and drafting runs on rank 0 alone, between steps, with no collective to reach the others: so
rank 0 keeps a copy of the embedding (and of an untied lm_head) from the checkpoint it loaded, shaped
as the head reads a target (`.arch`, `.model.embed_tokens`, `.lm_head.weight`). For SmolLM2-135M it
is 49,152 x 576 bf16 rows: 54 MiB.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.config import ModelArchConfig


class TargetVocabulary(nn.Module):
    def __init__(self, arch: ModelArchConfig, weights: dict[str, torch.Tensor], device: torch.device) -> None:
        super().__init__()
        self.arch = arch
        self.model = nn.Module()
        embedding = weights["model.embed_tokens.weight"]
        self.model.embed_tokens = nn.Embedding.from_pretrained(embedding.to(device), freeze=True)
        self.lm_head = nn.Module()
        if not arch.tie_word_embeddings:
            self.lm_head.weight = nn.Parameter(weights["lm_head.weight"].to(device), requires_grad=False)
