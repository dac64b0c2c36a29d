"""A mixture-of-experts layer over a tensor-parallel group: every expert's units split (tensor
parallelism) or the experts split (expert parallelism); distributed/expert_parallel.py describes both.
With one rank it is the plain `SparseMoE`.
"""

from __future__ import annotations

import torch

from llmserve.config.parallel import split_range
from llmserve.distributed.expert_parallel import DispatchPlan, ExpertLayout, ExpertLoad, exchange_counts
from llmserve.distributed.group import TensorParallelGroup
from llmserve.models.layers.moe import MoEExperts, SparseMoE


class ParallelSparseMoE(SparseMoE):
    """This rank's part of a `SparseMoE`: the whole router, and the experts `layout` gives it."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        tp: TensorParallelGroup,
        renormalize: bool = True,
    ) -> None:
        layout = ExpertLayout.of(num_experts, intermediate_size, tp.world_size, tp.rank, tp.expert_parallel)
        super().__init__(hidden_size, len(layout.units), num_experts, top_k, renormalize)
        if len(layout.experts) != num_experts:
            self.experts = MoEExperts(
                len(layout.experts), hidden_size, len(layout.units), layout.experts.start, num_experts
            )
        self.layout, self.tp = layout, tp
        self.expert_load = ExpertLoad(layout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(hidden)
        if self.layout.expert_parallel and self.tp.all2all_backend == "all_to_all":
            return self._all_to_all(hidden)
        # every rank routes every token (the hidden states are whole on each) and computes its part of
        # each chosen expert: its units (tensor parallelism) or the experts it holds (expert parallelism)
        weights, experts = self.route(hidden)
        held = self.layout.experts
        counts = torch.bincount(experts.flatten(), minlength=self.layout.num_experts)
        self.expert_load.add(counts[held.start : held.stop])
        if self.layout.expert_parallel:  # the partial sums cross once, in the all-reduce
            self._count_all_reduce(hidden)
        return self.tp.all_reduce(self.experts(hidden, weights, experts))

    def _count_all_reduce(self, hidden: torch.Tensor) -> None:
        """Expert parallelism's combine: this rank's [T, H] partial output, to every other rank (as
        the shared-memory all-reduce reads it)."""
        self.expert_load.all_to_all_bytes += hidden.numel() * hidden.element_size() * (self.tp.world_size - 1)

    def _all_to_all(self, hidden: torch.Tensor) -> torch.Tensor:
        """`--all2all-backend all_to_all`: route this rank's slice of the tokens, compute each pair on
        its expert's rank, and make the output whole with one all-reduce of the slices."""
        mine = split_range(hidden.shape[0], self.tp.world_size, self.tp.rank)
        weights, experts = self._route_slice(hidden[mine.start : mine.stop])
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # pairs by expert: by the rank that holds it
        tokens = order // self.top_k
        table = exchange_counts(self.tp, torch.bincount(flat, minlength=self.layout.num_experts))
        plan = DispatchPlan.of(self.layout, table)
        received = self.tp.all_to_all(hidden[mine.start : mine.stop][tokens], plan.recv_rows, plan.send_rows)
        computed = self._held(received, plan.local_experts)
        returned = self.tp.all_to_all(computed, plan.send_rows, plan.recv_rows)
        returned = returned * weights.flatten()[order].unsqueeze(1).to(returned.dtype)
        out = torch.zeros_like(hidden)
        out[mine.start : mine.stop].index_add_(0, tokens, returned)
        held = self.layout.experts
        self.expert_load.add(table[:, held.start : held.stop].sum(0))
        self.expert_load.all_to_all_bytes += plan.bytes_crossing(
            self.tp.rank, hidden.shape[1] * hidden.element_size()
        )
        self._count_all_reduce(hidden)
        return self.tp.all_reduce(out)

    def _route_slice(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`route`, and no routes for an empty slice (fewer tokens than ranks), where the router's
        small-batch kernel takes no empty input."""
        if rows.shape[0]:
            return self.route(rows)
        empty = torch.empty(0, self.top_k, device=rows.device)
        return empty, empty.long()

    def _held(self, rows: torch.Tensor, local_experts: torch.Tensor) -> torch.Tensor:
        """Each received row through its held expert, in the order received (weight 1: the sender
        weights the results)."""
        if rows.shape[0] == 0:  # no token chose this rank's experts
            return rows
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return self.experts(rows, ones, (local_experts + self.layout.experts.start).unsqueeze(1))


class ExpertShardLoading:
    """Mixin for a MoE model's `LlamaForCausalLM`: stacked expert tensors load as the layer's
    layout cuts them (the other tensors as Llama's)."""

    def _rank_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ".mlp.experts." in name and self.tp.world_size > 1:
            layer = self.get_submodule(name.rsplit(".", 2)[0])  # model.layers.N.mlp
            return layer.layout.rank_part(name, tensor)
        return super()._rank_part(name, tensor)
