"""What automatic prefix caching buys: TTFT with a cached long prefix, and shared-prefix throughput.

TTFT: a request of a P-token prefix plus a short question, alone on the engine (batch 1), timed
from arrival to its first token: once with a prefix never seen (cold) and once right after another
request with the same prefix (warm: the prefix's full blocks come from the cache). Fresh prefixes
for every repeat keep the cold runs cold.

Throughput: one shared-prefix workload (K system prompts x many questions) through two engines
that differ only in `prefix_caching`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from llmserve.benchmarks.workload import BenchRequest, TokenCorpus, greedy_params


@dataclass
class TTFTResult:
    prefix_len: int
    cold_ms: list[float]
    warm_ms: list[float]

    @property
    def speedup(self) -> float:
        return statistics.median(self.cold_ms) / statistics.median(self.warm_ms)

    def to_json(self) -> dict:
        return {
            "prefix_len": self.prefix_len,
            "cold_ttft_ms_median": statistics.median(self.cold_ms),
            "warm_ttft_ms_median": statistics.median(self.warm_ms),
            "speedup": self.speedup,
            "cold_ttft_ms": self.cold_ms,
            "warm_ttft_ms": self.warm_ms,
        }


def measure_ttft(llm, corpus: TokenCorpus, prefix_len: int, repeats: int, seed: int = 0) -> TTFTResult:
    import numpy as np

    rng = np.random.default_rng(seed)
    question_a, question_b = (llm.tokenizer.encode(q) for q in (" What is this about?", " Summarize it."))
    _ttft_ms(llm, corpus.window_ids(rng, prefix_len))  # warm-up: first-call costs are not the cache's
    cold, warm = [], []
    for _ in range(repeats):
        prefix = corpus.window_ids(rng, prefix_len)
        cold.append(_ttft_ms(llm, prefix + question_a))  # first sight of this prefix
        warm.append(_ttft_ms(llm, prefix + question_b))  # same prefix, now cached
    return TTFTResult(prefix_len, cold, warm)


def _ttft_ms(llm, prompt_ids: list[int]) -> float:
    (output,) = llm.generate([prompt_ids], greedy_params(1), use_tqdm=False)
    return 1e3 * output.metrics.time_to_first_token


@dataclass
class CachedThroughput:
    prefix_caching: bool
    seconds: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int

    def to_json(self) -> dict:
        return {
            "prefix_caching": self.prefix_caching,
            "seconds": self.seconds,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / self.seconds,
            "output_tokens_per_s": self.output_tokens / self.seconds,
            "cached_prompt_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
        }


def measure_throughput(llm, requests: list[BenchRequest]) -> CachedThroughput:
    llm.generate([requests[0].prompt_token_ids[:8]], greedy_params(2), use_tqdm=False)  # warm-up
    llm.engine.kv_cache_manager.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(
        [r.prompt_token_ids for r in requests], [greedy_params(r.max_tokens) for r in requests], use_tqdm=True
    )
    seconds = time.perf_counter() - start
    return CachedThroughput(
        prefix_caching=llm.engine.config.cache.enable_prefix_caching,
        seconds=seconds,
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        cached_tokens=sum(o.num_cached_tokens for o in outputs),
    )
