"""Each engine step's `StepStats` (metrics/stats.py), assembled from the step's schedule and the
scheduler's and KV cache manager's counts.

Prefix-cache lookups and swap preemptions are running totals where they are counted; a step's stats
carry what they grew by since the previous step's, so that the lookups of a step that raised are
reported with the next one, and a warm-up's are never reported (`restart`).
"""

from __future__ import annotations

from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler, SchedulerOutput
from llmserve.metrics.stats import StepStats, TierStepStats
from llmserve.worker.kv_tier_store import KVTierStore


class StepStatsRecorder:
    def __init__(
        self, scheduler: Scheduler, kv_cache_manager: KVCacheManager, kv_tier_store: KVTierStore | None = None
    ) -> None:
        """`kv_tier_store`: the model runner's side of the KV tiers (its RAM load times), if any."""
        self._scheduler = scheduler
        self._kv = kv_cache_manager
        self._tier_store = kv_tier_store
        self._tiers_reported: dict[str, tuple[int, int, int]] = {}  # tier -> counters in StepStats so far
        self._prefix_cache_reported = (0, 0)  # the cache manager's (queries, hits) in StepStats so far
        self._swap_preemptions_reported = 0  # the scheduler's swap preemptions in StepStats so far

    def record(
        self, scheduled: SchedulerOutput, accepted: list[int], num_sampled: int, seconds: float
    ) -> StepStats:
        """The stats of a step: `accepted` drafts per verifying request, `num_sampled` new tokens."""
        scheduler = self._scheduler
        prefix_cache_queries, prefix_cache_hits = self._prefix_cache_delta()
        swaps = scheduler.preemptions_by_mode["swap"]
        num_swaps, self._swap_preemptions_reported = swaps - self._swap_preemptions_reported, swaps
        return StepStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=self._kv.usage,
            num_batched_seqs=len(scheduled.requests),
            num_prompt_tokens=scheduled.num_prompt_tokens,
            num_generation_tokens=num_sampled,
            num_preemptions=len(scheduled.preempted),
            step_seconds=seconds,
            num_draft_tokens=sum(map(len, scheduled.plan.spec_token_ids.values())),
            num_accepted_tokens=sum(accepted),
            num_drafts=len(accepted),
            num_prefix_cache_queries=prefix_cache_queries,
            num_prefix_cache_hits=prefix_cache_hits,
            num_preemptions_swap=num_swaps,
            num_swapped_out_blocks=len(scheduled.plan.swap_out),
            num_swapped_in_blocks=len(scheduled.plan.swap_in),
            accepted_per_position=accepted_per_position(accepted),
            step_shape=tuple(scheduled.shape),
            step_cost=scheduler.cost_model.coefficients,
            kv_tiers=self._tier_stats(),
        )

    def restart(self) -> None:
        """Count the next step's deltas from the totals as they are now (after the warm-up)."""
        kv = self._kv
        self._prefix_cache_reported = (kv.prefix_cache_queries, kv.prefix_cache_hits)
        self._swap_preemptions_reported = self._scheduler.preemptions_by_mode["swap"]
        self._tier_stats()  # the warm-up's tier traffic is never reported

    def _tier_stats(self) -> tuple[TierStepStats, ...]:
        """Each KV tier's hits, bytes and load times since the last StepStats (none without tiers)."""
        tiers = self._kv.pool.tiers
        if tiers is None:
            return ()
        ram_seconds = self._tier_store.take_ram_load_seconds() if self._tier_store is not None else ()
        stats = []
        for name, counters in tiers.counters.items():
            totals = (counters.hits, counters.bytes_loaded, counters.bytes_stored)
            hits, loaded, stored = self._tiers_reported.get(name, (0, 0, 0))
            self._tiers_reported[name] = totals
            seconds = ram_seconds if name == "ram" else counters.take_load_seconds()
            delta = (totals[0] - hits, totals[1] - loaded, totals[2] - stored)
            stats.append(TierStepStats(name, *delta, load_seconds=seconds))
        return tuple(stats)

    def _prefix_cache_delta(self) -> tuple[int, int]:
        """Prefix-cache (queries, hits) in tokens since the last StepStats."""
        kv = self._kv
        totals = (kv.prefix_cache_queries, kv.prefix_cache_hits)
        (queries, hits), self._prefix_cache_reported = self._prefix_cache_reported, totals
        return totals[0] - queries, totals[1] - hits


def accepted_per_position(accepted: list[int]) -> tuple[int, ...]:
    """How many requests had their draft at position 0, 1, ... accepted (drafts are accepted as a
    leading run, so a request that accepted a drafts counts at positions 0..a-1)."""
    if not accepted:
        return ()
    return tuple(sum(1 for a in accepted if a > position) for position in range(max(accepted)))
