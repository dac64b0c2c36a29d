"""A mixture-of-experts layer split over ranks (tensor or expert parallelism) equals the whole layer.

The ranks run as threads of this process over a group whose collectives meet at a barrier (the
same semantics as the gloo group's all_reduce and all_to_all_single, without processes), so routing
that is skewed (one expert takes every token), leaves experts and a whole rank without tokens, or
has fewer tokens than ranks runs the real layer code in the fast tier; tests/distributed/
test_moe_parallel.py runs the models over real process groups.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from llmserve.config.parallel import ParallelConfig
from llmserve.distributed.expert_parallel import DispatchPlan, ExpertLayout, total_expert_load
from llmserve.metrics.prometheus import RankCollector
from llmserve.metrics.ranks import RankStats
from llmserve.models.layers.moe import SparseMoE
from llmserve.models.layers.moe_parallel import ParallelSparseMoE

HIDDEN, UNITS, EXPERTS, TOP_K = 16, 20, 8, 2  # units: runs of 8, 8, 4 over 3 ranks


class ThreadGroup:
    """One thread's rank of an in-process group: every collective waits for all ranks."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        barrier: threading.Barrier,
        slots: list,
        expert_parallel: bool,
        all2all_backend: str,
    ):
        self.rank, self.world_size, self.expert_parallel = rank, world_size, expert_parallel
        self.all2all_backend = all2all_backend
        self.barrier, self.slots = barrier, slots
        self.all_to_alls = 0

    def _exchange(self, value):
        self.slots[self.rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # every rank has read before any writes again
        return values

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.copy_(torch.stack(self._exchange(tensor.clone())).sum(0))

    def all_to_all(self, tensor: torch.Tensor, out_rows: list[int], in_rows: list[int]) -> torch.Tensor:
        self.all_to_alls += 1
        parts = self._exchange(tensor.split(in_rows))
        received = torch.cat([parts[source][self.rank] for source in range(self.world_size)])
        assert received.shape[0] == sum(out_rows)
        return received


def _whole_layer(router_column: list[float] | None) -> SparseMoE:
    torch.manual_seed(0)
    layer = SparseMoE(HIDDEN, UNITS, EXPERTS, TOP_K)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.3)
        if router_column is not None:  # the router reads only feature 0: these logits per unit of it
            layer.gate.weight.zero_()
            layer.gate.weight[:, 0] = torch.tensor(router_column)
    return layer


def _run_ranks(
    whole: SparseMoE,
    hidden: torch.Tensor,
    world_size: int,
    expert_parallel: bool,
    all2all_backend: str = "naive",
):
    """Each rank's (layer, output), the layer loaded with its part of `whole`'s weights."""
    barrier, slots = threading.Barrier(world_size), [None] * world_size
    results: list = [None] * world_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            group = ThreadGroup(rank, world_size, barrier, slots, expert_parallel, all2all_backend)
            layer = ParallelSparseMoE(HIDDEN, UNITS, EXPERTS, TOP_K, group)
            with torch.no_grad():
                layer.gate.weight.copy_(whole.gate.weight)
                for name in ("gate_up_proj", "down_proj"):
                    part = layer.layout.rank_part(name, getattr(whole.experts, name))
                    getattr(layer.experts, name).copy_(part)
                results[rank] = (layer, layer(hidden.clone()))
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


# router logits per unit of feature 0 (which every token has at 3): None draws a random router
SKEWED = [5.0, 1.0, 0.5, 0.2, -5.0, -5.0, -5.0, -5.0]  # experts 0 and 1 take every token; 4-7 none


@pytest.mark.parametrize(
    "expert_parallel, all2all_backend",
    [(False, "naive"), (True, "naive"), (True, "all_to_all")],
    ids=["tp", "ep-naive", "ep-all-to-all"],
)
@pytest.mark.parametrize(
    "world_size, tokens, router",
    [(2, 9, None), (3, 7, None), (2, 1, None), (2, 6, SKEWED), (3, 2, SKEWED)],
    ids=["2-ranks", "3-ranks-uneven", "fewer-tokens-than-ranks", "skewed-idle-rank", "skewed-3-ranks"],
)
def test_split_layer_equals_the_whole_layer(expert_parallel, all2all_backend, world_size, tokens, router):
    whole = _whole_layer(router)
    torch.manual_seed(1)
    hidden = torch.randn(tokens, HIDDEN)
    if router is not None:
        hidden[:, 0] = 3.0
    with torch.no_grad():
        want = whole(hidden)
        chosen = whole.route(hidden)[1]
    results = _run_ranks(whole, hidden, world_size, expert_parallel, all2all_backend)
    for _, got in results:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    routed = torch.bincount(chosen.flatten(), minlength=EXPERTS)
    loads = [total_expert_load(layer) for layer, _ in results]
    # naive: nothing but the layer's one all-reduce crosses; all_to_all: two all-to-alls a layer
    assert all(layer.tp.all_to_alls == (2 if all2all_backend == "all_to_all" else 0) for layer, _ in results)
    if expert_parallel:  # each rank computed exactly its experts' pairs, from every rank's slice
        held = torch.cat([torch.tensor(counts) for _, counts, _ in loads])
        assert held.tolist() == routed.tolist()
        assert [first for first, _, _ in loads] == [layer.layout.experts.start for layer, _ in results]
        if all2all_backend == "naive":  # the partial outputs, to each other rank, in the all-reduce
            row_bytes = tokens * HIDDEN * 4
            assert all(sent == row_bytes * (world_size - 1) for _, _, sent in loads)
    else:  # every rank routed every token and computed its units of every chosen expert
        assert all(counts == tuple(routed.tolist()) and sent == 0 for _, counts, sent in loads)
    if router is SKEWED:
        assert routed[4:].sum() == 0 and routed[0] == tokens


