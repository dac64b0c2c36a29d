"""Tensor-parallel settings and the arithmetic of splitting a model's heads, MLP and vocabulary.

The split rules live here, beside the config, because the engine sizes its KV pool from them
before any process or model exists; models/ and distributed/ read the same functions.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # llmserve.config imports this module
    from llmserve.config import ModelArchConfig

logger = logging.getLogger("llmserve")

BACKENDS = ("mp",)


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` units over `parts` ranks as evenly as possible, the first ranks taking one more."""
    base, extra = divmod(total, parts)
    return [base + (rank < extra) for rank in range(parts)]


def split_range(total: int, parts: int, rank: int) -> range:
    """The units of `rank` under `split_sizes`: a contiguous range."""
    sizes = split_sizes(total, parts)
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over processes; `create` validates it against the architecture."""

    tensor_parallel_size: int = 1  # ranks the model's heads, MLP and vocabulary are split over
    distributed_executor_backend: str = "mp"  # "mp": worker processes on this machine
    collective_timeout_seconds: float = 300.0  # a collective that waits longer fails (a rank hung)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def max_kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads of the rank holding the most: every rank's pool has as many blocks as its."""
        return split_sizes(num_kv_heads, self.tensor_parallel_size)[0]

    def row_parallel_in_features(self, arch: ModelArchConfig) -> tuple[int, ...]:
        """Each rank's input width of o_proj (its query heads) and down_proj (its MLP units);
        empty without tensor parallelism."""
        if self.tensor_parallel_size == 1:
            return ()
        query_heads_per_kv = arch.num_attention_heads // arch.num_key_value_heads
        kv_heads = split_sizes(arch.num_key_value_heads, self.tensor_parallel_size)
        return tuple(heads * query_heads_per_kv * arch.head_dim for heads in kv_heads) + tuple(
            split_sizes(arch.intermediate_size, self.tensor_parallel_size)
        )

    def threads_per_rank(self) -> int:
        """Each rank's share of this process's CPUs, at least one."""
        return max(1, len(os.sched_getaffinity(0)) // self.tensor_parallel_size)

    @classmethod
    def create(
        cls, tensor_parallel_size: int, backend: str, timeout: float, num_kv_heads: int
    ) -> ParallelConfig:
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if backend not in BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(BACKENDS)}, got {backend!r}"
            )
        if timeout <= 0:
            raise ValueError(f"distributed_timeout_seconds must be > 0, got {timeout}")
        if tensor_parallel_size > num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {tensor_parallel_size} leaves a rank with no KV head: the model has "
                f"{num_kv_heads} KV heads, and each rank needs at least one"
            )
        cpus = len(os.sched_getaffinity(0))
        if tensor_parallel_size > cpus:
            logger.warning(
                "tensor_parallel_size %d is more ranks than the %d CPUs", tensor_parallel_size, cpus
            )
        return cls(tensor_parallel_size, backend, timeout)
