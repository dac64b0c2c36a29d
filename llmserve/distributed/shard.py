"""Which part of a Llama-family model one tensor-parallel rank holds (Megatron's split).

Heads split by KV-head group: a rank holds some KV heads and the query heads that attend to them,
so attention needs no communication; the groups may be uneven (9 query / 3 KV heads over 2 ranks:
6 + 3 query, 2 + 1 KV). The MLP's intermediate units split as evenly as they go. The vocabulary
splits into equal blocks of ceil(V / N) rows, the last padded with zero rows, so the logits of every
rank have one shape and gather into one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.config import ModelArchConfig
from llmserve.config.parallel import split_range


@dataclass(frozen=True)
class ShardLayout:
    rank: int
    world_size: int
    kv_heads: range
    q_heads: range
    intermediate: range
    vocab: range  # the vocabulary rows this rank holds
    vocab_rows: int  # rows of its embedding and output projection (vocab, then zero padding)

    @classmethod
    def of(cls, arch: ModelArchConfig, world_size: int = 1, rank: int = 0) -> ShardLayout:
        kv_heads = split_range(arch.num_key_value_heads, world_size, rank)
        if not kv_heads:
            raise ValueError(
                f"tensor_parallel_size {world_size} leaves a rank with no KV head: the model has "
                f"{arch.num_key_value_heads} KV heads, and each rank needs at least one"
            )
        group = arch.num_attention_heads // arch.num_key_value_heads  # query heads per KV head
        vocab_rows = -(-arch.vocab_size // world_size)
        vocab_start = min(rank * vocab_rows, arch.vocab_size)
        return cls(
            rank=rank,
            world_size=world_size,
            kv_heads=kv_heads,
            q_heads=range(kv_heads.start * group, kv_heads.stop * group),
            intermediate=split_range(arch.intermediate_size, world_size, rank),
            vocab=range(vocab_start, min(vocab_start + vocab_rows, arch.vocab_size)),
            vocab_rows=vocab_rows,
        )
