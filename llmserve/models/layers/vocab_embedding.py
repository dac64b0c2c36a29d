"""The token embedding with its vocabulary split over the tensor-parallel ranks.

Each rank holds a block of rows (distributed/shard.py); it looks up the ids in its block, writes
zeros for the others, and the all-reduce sums each token's one nonzero row into place. A model
tying its output projection to this weight gets the same block of the vocabulary there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.distributed.group import TensorParallelGroup
from llmserve.distributed.shard import ShardLayout


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, shard: ShardLayout, hidden_size: int, tp: TensorParallelGroup) -> None:
        # An explicit (meta) weight skips Embedding's random init, which on the meta device goes through
        # torch._refs and imports torch._dynamo: start-up time for a tensor the checkpoint overwrites.
        super().__init__(shard.vocab_rows, hidden_size, _weight=torch.empty(shard.vocab_rows, hidden_size))
        self.vocab = shard.vocab
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab.start
        elsewhere = (local < 0) | (local >= len(self.vocab))
        hidden = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(elsewhere.unsqueeze(-1), 0))


def embedding_rows(embedding: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a token embedding's table (its vocabulary block under tensor parallelism): a
    float embedding's weight rows, or those a quantized one rebuilds (quantization/embedding.py)."""
    if isinstance(embedding, nn.Embedding):
        return embedding.weight[ids.to(embedding.weight.device)]
    return embedding.rows(ids)


def embedding_table(embedding: nn.Module) -> torch.Tensor:
    """A token embedding's whole table: a float embedding's weight, or for a quantized one a float
    copy rebuilt on each call (for readers that truly need the whole matrix)."""
    if isinstance(embedding, nn.Embedding):
        return embedding.weight
    return embedding.table()
