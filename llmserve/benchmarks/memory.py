"""How many sequences fit in one KV budget: the paged cache against contiguous per-sequence buffers.

A contiguous allocator must reserve a sequence's largest possible length up front (it cannot grow a
buffer in place), so short sequences strand most of their reservation. The paged cache hands out
fixed-size blocks as tokens arrive, so a sequence wastes less than one block. This is arithmetic on
the workload's lengths, not a timing: requests are admitted in arrival order until the next one does
not fit, counting each sequence at its largest (prompt + all its output tokens).

`measure_live` runs the engine under the same budget and samples the real cache after every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from itertools import accumulate

from llmserve.benchmarks.results import pyplot, save_figure
from llmserve.benchmarks.workload import BenchRequest, greedy_params
from llmserve.config import EngineArgs
from llmserve.core.kv_cache_manager import cdiv


@dataclass(frozen=True)
class Allocation:
    """One strategy's admission under the budget."""

    strategy: str
    concurrent_sequences: int  # admitted in order before the next one did not fit
    allocated_slots: int  # token slots reserved by the admitted sequences
    used_slots: int  # tokens those sequences actually hold at their end

    @property
    def waste(self) -> float:
        """Allocated-but-unused slots over allocated slots."""
        return 1.0 - self.used_slots / self.allocated_slots if self.allocated_slots else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "waste": self.waste}


def admit_in_order(reservations: Sequence[int], capacity: int) -> int:
    """How many leading requests fit when each takes its reservation from `capacity`."""
    return sum(1 for total in accumulate(reservations) if total <= capacity)


def paged_allocation(lengths: Sequence[int], num_blocks: int, block_size: int) -> Allocation:
    """Each sequence holds ceil(length / block_size) blocks at its end."""
    blocks = [cdiv(length, block_size) for length in lengths]
    count = admit_in_order(blocks, num_blocks)
    return Allocation("paged", count, sum(blocks[:count]) * block_size, sum(lengths[:count]))


def contiguous_allocation(strategy: str, lengths: Sequence[int], num_slots: int, reserve: int) -> Allocation:
    """Each sequence reserves `reserve` slots, however long it turns out to be."""
    count = admit_in_order([reserve] * len(lengths), num_slots) if reserve > 0 else 0
    return Allocation(strategy, count, count * reserve, sum(lengths[:count]))


def simulate(
    requests: Sequence[BenchRequest], num_slots: int, block_size: int, max_model_len: int
) -> list[Allocation]:
    """Paged, contiguous at max_model_len, and contiguous at the workload's own max, in one budget.

    The paged pool holds whole blocks only: num_slots // block_size of them.
    """
    lengths = [r.prompt_len + r.max_tokens for r in requests]
    workload_max = max(r.prompt_len for r in requests) + max(r.max_tokens for r in requests)
    return [
        paged_allocation(lengths, num_slots // block_size, block_size),
        contiguous_allocation("contiguous(max_model_len)", lengths, num_slots, max_model_len),
        contiguous_allocation("contiguous(prompt_max+max_tokens_max)", lengths, num_slots, workload_max),
    ]


@dataclass(frozen=True)
class LiveSample:
    num_running: int
    allocated_slots: int
    used_slots: int


@dataclass(frozen=True)
class LiveMeasurement:
    """The engine's cache sampled after every step of the workload."""

    num_steps: int
    max_running: int
    mean_running: float
    mean_waste: float  # over steps with any block allocated
    num_preemptions: int

    @classmethod
    def from_samples(cls, samples: Sequence[LiveSample], num_preemptions: int) -> LiveMeasurement:
        wastes = [1.0 - s.used_slots / s.allocated_slots for s in samples if s.allocated_slots]
        return cls(
            num_steps=len(samples),
            max_running=max((s.num_running for s in samples), default=0),
            mean_running=sum(s.num_running for s in samples) / len(samples) if samples else 0.0,
            mean_waste=sum(wastes) / len(wastes) if wastes else 0.0,
            num_preemptions=num_preemptions,
        )


def live_engine_args(engine_args: EngineArgs, num_requests: int) -> EngineArgs:
    """Only the KV budget may limit concurrency, and shared prefixes must not hide allocation."""
    return replace(
        engine_args,
        max_num_seqs=max(engine_args.max_num_seqs or 0, num_requests),
        prefix_caching=False,
    )


def sample_cache(engine) -> LiveSample:
    """Running requests, the slots their block tables hold, and the tokens whose KV those hold."""
    manager, running = engine.kv_cache_manager, engine.scheduler.running
    blocks = sum(len(manager.get_block_table(r.request_id)) for r in running)
    return LiveSample(len(running), blocks * manager.block_size, sum(r.num_computed_tokens for r in running))


def measure_live(engine, requests: Sequence[BenchRequest], progress=None) -> LiveMeasurement:
    """Run the workload to completion on `engine`, sampling the cache after each step."""
    for index, request in enumerate(requests):
        engine.add_request(f"memory-{index}", request.prompt_token_ids, greedy_params(request.max_tokens))
    samples = []
    while engine.has_unfinished_requests():
        finished = sum(output.finished for output in engine.step())
        samples.append(sample_cache(engine))
        if progress is not None and finished:
            progress.update(finished)
    return LiveMeasurement.from_samples(samples, engine.scheduler.num_preemptions)


def plot_allocations(allocations: Sequence[Allocation], budget_label: str, path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [a.strategy.replace("(", "\n").replace("+", "+\n").rstrip(")") for a in allocations]
    left.bar(names, [a.concurrent_sequences for a in allocations], color="tab:blue")
    left.set_ylabel("concurrent sequences")
    left.set_title(f"sequences that fit in {budget_label}")
    right.bar(names, [100 * a.waste for a in allocations], color="tab:red")
    right.set_ylabel("allocated but unused (%)")
    right.set_title("KV waste")
    for axis in (left, right):
        axis.tick_params(axis="x", labelsize=8)
    save_figure(figure, path)
