"""Tensor- and pipeline-parallel settings and the arithmetic of splitting a model's heads, MLP and
vocabulary over tensor-parallel ranks and its decoder layers over pipeline stages.

The split rules live here, beside the config, because the engine sizes its KV pool from them
before any process or model exists; models/ and distributed/ read the same functions. The
multi-node fields (`nnodes`, `node_rank`, `master_addr`, `master_port`) are vLLM's.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:  # llmserve.config imports this module
    from llmserve.config import ModelArchConfig

logger = logging.getLogger("llmserve")

ExecutorBackend = Literal["mp", "ray"]  # mp: processes llmserve starts; ray: Ray actors
BACKENDS: tuple[str, ...] = get_args(ExecutorBackend)
# Expert parallelism's dispatch (vLLM's --all2all-backend): "naive", every rank has every token (here
# the attention before is tensor-parallel) and computes its experts' pairs, one all-reduce combining
# them; "all_to_all", each rank routes its slice and all-to-alls send the pairs' rows both ways
All2AllBackend = Literal["naive", "all_to_all"]
ALL2ALL_BACKENDS: tuple[str, ...] = get_args(All2AllBackend)
DEFAULT_MASTER_PORT = 29501  # vLLM's --master-port default


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` units over `parts` ranks as evenly as possible, the first ranks taking one more."""
    base, extra = divmod(total, parts)
    return [base + (rank < extra) for rank in range(parts)]


def split_range(total: int, parts: int, rank: int) -> range:
    """The units of `rank` under `split_sizes`: a contiguous range."""
    sizes = split_sizes(total, parts)
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])


# Tensor parallelism cuts the experts' units in runs of this many: the grouped matmul needs the row
# stride of its operands a multiple of 16 bytes, which a run of 8 units keeps in every dtype served.
EXPERT_UNIT_ALIGNMENT = 8


