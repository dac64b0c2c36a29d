"""Tensor- and pipeline-parallel settings and the arithmetic of splitting a model's heads, MLP and
vocabulary over tensor-parallel ranks and its decoder layers over pipeline stages.

The split rules live here, beside the config, because the engine sizes its KV pool from them
before any process or model exists; models/ and distributed/ read the same functions.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

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


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer runs, one per stage: an even split whose remainder goes one layer each to
    the stages before the last, from the last but one backwards (as vLLM: the last stage also runs
    the norm and the output projection, the first the embedding)."""
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {num_stages} leaves a stage with no decoder layer: the model has "
            f"{num_layers} layers, and each stage needs at least one"
        )
    sizes = [num_layers // num_stages] * num_stages
    for stage in range(num_stages - 1 - num_layers % num_stages, num_stages - 1):
        sizes[stage] += 1
    starts = [sum(sizes[:stage]) for stage in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over processes; `create` validates it against the architecture."""

    tensor_parallel_size: int = 1  # ranks the model's heads, MLP and vocabulary are split over
    pipeline_parallel_size: int = 1  # stages the decoder layers are split over, each of T ranks
    distributed_executor_backend: str = "mp"  # "mp": worker processes on this machine
    collective_timeout_seconds: float = 300.0  # a collective that waits longer fails (a rank hung)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def max_kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads of the rank holding the most: every rank's pool has as many blocks as its."""
        return split_sizes(num_kv_heads, self.tensor_parallel_size)[0]

    def max_layers_per_stage(self, num_layers: int) -> int:
        """Layers of the fullest pipeline stage: every stage's pool has as many blocks as its."""
        return max(map(len, stage_layer_ranges(num_layers, self.pipeline_parallel_size)))

    def threads_per_rank(self) -> int:
        """Each rank's share of this process's CPUs, at least one."""
        return max(1, len(os.sched_getaffinity(0)) // self.world_size)

    @classmethod
    def create(
        cls,
        tensor_parallel_size: int,
        backend: str,
        timeout: float,
        num_kv_heads: int,
        pipeline_parallel_size: int = 1,
        num_layers: int | None = None,
    ) -> ParallelConfig:
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {pipeline_parallel_size}")
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
        if num_layers is not None:
            stage_layer_ranges(num_layers, pipeline_parallel_size)  # every stage needs a layer
        config = cls(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            distributed_executor_backend=backend,
            collective_timeout_seconds=timeout,
        )
        cpus = len(os.sched_getaffinity(0))
        if config.world_size > cpus:
            logger.warning(
                "%d ranks (tensor x pipeline parallel) are more than the %d CPUs", config.world_size, cpus
            )
        return config
