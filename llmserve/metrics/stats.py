"""Numbers the engine reports after each step, for logs and Prometheus."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.metrics.ranks import RankStats
from llmserve.outputs import SpecDecodeStats


@dataclass(frozen=True)
class TierStepStats:
    """One KV tier's share of a step (core/kv_tiers.py): what moved and how long loads took."""

    tier: str  # "ram" or "disk"
    hits: int = 0  # KV blocks a prefix hit loaded from this tier instead of recomputing
    bytes_loaded: int = 0  # K/V bytes copied from it into the device pool
    bytes_stored: int = 0  # K/V bytes copied to it
    load_seconds: tuple[float, ...] = ()  # ram: each step's copies; disk: each file's read


@dataclass(frozen=True)
class StepStats:
    num_running: int  # requests running after the step
    num_waiting: int  # requests waiting (new or preempted) after the step
    kv_cache_usage: float  # fraction of KV blocks in use
    num_batched_seqs: int  # requests that ran in the step
    num_prompt_tokens: int  # prompt tokens computed in the step (a recompute counts its prompt again)
    num_generation_tokens: int  # tokens sampled in the step
    num_preemptions: int  # requests preempted in the step
    step_seconds: float
    num_draft_tokens: int = 0  # speculative decoding: drafts verified in the step
    num_accepted_tokens: int = 0  # of which accepted
    num_drafts: int = 0  # requests that verified at least one draft in the step
    num_prefix_cache_queries: int = 0  # prompt tokens of requests admitted in the step, looked up
    num_prefix_cache_hits: int = 0  # of which found in the prefix cache
    num_preemptions_swap: int = (
        0  # of num_preemptions, those whose KV was swapped to CPU (the rest recompute)
    )
    num_swapped_out_blocks: int = 0  # KV blocks copied to the CPU swap space in the step
    num_swapped_in_blocks: int = 0  # KV blocks copied back from it
    accepted_per_position: tuple[int, ...] = ()  # speculative decoding: drafts accepted at position 0, 1, ...
    step_shape: tuple[int, ...] = ()  # the step's core/step_cost.py StepShape, for the cost model
    # the engine's step-time model after the step (core/step_cost.py StepCost), read by the server's
    # admission and watchdog; None until fitted
    step_cost: tuple[float, ...] | None = None
    kv_tiers: tuple[TierStepStats, ...] = ()  # --kv-offloading-size: each tier's step (none without)


@dataclass(frozen=True)
class EngineGauges:
    """The engine's state after its latest step or abort, as the server process sees it."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_swapped: int = 0  # preempted requests whose KV waits in the CPU swap space
    swap_space_usage: float = 0.0  # fraction of the swap space's blocks in use (0 without one)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # totals since start-up
    ranks: tuple[RankStats, ...] = ()  # tensor parallelism: each rank's own report, rank 0 first
    failure: str | None = None  # why the engine can no longer step (a tensor-parallel rank died)
    invariant_violations: int = 0  # --check-invariants: failed integrity checks since start-up
    # --enable-lora: (adapter name, requests running under it, requests waiting) per loaded adapter
    lora_requests: tuple[tuple[str, int, int], ...] = ()
    max_loras: int = 0  # --enable-lora: adapters resident at once (0: LoRA off)
