"""A tied token embedding read from its output projection's packed copy (quantized, or bf16).

A model whose embedding is tied to its output projection holds one matrix; once quantization has
replaced that projection by a packed layer, the float embedding table would be a second copy of the
same weights (SmolLM2-135M's: vocab 49152 x 576, 108 MiB in float32). Where the packed rows are the
very values the float table was loaded from (a GGUF's `token_embd` kept in its blocks, read by
`quantization gguf`), the lookup rebuilds the rows it needs from the packed copy instead
(`LinearKernel.weight_rows`: the same float32 values, then the model's dtype, as the float load did)
and the float table is freed. Elsewhere (int8/int4 methods quantize the head from the float table, so
its rows differ from the table's) the float table stays. A bf16 head on the CPU's small-batch kernel
(`LogitsLinear`) holds the table's own bf16 values in its packed layout: the lookup reads them there
and the table goes too (`embed_from_packed_head`).

Readers that need the whole matrix (a draft head's compiled chain, head training) call
`models/layers/vocab_embedding.embedding_table`, which rebuilds it for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from llmserve.distributed.group import TensorParallelGroup
from llmserve.kernels.small_batch_linear import LogitsLinear

logger = logging.getLogger("llmserve")


class HeadRowsEmbedding(nn.Module):
    """The rank's vocabulary block of the embedding (as `VocabParallelEmbedding`), its rows read from
    the tied output projection's packed copy, which stays that projection's module (only its row
    readers, bound methods, are held here: no second owner of its buffers)."""

    def __init__(
        self,
        head: nn.Module,
        weight_rows: Callable[[torch.Tensor], torch.Tensor],
        table: Callable[[], torch.Tensor],
        vocab: range,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self._weight_rows, self._table = weight_rows, table
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features  # padding included
        self.vocab = vocab
        self.dtype = dtype
        self.tp = tp

    @classmethod
    def of_quantized(cls, head: nn.Module, vocab: range, dtype: torch.dtype, tp: TensorParallelGroup):
        """Over a quantized head's kernel (`LinearKernel.weight_rows`, float32, then `dtype`)."""
        kernel = head.kernel
        return cls(head, kernel.weight_rows, lambda: kernel.dequantize(torch.float32), vocab, dtype, tp)

    @classmethod
    def of_blocks(cls, blocks: nn.Module, vocab: range, dtype: torch.dtype, tp: TensorParallelGroup):
        """Over an untied embedding's own quantized copy (`blocks`, a QuantizedLinear of its rows),
        which this module holds."""
        embedding = cls.of_quantized(blocks, vocab, dtype, tp)
        embedding.blocks = blocks
        return embedding

    def rows(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows `local_ids` of this rank's block, in the model's dtype."""
        return self._weight_rows(local_ids).to(self.dtype)

    def table(self) -> torch.Tensor:
        """The whole block as a float table (a new tensor each call: for readers of the whole matrix)."""
        return self._table().to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.rows(input_ids)
        local = input_ids - self.vocab.start
        elsewhere = (local < 0) | (local >= len(self.vocab))
        hidden = self.rows(local.masked_fill(elsewhere, 0))
        return self.tp.all_reduce(hidden.masked_fill_(elsewhere.unsqueeze(-1), 0))

    def extra_repr(self) -> str:
        source = "its own blocks" if hasattr(self, "blocks") else "the output projection's packed copy"
        return f"{self.num_embeddings}, {self.embedding_dim}, rows from {source}"


def lookup_blocks(model: nn.Module) -> set[int]:
    """The ids of the modules that hold an untied embedding's own blocks (`embed_from_blocks`): read a
    row per token by lookups, never multiplied, so neither a decode step's weight stream nor a
    question of batch invariance."""
    embeddings = [m for m in model.modules() if isinstance(m, HeadRowsEmbedding)]
    return {id(m.blocks) for m in embeddings if hasattr(m, "blocks")}


def embed_from_head(model: nn.Module, dtype: torch.dtype) -> bool:
    """Swap `model`'s tied float embedding for a `HeadRowsEmbedding` over its quantized output
    projection, where this pipeline stage holds both and the kernel gives exact rows; returns
    whether it did (the float table is then freed). The caller vouches that the head was quantized
    from the embedding's own values (a GGUF's shared `token_embd`)."""
    inner, head = model.model, model.lm_head
    if inner.embed_tokens is None or head is None or not hasattr(head, "kernel"):
        return False
    device = next(head.kernel.buffers()).device
    if head.kernel.weight_rows(torch.zeros(1, dtype=torch.long, device=device)) is None:
        logger.info(
            "quantization: kernel %s cannot rebuild embedding rows exactly; the tied embedding stays "
            "in float",
            type(head.kernel).__name__,
        )
        return False
    table = inner.embed_tokens.weight
    inner.embed_tokens = HeadRowsEmbedding.of_quantized(head, inner.embed_tokens.vocab, dtype, model.tp)
    logger.info(
        "quantization: the tied embedding reads its rows from the output projection's quantized copy "
        "(%.1f MiB float table freed)",
        table.numel() * table.element_size() / 2**20,
    )
    return True


def embed_from_blocks(model: nn.Module, weight, dtype: torch.dtype, device) -> None:
    """Give `model` (whose float embedding table was never loaded) the embedding `weight` holds, this
    rank's rows of an untied GGUF `token_embd` in its blocks: looked up row by row from its kernel's
    packed copy (`LinearKernel.weight_rows`, equal to the file's dequantized rows, then `dtype`, as the
    float load gives them), or where that kernel cannot rebuild rows exactly, the float table itself."""
    from llmserve.quantization.kernels import QuantizedLinear

    inner = model.model
    blocks = QuantizedLinear(weight, None, dtype, device)
    if blocks.kernel.weight_rows(torch.zeros(1, dtype=torch.long, device=torch.device(device))) is None:
        table = weight.dequantize(torch.float32).to(device, dtype)
        inner.embed_tokens.weight = nn.Parameter(table, requires_grad=False)
        return
    inner.embed_tokens = HeadRowsEmbedding.of_blocks(blocks, inner.embed_tokens.vocab, dtype, model.tp)
    logger.info(
        "quantization: the embedding reads its rows from its own blocks (%s, no float table)",
        type(blocks.kernel).__name__,
    )


def embed_from_packed_head(model: nn.Module) -> bool:
    """Swap `model`'s tied bf16 embedding for a `HeadRowsEmbedding` over its output projection's packed
    copy (a `LogitsLinear`: the same bf16 values, kernels/small_batch_linear.py), and free the table
    the two shared; returns whether it did."""
    inner, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    embedding = getattr(inner, "embed_tokens", None)
    if type(head) is not LogitsLinear or not isinstance(embedding, nn.Embedding):
        return False
    if head.weight is None or embedding.weight is not head.weight:
        return False  # not tied here (an untied head's weight is freed by the swap itself)
    table = embedding.weight
    inner.embed_tokens = HeadRowsEmbedding(
        head, head.weight_rows, head.table, embedding.vocab, table.dtype, model.tp
    )
    head.weight = None
    logger.info(
        "the tied embedding reads its rows from the output projection's packed copy (%.1f MiB table freed)",
        table.numel() * table.element_size() / 2**20,
    )
    return True
