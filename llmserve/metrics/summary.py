"""The JSON view of the metrics (`GET /v1/metrics`, the dashboard, the router's per-replica rows),
computed from the same Prometheus families `/metrics` exports, so the two can never disagree.

`Scrape` flattens families (a server's registry, or a replica's parsed /metrics) into totals per
sample name, summed over label sets other than `le`; `summary` turns one into the JSON summary;
`window` compares two scrapes taken `seconds` apart (rates and percentiles over that window, from the
histograms' bucket counts as Prometheus's `histogram_quantile` does).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from prometheus_client.core import Metric

PREFIX = "llmserve:"
VLLM_PREFIX = "vllm:"  # the same series under vLLM's names (metrics/export.py)
PERCENTILES = (50, 90, 99)


class Scrape:
    """Sample totals of the `llmserve:` families (the `vllm:` ones are the same series again)."""

    def __init__(self, families: Iterable[Metric] = ()) -> None:
        self.values: dict[str, float] = defaultdict(float)  # sample name without prefix -> sum over labels
        self.by_label: dict[tuple[str, str, str], float] = defaultdict(float)  # (sample, label, value) -> sum
        self.buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))  # cumulative
        self.add(families)

    def add(self, families: Iterable[Metric]) -> Scrape:
        """One server's families: its `llmserve:` ones, or its `vllm:` ones if it exports only those."""
        families = list(families)
        prefix = PREFIX if any(f.name.startswith(PREFIX) for f in families) else VLLM_PREFIX
        for family in families:
            if family.name.startswith(prefix):
                for sample in family.samples:
                    self._add_sample(sample.name.removeprefix(prefix), sample.labels, sample.value)
        return self

    def _add_sample(self, name: str, labels: dict[str, str], value: float) -> None:
        if name.endswith("_bucket"):
            self.buckets[name.removesuffix("_bucket")][float(labels["le"])] += value
            return
        self.values[name] += value
        for label, label_value in labels.items():
            if label not in ("model_name", "replica"):
                self.by_label[name, label, label_value] += value

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def mean(self, histogram: str) -> float:
        count = self.get(histogram + "_count")
        return self.get(histogram + "_sum") / count if count else 0.0

    def labelled(self, name: str, label: str) -> dict[str, float]:
        return {v: total for (n, lab, v), total in self.by_label.items() if n == name and lab == label}


def summary(scrape: Scrape) -> dict:
    """Totals since start-up and the engine's state now; averages over finished requests.

    `avg_tokens_per_second` is generated tokens over end-to-end seconds of the finished requests (a
    request's decode speed, weighted by its duration); `avg_batch_size` is requests per engine step."""
    e2e_seconds = scrape.get("e2e_request_latency_seconds_sum")
    queries = scrape.get("prefix_cache_queries_total")
    drafts = scrape.get("spec_decode_num_draft_tokens_total")
    prompt, generation = scrape.get("prompt_tokens_total"), scrape.get("generation_tokens_total")
    return {
        "total_requests": int(scrape.get("e2e_request_latency_seconds_count")),
        "total_tokens": int(prompt + generation),
        "total_prompt_tokens": int(prompt),
        "total_generation_tokens": int(generation),
        "avg_latency_ms": 1000 * scrape.mean("e2e_request_latency_seconds"),
        "avg_tokens_per_second": (
            scrape.get("request_generation_tokens_sum") / e2e_seconds if e2e_seconds else 0.0
        ),
        "avg_batch_size": scrape.mean("iteration_batch_size"),
        "avg_ttft_ms": 1000 * scrape.mean("time_to_first_token_seconds"),
        "avg_tpot_ms": 1000 * scrape.mean("request_time_per_output_token_seconds"),
        "num_requests_running": int(scrape.get("num_requests_running")),
        "num_requests_waiting": int(scrape.get("num_requests_waiting")),
        "num_requests_swapped": int(scrape.get("num_requests_swapped")),
        "kv_cache_usage_perc": scrape.get("kv_cache_usage_perc"),
        "prefix_cache_hit_rate": scrape.get("prefix_cache_hits_total") / queries if queries else 0.0,
        "spec_decode_acceptance_rate": (
            scrape.get("spec_decode_num_accepted_tokens_total") / drafts if drafts else 0.0
        ),
        "num_preemptions": int(scrape.get("num_preemptions_total")),
        "finished_by_reason": scrape.labelled("request_success_total", "finished_reason"),
    }


def window(before: Scrape, after: Scrape, seconds: float) -> dict:
    """What happened between two scrapes: token rates, latency percentiles, hit and acceptance rates."""
    delta = lambda name: after.get(name) - before.get(name)  # noqa: E731 - local shorthand
    per_second = lambda name: delta(name) / seconds if seconds > 0 else 0.0  # noqa: E731
    queries, drafts = delta("prefix_cache_queries_total"), delta("spec_decode_num_draft_tokens_total")
    point = {
        "num_requests_running": after.get("num_requests_running"),
        "num_requests_waiting": after.get("num_requests_waiting"),
        "kv_cache_usage_perc": after.get("kv_cache_usage_perc"),
        "prompt_tokens_per_second": per_second("prompt_tokens_total"),
        "generation_tokens_per_second": per_second("generation_tokens_total"),
        "prefix_cache_hit_rate": delta("prefix_cache_hits_total") / queries if queries else None,
        "spec_decode_acceptance_rate": (
            delta("spec_decode_num_accepted_tokens_total") / drafts if drafts else None
        ),
        "preemptions_per_second": per_second("num_preemptions_total"),
    }
    for key, histogram in (
        ("ttft", "time_to_first_token_seconds"),
        ("tpot", "request_time_per_output_token_seconds"),
    ):
        changed = bucket_delta(before.buckets.get(histogram, {}), after.buckets.get(histogram, {}))
        for p in PERCENTILES:
            value = quantile(p / 100, changed)
            point[f"{key}_p{p}_ms"] = None if value is None else 1000 * value
    return point


def bucket_delta(before: dict[float, float], after: dict[float, float]) -> list[tuple[float, float]]:
    """The cumulative counts observed between two scrapes, by upper bound."""
    return sorted((le, count - before.get(le, 0.0)) for le, count in after.items())


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative `buckets` (sorted by bound, +Inf last), interpolated linearly in
    its bucket as Prometheus's histogram_quantile does; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # past the last finite bucket: its bound is all we know
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
