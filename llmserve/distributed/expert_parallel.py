"""How a mixture-of-experts layer splits over the ranks of a tensor-parallel group, and the
all-to-all plan of expert parallelism.

Tensor parallelism (the default) splits every expert's intermediate units, as a dense MLP's: each
rank holds all experts' gate/up rows and down columns for its units, routes every token (the router
is replicated), and one all-reduce sums the partial outputs. Expert parallelism
(`--enable-expert-parallel`) splits the experts instead: each rank holds whole experts, a
contiguous run of them. The hidden states entering the layer are the same on every rank (attention
stays tensor-parallel), so the default dispatch (`--all2all-backend naive`) sends nothing: each rank
routes every token, computes the pairs routed to the experts it holds (the experts module skips the
others'), and the all-reduce that tensor parallelism has anyway sums the ranks' partial outputs.

The `all_to_all` dispatch, for ranks that do not share their tokens, routes only this rank's slice
of them, sends each (token, expert) pair's row to the rank holding the expert (one all-to-all), runs
its experts over the rows it received, sends the results back (a second all-to-all, the first's
splits reversed), weights and sums them into its slice, and one all-reduce of the slices (zeros
elsewhere) makes the output whole again. Before the all-to-all the ranks exchange how many pairs each
routed to each expert (an all-reduce of an [N, E] table): that gives every rank its send and receive
split sizes and, since a sender orders its pairs by expert, the expert of every row it will receive,
so only hidden rows cross.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmserve.config.parallel import check_expert_split, expert_unit_range, split_range
from llmserve.distributed.group import TensorParallelGroup


@dataclass(frozen=True)
class ExpertLayout:
    """Which experts, and which units of each, one rank of an expert layer holds."""

    num_experts: int
    world_size: int
    rank: int
    experts: range  # the experts this rank holds (all of them under tensor parallelism)
    units: range  # each held expert's intermediate units (all of them under expert parallelism)
    expert_parallel: bool

    @classmethod
    def of(
        cls, num_experts: int, units: int, world_size: int = 1, rank: int = 0, expert_parallel: bool = False
    ) -> ExpertLayout:
        check_expert_split(num_experts, units, world_size, expert_parallel)
        return cls(
            num_experts=num_experts,
            world_size=world_size,
            rank=rank,
            experts=split_range(num_experts, world_size, rank) if expert_parallel else range(num_experts),
            units=range(units) if expert_parallel else expert_unit_range(units, world_size, rank),
            expert_parallel=expert_parallel,
        )

    def experts_of(self, rank: int) -> range:
        """The experts `rank` holds under expert parallelism."""
        return split_range(self.num_experts, self.world_size, rank)

    def rank_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a stacked checkpoint tensor: gate_up_proj [E, 2I, H] ([gate; up] rows),
        down_proj [E, H, I]."""
        tensor = tensor[self.experts.start : self.experts.stop]
        units = slice(self.units.start, self.units.stop)
        if name.endswith("gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            return torch.cat((gate[:, units], up[:, units]), dim=1)
        return tensor[:, :, units]


@dataclass(frozen=True)
class DispatchPlan:
    """One expert-parallel layer's all-to-all: rows this rank sends to each rank (its pairs sorted by
    expert, so by owner), rows it receives from each, and the held expert (0-based) of each row
    received."""

    send_rows: list[int]
    recv_rows: list[int]
    local_experts: torch.Tensor  # [sum(recv_rows)], int64

    @classmethod
    def of(cls, layout: ExpertLayout, table: torch.Tensor) -> DispatchPlan:
        """`table` [N, E]: pairs each rank routed to each expert (on every rank alike)."""
        starts = [layout.experts_of(r).start for r in range(layout.world_size)] + [layout.num_experts]
        bounds = torch.tensor(starts, device=table.device)
        running = torch.nn.functional.pad(table.cumsum(1), (1, 0))  # [N, E + 1]
        # [N, N]: pairs rank s sends to rank d; the host needs them as split sizes
        between = (running[:, bounds[1:]] - running[:, bounds[:-1]]).tolist()
        send, recv = between[layout.rank], [row[layout.rank] for row in between]
        mine = layout.experts
        held = torch.arange(len(mine), device=table.device).repeat(layout.world_size)
        local = held.repeat_interleave(table[:, mine.start : mine.stop].flatten())
        return cls(send_rows=send, recv_rows=recv, local_experts=local)

    def bytes_crossing(self, rank: int, row_bytes: int) -> int:
        """Bytes this rank sends to the other ranks over the dispatch and the combine."""
        return (
            sum(self.send_rows) - self.send_rows[rank] + sum(self.recv_rows) - self.recv_rows[rank]
        ) * row_bytes


class ExpertLoad:
    """One layer's running totals on one rank: (token, expert) pairs it computed per held expert, and
    the bytes its all-to-alls sent to other ranks; read by the rank's reports (metrics/ranks.py)."""

    def __init__(self, layout: ExpertLayout) -> None:
        self.first_expert = layout.experts.start
        self.tokens: torch.Tensor | None = None  # [held experts], int64, on the layer's device
        self.all_to_all_bytes = 0

    def add(self, counts: torch.Tensor) -> None:
        """`counts` [held experts]: pairs computed this step (added on the device: no host sync)."""
        self.tokens = counts.clone() if self.tokens is None else self.tokens.add_(counts)


def held_pairs(experts: torch.Tensor, held: range, router_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the pairs (token * k + j) that `experts` [tokens, k] routes to the `held` run of
    the router's experts, sorted by expert (stable), and each held expert's pair count. Where another
    rank holds some experts (expert parallelism) their pairs are left out: two host syncs for the cut."""
    flat = experts.flatten()
    order = flat.argsort(stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=router_experts)  # longer only past the router's experts
    if counts.shape[0] != router_experts:
        raise ValueError(f"an expert index out of range: the router has {router_experts} experts")
    if len(held) == router_experts:
        return order, counts
    first = int(counts[: held.start].sum())  # the pairs of experts before the held run
    counts = counts[held.start : held.stop]
    return order[first : first + int(counts.sum())], counts


def exchange_counts(tp: TensorParallelGroup, counts: torch.Tensor) -> torch.Tensor:
    """Every rank's per-expert pair counts [E] as one [N, E] int64 table on every rank; float32 in
    the all-reduce (exact far beyond a step's pairs) so it takes the shared-memory path."""
    table = torch.zeros(tp.world_size, counts.shape[0], dtype=torch.float32, device=counts.device)
    table[tp.rank] = counts
    return tp.all_reduce(table).round().long()


def total_expert_load(model: nn.Module) -> tuple[int, tuple[int, ...], int]:
    """(first held expert, pairs per held expert, all-to-all bytes) summed over the model's expert
    layers on this rank; (0, (), 0) for a model with none or before its first step."""
    loads = [getattr(m, "expert_load", None) for m in model.modules()]
    loads = [load for load in loads if isinstance(load, ExpertLoad)]
    counted = [load.tokens for load in loads if load.tokens is not None]
    if not counted:
        return 0, (), 0
    tokens = torch.stack([t.cpu() for t in counted]).sum(0)
    return loads[0].first_expert, tuple(tokens.tolist()), sum(load.all_to_all_bytes for load in loads)