def test_layouts_cut_the_stacked_tensors():
    gate_up = torch.arange(4 * 2 * 20 * 3.0).reshape(4, 40, 3)  # 4 experts, [gate; up] of 20 units each
    down = torch.arange(4 * 3 * 20.0).reshape(4, 3, 20)
    tp = ExpertLayout.of(4, 20, world_size=2, rank=1)  # runs of 8 units: 16 + 4
    assert tp.experts == range(4) and tp.units == range(16, 20)
    rows = [16, 17, 18, 19, 36, 37, 38, 39]
    torch.testing.assert_close(tp.rank_part("x.gate_up_proj", gate_up), gate_up[:, rows])
    torch.testing.assert_close(tp.rank_part("x.down_proj", down), down[:, :, 16:])
    ep = ExpertLayout.of(4, 20, world_size=3, rank=0, expert_parallel=True)
    assert ep.experts == range(2) and ep.units == range(20)
    torch.testing.assert_close(ep.rank_part("x.gate_up_proj", gate_up), gate_up[:2])
    with pytest.raises(ValueError, match="no expert"):
        ExpertLayout.of(2, 20, world_size=3, rank=0, expert_parallel=True)
    with pytest.raises(ValueError, match="without 8 of each expert's 20 units"):
        ExpertLayout.of(4, 20, world_size=4, rank=0)


def test_dispatch_plan_from_the_count_table():
    layout = ExpertLayout.of(4, 8, world_size=2, rank=1, expert_parallel=True)  # rank 1 holds 2, 3
    table = torch.tensor([[3, 0, 2, 1], [0, 4, 0, 5]])  # pairs each rank routed to each expert
    plan = DispatchPlan.of(layout, table)
    assert plan.send_rows == [4, 5] and plan.recv_rows == [3, 5]
    # rank 0's rows for experts 2, 2, 3, then its own rows for expert 3: held experts 0, 0, 1, 1...
    assert plan.local_experts.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert plan.bytes_crossing(rank=1, row_bytes=10) == (4 + 3) * 10


def test_rank_reports_expose_the_expert_load():
    ranks = [
        RankStats(0, 10, num_steps=4, expert_tokens=(6, 0), first_expert=0, all_to_all_bytes=512),
        RankStats(1, 11, num_steps=4, expert_tokens=(1, 9), first_expert=2, all_to_all_bytes=256),
    ]
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in RankCollector(lambda: ranks).collect()
        for sample in family.samples
    }
    assert samples[("llmserve:rank_expert_tokens_total", (("expert", "1"), ("rank", "0")))] == 0
    assert samples[("llmserve:rank_expert_tokens_total", (("expert", "3"), ("rank", "1")))] == 9
    assert samples[("llmserve:rank_all_to_all_bytes_total", (("rank", "1"),))] == 256
    dense = RankCollector(lambda: [RankStats(0, 10), RankStats(1, 11)]).collect()
    assert not any(family.name.startswith("llmserve:rank_expert") for family in dense)


def test_quantization_groups_see_each_ranks_expert_units():
    """Under tensor parallelism an expert's down_proj input is the rank's run of units, which a
    quantization group must divide; under expert parallelism it stays whole."""
    arch = SimpleNamespace(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_experts=8,
        moe_intermediate_size=40,
    )
    tp = ParallelConfig(tensor_parallel_size=2)
    assert tp.row_parallel_in_features(arch) == (32, 32, 64, 64, 24, 16)  # runs of 8 units: 3 + 2
    ep = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    assert ep.row_parallel_in_features(arch) == (32, 32, 64, 64)
