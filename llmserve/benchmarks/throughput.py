"""Offline throughput: one workload through naive request-level batching and through the engine.

Both systems run in the same process on the same model object, so the ratio isolates the batching
policy (and the paged cache that makes continuous batching possible) from kernels and weights.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from tqdm.auto import tqdm

from llmserve.benchmarks.naive_batching import NaiveBatchRunner, NaiveBatchStats
from llmserve.benchmarks.results import format_table, pyplot, save_figure
from llmserve.benchmarks.workload import BenchRequest, greedy_params
from llmserve.config.kv_cache_dtype import is_low_bit

COLUMNS = (
    "system", "requests", "prompt_tokens", "output_tokens", "computed_tokens", "seconds", "output_tok_s",
    "total_tok_s", "matching_outputs", "matching_share",
)  # fmt: skip


@dataclass(frozen=True)
class ThroughputResult:
    system: str  # "continuous" or "naive(B=8)"
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float  # wall time, engine already loaded and warm
    matching_outputs: int | None = None  # requests whose tokens equal the continuous engine's
    computed_tokens: int | None = None  # naive only: prefill + decode positions actually computed

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def matching_share(self) -> float | None:
        """The share of requests whose greedy tokens are identical to the continuous engine's (1.0 where
        the kernels are batch invariant: --deterministic)."""
        return None if self.matching_outputs is None else self.matching_outputs / self.requests

    def to_json(self) -> dict:
        rates = {"output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}
        return {**asdict(self), **rates, "matching_share": self.matching_share}


def speedup(
    continuous: ThroughputResult, naive: Sequence[ThroughputResult]
) -> tuple[float, ThroughputResult]:
    """Continuous output tok/s over the best naive batch size's, and that best naive result."""
    best = max(naive, key=lambda r: r.output_tok_s)
    return continuous.output_tok_s / best.output_tok_s, best


def run_continuous(llm, requests: Sequence[BenchRequest]) -> tuple[ThroughputResult, list[list[int]]]:
    """The workload through `LLM.generate`: continuous batching over the paged cache."""
    start = time.perf_counter()
    outputs = llm.generate(
        [r.prompt_token_ids for r in requests], [greedy_params(r.max_tokens) for r in requests], use_tqdm=True
    )
    seconds = time.perf_counter() - start
    tokens = [output.outputs[0].token_ids for output in outputs]
    result = ThroughputResult(
        system="continuous",
        requests=len(requests),
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(len(t) for t in tokens),
        seconds=seconds,
    )
    return result, tokens


def run_naive(
    runner: NaiveBatchRunner, requests: Sequence[BenchRequest], batch_size: int
) -> tuple[ThroughputResult, list[list[int]]]:
    prompts, max_tokens = [r.prompt_token_ids for r in requests], [r.max_tokens for r in requests]
    with tqdm(total=len(requests), desc=f"naive B={batch_size}", unit="req") as progress:
        start = time.perf_counter()
        tokens, stats = runner.generate(prompts, max_tokens, batch_size, progress)
        seconds = time.perf_counter() - start
    return naive_result(batch_size, stats, seconds), tokens


def naive_result(batch_size: int, stats: NaiveBatchStats, seconds: float) -> ThroughputResult:
    return ThroughputResult(
        system=f"naive(B={batch_size})",
        requests=stats.num_requests,
        prompt_tokens=stats.prompt_tokens,
        output_tokens=stats.output_tokens,
        seconds=seconds,
        computed_tokens=stats.prefill_tokens + stats.decode_tokens,
    )


def count_matching(reference: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]]) -> int:
    return sum(list(a) == list(b) for a, b in zip(reference, tokens, strict=True))


def check_fits(requests: Sequence[BenchRequest], max_model_len: int) -> None:
    """Both systems must generate every token asked for, or the comparison is off."""
    too_long = [i for i, r in enumerate(requests) if r.prompt_len + r.max_tokens > max_model_len]
    if too_long:
        raise ValueError(
            f"{len(too_long)} requests need more than max_model_len={max_model_len} tokens "
            f"(first: request {too_long[0]}); raise --max-model-len or shorten the workload"
        )


def warm_up(llm, runner: NaiveBatchRunner | None, requests: Sequence[BenchRequest]) -> None:
    """One short pass through each path that will be timed, so none pays first-call costs inside
    its timing.

    The warm-up prompts are reversed snippets, so nothing they leave in the prefix cache starts a
    timed prompt.
    """
    prompts = [r.prompt_token_ids[:8][::-1] for r in requests[:2]]
    llm.generate(prompts, greedy_params(4), use_tqdm=False)
    if runner is not None:
        runner.generate(prompts, [4] * len(prompts), batch_size=len(prompts))


def run_throughput(
    llm, requests: Sequence[BenchRequest], batch_sizes: Sequence[int]
) -> tuple[ThroughputResult, list[ThroughputResult]]:
    """The continuous engine, then naive batching at each batch size, on the same model object."""
    check_fits(requests, llm.engine.config.model.max_model_len)
    if batch_sizes and llm.engine.config.parallel.world_size > 1:
        # the naive runner drives one process's model: a shard's collectives would wait forever
        raise ValueError(
            "naive batching runs in one process: use --naive-batch-sizes none with tensor parallelism"
        )
    if batch_sizes and is_low_bit(llm.engine.config.cache.kv_cache_dtype):
        raise ValueError(  # the naive runner's rows have no full-precision windows (worker/recent_kv.py)
            "naive batching does not write int4/int2 KV caches: use --naive-batch-sizes none with them"
        )
    runner = None
    if batch_sizes:
        runner = NaiveBatchRunner(llm.engine.model_runner.model, llm.engine.config.cache.block_size)
    warm_up(llm, runner, requests)
    continuous, reference = run_continuous(llm, requests)
    naive = []
    for batch_size in batch_sizes:
        result, tokens = run_naive(runner, requests, batch_size)
        naive.append(replace(result, matching_outputs=count_matching(reference, tokens)))
    return continuous, naive


def format_report(continuous: ThroughputResult, naive: Sequence[ThroughputResult]) -> str:
    if not naive:
        return format_table([continuous.to_json()], COLUMNS)
    ratio, best = speedup(continuous, naive)
    return "\n".join([
        format_table([r.to_json() for r in (*naive, continuous)], COLUMNS),
        "computed_tokens: positions the naive batches ran, padding and finished rows included; "
        "matching_outputs (matching_share): requests (their share) whose greedy tokens equal the continuous "
        "engine's; all of them where the kernels are batch invariant (--deterministic)",
        f"continuous / best naive ({best.system}) output throughput: {ratio:.2f}x",
    ])  # fmt: skip


def plot_throughput(continuous: ThroughputResult, naive: Sequence[ThroughputResult], path) -> None:
    plt = pyplot()
    results = [*naive, continuous]
    figure, axis = plt.subplots(figsize=(7, 4))
    colors = ["tab:gray"] * len(naive) + ["tab:blue"]
    bars = axis.bar([r.system for r in results], [r.output_tok_s for r in results], color=colors)
    axis.bar_label(bars, fmt="%.0f")
    axis.set_ylabel("output tokens / s")
    axis.set_title(f"{continuous.requests} requests, {continuous.output_tokens:,} output tokens")
    save_figure(figure, path)