def check_expert_split(num_experts: int, units: int, world_size: int, expert_parallel: bool) -> None:
    """A one-line error where a mixture-of-experts layer leaves a rank without experts (expert
    parallelism) or without a run of each expert's units (tensor parallelism)."""
    if expert_parallel and num_experts < world_size:
        raise ValueError(
            f"expert parallelism over {world_size} ranks leaves a rank with no expert: the model has "
            f"{num_experts} experts"
        )
    if not expert_parallel and -(-units // EXPERT_UNIT_ALIGNMENT) < world_size:
        raise ValueError(
            f"tensor parallelism over {world_size} ranks leaves a rank without {EXPERT_UNIT_ALIGNMENT} of "
            f"each expert's {units} units (--enable-expert-parallel splits the experts instead)"
        )


def expert_unit_range(units: int, world_size: int, rank: int) -> range:
    """`rank`'s units of every expert under tensor parallelism: runs of EXPERT_UNIT_ALIGNMENT split
    as evenly as they go, the last run short."""
    runs = split_range(-(-units // EXPERT_UNIT_ALIGNMENT), world_size, rank)
    return range(runs.start * EXPERT_UNIT_ALIGNMENT, min(runs.stop * EXPERT_UNIT_ALIGNMENT, units))


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
    distributed_executor_backend: ExecutorBackend = (
        "mp"  # "mp": processes started by llmserve; "ray": Ray actors
    )
    collective_timeout_seconds: float = 300.0  # a collective that waits longer fails (a rank hung)
    nnodes: int = 1  # mp: machines the ranks run on, world_size / nnodes ranks on each
    node_rank: int = 0  # mp: this machine's index; node 0 runs the engine (rank 0)
    master_addr: str = "127.0.0.1"  # mp across nodes, ray: the address node 0's rendezvous listens on
    master_port: int = DEFAULT_MASTER_PORT  # mp across nodes: its port (ray and one node: a free port)
    pipeline_parallel_size: int = 1  # stages the decoder layers are split over, each of T ranks
    enable_expert_parallel: bool = False  # MoE layers: experts split over the T ranks, not their units
    all2all_backend: All2AllBackend = "naive"  # how expert parallelism reaches the experts' ranks

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        """mp: the ranks each machine starts (ray places them wherever the cluster has room)."""
        return self.world_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """mp: the global ranks of this machine's processes, rank 0 on node 0 among them."""
        start = self.node_rank * self.ranks_per_node
        return range(start, start + self.ranks_per_node)

    def rank_name(self, rank: int) -> str:
        """How errors and logs name global `rank`: by its pipeline stage where there are stages."""
        if self.pipeline_parallel_size == 1:
            return f"tensor-parallel rank {rank}"
        return f"pipeline stage {rank // self.tensor_parallel_size}'s rank {rank}"

    def max_kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads of the rank holding the most: every rank's pool has as many blocks as its."""
        return split_sizes(num_kv_heads, self.tensor_parallel_size)[0]

    def max_layers_per_stage(self, num_layers: int) -> int:
        """Layers of the fullest pipeline stage: every stage's pool has as many blocks as its."""
        return max(map(len, stage_layer_ranges(num_layers, self.pipeline_parallel_size)))

    def row_parallel_in_features(self, arch: ModelArchConfig) -> tuple[int, ...]:
        """Each rank's input width of o_proj (its query heads), down_proj (its MLP units) and, where
        experts split by units, the experts' down_proj; empty without tensor parallelism."""
        if self.tensor_parallel_size == 1:
            return ()
        query_heads_per_kv = arch.num_attention_heads // arch.num_key_value_heads
        kv_heads = split_sizes(arch.num_key_value_heads, self.tensor_parallel_size)
        widths = tuple(heads * query_heads_per_kv * arch.head_dim for heads in kv_heads) + tuple(
            split_sizes(arch.intermediate_size, self.tensor_parallel_size)
        )
        if not arch.num_experts or self.enable_expert_parallel:
            return widths
        units = arch.moe_intermediate_size or arch.intermediate_size
        ranks = range(self.tensor_parallel_size)
        return widths + tuple(len(expert_unit_range(units, len(ranks), rank)) for rank in ranks)

    def threads_per_rank(self) -> int:
        """Each rank's share of this process's CPUs, at least one (ranks on this machine only)."""
        local_ranks = self.ranks_per_node if self.distributed_executor_backend == "mp" else self.world_size
        return max(1, len(os.sched_getaffinity(0)) // local_ranks)

    @classmethod
    def create(
        cls,
        tensor_parallel_size: int,
        backend: ExecutorBackend,
        timeout: float,
        num_kv_heads: int,
        nodes: NodeArgs | None = None,
        pipeline_parallel_size: int = 1,
        num_layers: int | None = None,
        enable_expert_parallel: bool = False,
        all2all_backend: All2AllBackend = "naive",
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
        if all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(
                f"all2all_backend must be one of {', '.join(ALL2ALL_BACKENDS)}, got {all2all_backend!r}"
            )
        if all2all_backend != "naive" and not enable_expert_parallel:
            raise ValueError(f"--all2all-backend {all2all_backend} needs --enable-expert-parallel")
        if tensor_parallel_size > num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {tensor_parallel_size} leaves a rank with no KV head: the model has "
                f"{num_kv_heads} KV heads, and each rank needs at least one"
            )
        if pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {pipeline_parallel_size}")
        if num_layers is not None:
            stage_layer_ranges(num_layers, pipeline_parallel_size)  # every stage needs a layer
        world_size = tensor_parallel_size * pipeline_parallel_size
        nodes = nodes or NodeArgs()
        nodes.validate(world_size, backend)
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "--distributed-executor-backend ray needs Ray, which is not installed: "
                "pip install 'llmserve[ray]' (on every node)"
            )
        cpus = len(os.sched_getaffinity(0))
        local_ranks = world_size // nodes.nnodes
        if backend == "mp" and local_ranks > cpus:
            logger.warning("%d ranks on this machine, more than its %d CPUs", local_ranks, cpus)
        return cls(
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=backend,
            collective_timeout_seconds=timeout,
            nnodes=nodes.nnodes,
            node_rank=nodes.node_rank or 0,
            master_addr=nodes.master_addr or "127.0.0.1",
            master_port=nodes.master_port or DEFAULT_MASTER_PORT,
            pipeline_parallel_size=pipeline_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            all2all_backend=all2all_backend,
        )


@dataclass(frozen=True)
class NodeArgs:
    """The multi-node flags as given, before `ParallelConfig.create` checks them."""

    nnodes: int = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None

    def validate(self, world_size: int, backend: str) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if backend == "ray" and (self.nnodes > 1 or self.node_rank is not None):
            raise ValueError(
                "--nnodes and --node-rank are for --distributed-executor-backend mp; "
                "Ray places the ranks on its cluster's nodes itself"
            )
        if self.node_rank is not None and self.nnodes == 1:
            raise ValueError("--node-rank needs --nnodes (the number of machines, at least 2)")
        if self.nnodes > 1 and self.node_rank is None:
            raise ValueError(f"--nnodes {self.nnodes} needs --node-rank (0 on the engine's machine)")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if world_size % self.nnodes:
            raise ValueError(
                f"world size {world_size} (tensor x pipeline parallel) does not split over "
                f"--nnodes {self.nnodes}: every node runs the same number of ranks"
            )
        if self.nnodes > 1 and self.master_addr is None:
            raise ValueError("--nnodes needs --master-addr: the address of node 0, reachable from every node")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be in [1, 65535], got {self.master_port}")
