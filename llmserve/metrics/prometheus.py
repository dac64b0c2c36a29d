"""Prometheus metrics for the server, named `llmserve:*` in vLLM's style, in a private registry.

Fed by an `AsyncLLM` step listener (it runs in the server's reader thread as each step's outputs
arrive) plus gauges read at scrape time from the engine's latest report, which every step and every
abort refresh, so an abort that leaves the engine idle still shows as zero running requests.

Token counters are exact by construction:
- `prompt_tokens_total`: the prompt length of every request that produced at least one token, counted
  once when its first token arrives (prefix-cache hits and preemption recomputes do not change it);
  equal to the sum of `usage.prompt_tokens` the server reported for those requests.
- `generation_tokens_total`: output tokens delivered, all n samples included; equal to the sum of
  `usage.completion_tokens`.
- `prefix_cache_queries_total`, `prefix_cache_hits_total` (vLLM's `prefix_cache_queries`/`_hits`): the
  prompt tokens of each engine request looked up in the prefix cache when it is first scheduled, and
  of those the tokens found cached (its `usage.prompt_tokens_details.cached_tokens`). A parallel
  sample that shares its sibling's prompt blocks does no lookup; a preempted request's recompute
  looks up again but is not counted again (as vLLM, which counts it apart).

Under tensor parallelism each rank's own numbers (metrics/ranks.py) appear with a `rank` label:
`rank_up`, `rank_info{pid}`, `rank_exit_code` (a rank that exited), `rank_steps_total`,
`rank_forward_seconds_total`, `rank_kv_cache_usage_perc`, `rank_kv_cache_blocks`,
`rank_kv_cache_bytes`; an engine without tensor parallelism has none of them.

Operators' distributions, all per engine request and observed when it finishes (vLLM's names):
`request_prompt_tokens`, `request_generation_tokens` (all n samples), `request_max_num_generation_tokens`
(the longest sample), `request_time_per_output_token_seconds` (TPOT: decode time over the longest
sample's tokens after its first), `request_inference_time_seconds`; `request_params_n` and
`request_params_max_tokens` are observed when a request arrives. Preemptions are counted by mode
(`num_preemptions_by_mode{mode=swap|recompute}`, their sum is `num_preemptions`), KV blocks crossing to
and from the CPU swap space (`swapped_out_blocks`, `swapped_in_blocks`), with the gauges
`num_requests_swapped` and `cpu_cache_usage_perc` (the swap space's use); speculative decoding counts
`spec_decode_num_drafts` and `spec_decode_num_accepted_tokens_per_pos{position}` (requests whose draft
at that position was accepted). The KV tiers under the prefix cache (--kv-offloading-size, core/kv_tiers.py)
count per tier (`tier` = ram | disk) `kv_offload_hits` (blocks a prefix hit loaded instead of recomputing),
`kv_offload_bytes{direction=load|store}` and the histogram `kv_offload_load_seconds` (ram: a step's
copies to the device; disk: one file's read and check); their hits' tokens are in
`prefix_cache_hits` too. Under --enable-lora each adapter's requests (`lora_name`) count
`lora_prompt_tokens` and `lora_generation_tokens` as the two token counters do, and observe
`lora_time_to_first_token_seconds` and `lora_e2e_request_latency_seconds`; the gauges
`lora_requests_running` and `lora_requests_waiting` and vLLM's `lora_requests_info` are read at
scrape time.

The registry holds `llmserve:*` without labels of its own; a scrape (`render`) exports every family
under `llmserve:` and vLLM's `vllm:` (or one of them: `metric_names`) with a `model_name` label on
every sample (metrics/export.py). `summary.py` reads the same families for the JSON `/v1/metrics`.

To add a metric, create it with `counter`/`gauge`/`histogram` (which prefix the name and register it
here) and update it from a step listener of your own or from `on_step`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmserve.metrics.export import exposition_registry
from llmserve.metrics.ranks import RankStats
from llmserve.metrics.stats import EngineGauges, StepStats, TierStepStats
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams

PREFIX = "llmserve:"
_PRUNE_EVERY_STEPS = 256

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
REQUEST_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
N_BUCKETS = (1, 2, 5, 10, 20)


@dataclass
class _Progress:
    """What the listener has seen of one live request."""

    num_tokens: int
    last_token_time: float
    per_sample: dict[int, int]  # tokens of each of its n samples, by index


class MetricsSource(Protocol):
    """What the metrics read from the engine's client (engine/async_llm.py:AsyncLLM): the latest
    gauges, whether a request is still live, and the list of step listeners to join."""

    gauges: EngineGauges
    step_listeners: list[Callable[[StepStats | None, list[RequestOutput]], None]]
    request_listeners: list[Callable[[str, list[int], SamplingParams], None]]

    def has_request(self, request_id: str) -> bool: ...


class PrometheusMetrics:
    """The server's metrics registry and the step listener that feeds it."""

    content_type = CONTENT_TYPE_LATEST  # of `render()`'s output

    def __init__(
        self, registry: CollectorRegistry | None = None, model_name: str = "", metric_names: str = "both"
    ) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model_name = model_name  # the `model_name` label of every exported sample
        self.metric_names = metric_names  # exported prefixes: both, llmserve or vllm (export.py)
        self.num_requests_running = self.gauge("num_requests_running", "Requests running in the engine.")
        self.num_requests_waiting = self.gauge("num_requests_waiting", "Requests waiting (new or preempted).")
        self.kv_cache_usage = self.gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)."
        )
        self.prompt_tokens = self.counter(
            "prompt_tokens", "Prompt tokens of requests, counted once at their first output token."
        )
        self.generation_tokens = self.counter("generation_tokens", "Output tokens generated.")
        self.request_success = self.counter(
            "request_success",
            "Finished sequences (n > 1 counts each sample), by finish reason.",
            ["finished_reason"],
        )
        self.num_preemptions = self.counter("num_preemptions", "Requests preempted by the scheduler.")
        self.prefix_cache_queries = self.counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache when first scheduled."
        )
        self.prefix_cache_hits = self.counter(
            "prefix_cache_hits", "Prompt tokens of prefix_cache_queries found in the prefix cache."
        )
        self.spec_decode_num_draft_tokens = self.counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed and verified."
        )
        self.spec_decode_num_accepted_tokens = self.counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens the target accepted."
        )
        self.spec_decode_acceptance_rate = self.gauge(
            "spec_decode_draft_acceptance_rate", "Speculative decoding: accepted / proposed draft tokens."
        )
        self.spec_decode_mean_accepted_length = self.gauge(
            "spec_decode_mean_accepted_length",
            "Speculative decoding: tokens gained per verification step (accepted drafts + 1).",
        )
        self.time_to_first_token = self.histogram(
            "time_to_first_token_seconds", "Arrival to first output token.", LATENCY_BUCKETS
        )
        self.inter_token_latency = self.histogram(
            "inter_token_latency_seconds", "Time between successive outputs of a request.", ITL_BUCKETS
        )
        self.e2e_request_latency = self.histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS
        )
        self.request_queue_time = self.histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS
        )
        self.request_prefill_time = self.histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS
        )
        self.request_decode_time = self.histogram(
            "request_decode_time_seconds", "First token to finish.", LATENCY_BUCKETS
        )
        self.iteration_tokens = self.histogram(
            "iteration_tokens_total", "Tokens (prompt + generated) computed per engine step.", TOKEN_BUCKETS
        )
        self.iteration_batch_size = self.histogram(
            "iteration_batch_size", "Requests batched per engine step.", BATCH_BUCKETS
        )
        self._declare_operator_metrics()
        self._declare_lora_metrics()
        self.total_prompt_tokens = 0  # plain totals for the periodic log line
        self.total_generation_tokens = 0
        self._requests: dict[str, _Progress] = {}
        self._last_stats: StepStats | None = None
        self._is_live: Callable[[str], bool] = lambda request_id: True
        self._steps = 0

    def _declare_operator_metrics(self) -> None:
        """Preemption modes, swapping, per-request length and TPOT distributions, parameters, per-position
        speculative acceptance."""
        self.num_preemptions_by_mode = self.counter(
            "num_preemptions_by_mode", "Requests preempted, by mode (swap or recompute).", ["mode"]
        )
        self.swapped_out_blocks = self.counter(
            "swapped_out_blocks", "KV blocks copied to the CPU swap space."
        )
        self.swapped_in_blocks = self.counter(
            "swapped_in_blocks", "KV blocks copied back from the swap space."
        )
        self.num_requests_swapped = self.gauge(
            "num_requests_swapped", "Preempted requests whose KV waits in the CPU swap space."
        )
        self.cpu_cache_usage = self.gauge(
            "cpu_cache_usage_perc", "Fraction of the CPU swap space's KV blocks in use (0 to 1)."
        )
        self.request_prompt_tokens = self.histogram(
            "request_prompt_tokens", "Prompt tokens of finished requests.", REQUEST_TOKEN_BUCKETS
        )
        self.request_generation_tokens = self.histogram(
            "request_generation_tokens",
            "Generated tokens of finished requests (all n samples).",
            REQUEST_TOKEN_BUCKETS,
        )
        self.request_max_num_generation_tokens = self.histogram(
            "request_max_num_generation_tokens",
            "Tokens of the longest sample of finished requests.",
            REQUEST_TOKEN_BUCKETS,
        )
        self.request_time_per_output_token = self.histogram(
            "request_time_per_output_token_seconds",
            "TPOT: a finished request's decode time over its longest sample's tokens after the first.",
            ITL_BUCKETS,
        )
        self.request_inference_time = self.histogram(
            "request_inference_time_seconds", "First scheduled to finish.", LATENCY_BUCKETS
        )
        self.request_params_n = self.histogram("request_params_n", "The n parameter of requests.", N_BUCKETS)
        self.request_params_max_tokens = self.histogram(
            "request_params_max_tokens", "The max_tokens parameter of requests.", REQUEST_TOKEN_BUCKETS
        )
        self.kv_offload_hits = self.counter(
            "kv_offload_hits",
            "KV blocks a prefix hit loaded from a tier (ram, disk) instead of recomputing.",
            ["tier"],
        )
        self.kv_offload_bytes = self.counter(
            "kv_offload_bytes",
            "K/V bytes copied to (store) and from (load) a KV tier.",
            ["tier", "direction"],
        )
        self.kv_offload_load_seconds = self.histogram(
            "kv_offload_load_seconds", "Time loading blocks from a KV tier.", LATENCY_BUCKETS, ["tier"]
        )
        self.spec_decode_num_drafts = self.counter(
            "spec_decode_num_drafts", "Speculative decoding: verification steps (one request) with drafts."
        )
        self.spec_decode_accepted_per_pos = self.counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: requests whose draft at this position the target accepted.",
            ["position"],
        )

    # -- declaring metrics ----------------------------------------------------------------------

    def _declare_lora_metrics(self) -> None:
        """Tokens and latencies of the requests under each LoRA adapter (--enable-lora), by `lora_name`;
        requests of the base model are not in them."""
        self.lora_prompt_tokens = self.counter(
            "lora_prompt_tokens",
            "Prompt tokens of requests under the LoRA adapter, counted once at their first output token.",
            ["lora_name"],
        )
        self.lora_generation_tokens = self.counter(
            "lora_generation_tokens", "Output tokens generated under the LoRA adapter.", ["lora_name"]
        )
        self.lora_time_to_first_token = self.histogram(
            "lora_time_to_first_token_seconds",
            "Arrival to first output token of requests under the LoRA adapter.",
            LATENCY_BUCKETS,
            ["lora_name"],
        )
        self.lora_e2e_request_latency = self.histogram(
            "lora_e2e_request_latency_seconds",
            "Arrival to finish of requests under the LoRA adapter.",
            LATENCY_BUCKETS,
            ["lora_name"],
        )
        self._adapters: dict[str, str] = {}  # live request id -> its LoRA adapter's name

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        """A counter exposed as `llmserve:<name>_total`."""
        return Counter(PREFIX + name, documentation, list(labels), registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(PREFIX + name, documentation, list(labels), registry=self.registry)

    def histogram(
        self, name: str, documentation: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        return Histogram(PREFIX + name, documentation, list(labels), buckets=buckets, registry=self.registry)

    # -- feeding them ----------------------------------------------------------------------------

    def attach(self, llm: MetricsSource) -> None:
        """Listen to the engine's steps and read its queue and cache gauges at scrape time."""
        self.num_requests_running.set_function(lambda: llm.gauges.num_running)
        self.num_requests_waiting.set_function(lambda: llm.gauges.num_waiting)
        self.kv_cache_usage.set_function(lambda: llm.gauges.kv_cache_usage)
        # Since start-up, like the counters they are the ratios of (plus the number of drafts).
        spec_decode = lambda: llm.gauges.spec_decode  # noqa: E731 - read at scrape time
        self.spec_decode_acceptance_rate.set_function(lambda: spec_decode().acceptance_rate)
        self.spec_decode_mean_accepted_length.set_function(lambda: spec_decode().mean_accepted_length)
        self.num_requests_swapped.set_function(lambda: llm.gauges.num_swapped)
        self.cpu_cache_usage.set_function(lambda: llm.gauges.swap_space_usage)
        self._is_live = llm.has_request
        llm.step_listeners.append(self.on_step)
        llm.request_listeners.append(self.on_request)
        self.registry.register(RankCollector(lambda: llm.gauges.ranks))
        self.registry.register(LoRACollector(lambda: llm.gauges.lora_requests, lambda: llm.gauges.max_loras))

    def on_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Request listener: the parameters operators size the server by, and the request's adapter."""
        self.request_params_n.observe(params.n)
        self.request_params_max_tokens.observe(params.max_tokens)
        if params.lora_name is not None:
            self._adapters[request_id] = params.lora_name

    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        """Step listener: per-step histograms, token counters and per-request latencies.

        `stats` is None for outputs that no step produced (an abort's final output)."""
        if stats is not None and stats is not self._last_stats:
            self._last_stats = stats
            self._observe_step(stats)
        now = time.monotonic()
        for output in outputs:
            self._observe_output(output, now)
        self._steps += 1
        if self._steps % _PRUNE_EVERY_STEPS == 0:
            self._prune()

    def _observe_step(self, stats: StepStats) -> None:
        self.iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        self.iteration_batch_size.observe(stats.num_batched_seqs)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
            swapped = stats.num_preemptions_swap
            self.num_preemptions_by_mode.labels(mode="swap").inc(swapped)
            self.num_preemptions_by_mode.labels(mode="recompute").inc(stats.num_preemptions - swapped)
        if stats.num_swapped_out_blocks or stats.num_swapped_in_blocks:
            self.swapped_out_blocks.inc(stats.num_swapped_out_blocks)
            self.swapped_in_blocks.inc(stats.num_swapped_in_blocks)
        if stats.num_prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.num_prefix_cache_queries)
            self.prefix_cache_hits.inc(stats.num_prefix_cache_hits)
        for tier in stats.kv_tiers:
            self._observe_tier(tier)
        if stats.num_draft_tokens:
            self.spec_decode_num_draft_tokens.inc(stats.num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(stats.num_accepted_tokens)
            self.spec_decode_num_drafts.inc(stats.num_drafts)
            for position, count in enumerate(stats.accepted_per_position):
                self.spec_decode_accepted_per_pos.labels(position=str(position)).inc(count)

    def _observe_tier(self, tier: TierStepStats) -> None:
        if tier.hits:
            self.kv_offload_hits.labels(tier=tier.tier).inc(tier.hits)
        for direction, count in (("load", tier.bytes_loaded), ("store", tier.bytes_stored)):
            if count:
                self.kv_offload_bytes.labels(tier=tier.tier, direction=direction).inc(count)
        for seconds in tier.load_seconds:
            self.kv_offload_load_seconds.labels(tier=tier.tier).observe(seconds)

    def _observe_output(self, output: RequestOutput, now: float) -> None:
        """`output` is a delta (RequestOutputKind.DELTA): its tokens and finish reasons are new."""
        num_new = sum(len(c.token_ids) for c in output.outputs)
        if num_new:
            progress = self._requests.get(output.request_id)
            if progress is None:
                progress = self._requests[output.request_id] = _Progress(0, now, {})
                self._observe_first_token(output, now)
            else:
                self.inter_token_latency.observe(now - progress.last_token_time)
            self.generation_tokens.inc(num_new)
            self.total_generation_tokens += num_new
            adapter = self._adapters.get(output.request_id)
            if adapter is not None:
                self.lora_generation_tokens.labels(lora_name=adapter).inc(num_new)
            progress.num_tokens += num_new
            progress.last_token_time = now
            for completion in output.outputs:
                samples = progress.per_sample
                samples[completion.index] = samples.get(completion.index, 0) + len(completion.token_ids)
        for completion in output.outputs:
            if completion.finish_reason is not None:
                self.request_success.labels(finished_reason=_reason(completion)).inc()
        if output.finished:
            self._observe_finished(output, self._requests.pop(output.request_id, None))
            self._adapters.pop(output.request_id, None)

    def _observe_first_token(self, output: RequestOutput, now: float) -> None:
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.total_prompt_tokens += len(output.prompt_token_ids)
        adapter = self._adapters.get(output.request_id)
        if adapter is not None:
            self.lora_prompt_tokens.labels(lora_name=adapter).inc(len(output.prompt_token_ids))
        metrics = output.metrics
        if metrics is not None:
            first_token_time = metrics.first_token_time or now
            self.time_to_first_token.observe(first_token_time - metrics.arrival_time)
            if adapter is not None:
                self.lora_time_to_first_token.labels(lora_name=adapter).observe(
                    first_token_time - metrics.arrival_time
                )

    def _observe_finished(self, output: RequestOutput, progress: _Progress | None) -> None:
        longest = max(progress.per_sample.values(), default=0) if progress is not None else 0
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(progress.num_tokens if progress is not None else 0)
        self.request_max_num_generation_tokens.observe(longest)
        metrics = output.metrics
        if metrics is None or metrics.finished_time is None:
            return
        self.e2e_request_latency.observe(metrics.finished_time - metrics.arrival_time)
        adapter = self._adapters.get(output.request_id)
        if adapter is not None:
            self.lora_e2e_request_latency.labels(lora_name=adapter).observe(
                metrics.finished_time - metrics.arrival_time
            )
        if metrics.first_scheduled_time is not None:
            self.request_queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
            self.request_inference_time.observe(metrics.finished_time - metrics.first_scheduled_time)
        if metrics.first_token_time is None:
            return
        decode_time = metrics.finished_time - metrics.first_token_time
        self.request_decode_time.observe(decode_time)
        if longest > 1:
            self.request_time_per_output_token.observe(decode_time / (longest - 1))
        if metrics.first_scheduled_time is not None:
            self.request_prefill_time.observe(metrics.first_token_time - metrics.first_scheduled_time)

    def _prune(self) -> None:
        """Forget requests the engine no longer knows (aborted ones never report a finished output)."""
        for request_id in [r for r in self._requests if not self._is_live(r)]:
            del self._requests[request_id]
        # (the event loop adds entries meanwhile: a copy of the keys, and a pop that may find none)
        for request_id in [r for r in list(self._adapters) if not self._is_live(r)]:
            self._adapters.pop(request_id, None)

    # -- exposing them ---------------------------------------------------------------------------

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format, under every exported prefix with the
        `model_name` label (export.py)."""
        return generate_latest(exposition_registry(self.registry, self.model_name, self.metric_names))


class RankCollector(Collector):
    """The tensor-parallel ranks' own reports as `llmserve:rank_*{rank}` series, read at scrape time."""

    def __init__(self, ranks: Callable[[], Sequence[RankStats]]) -> None:
        self.ranks = ranks

    def describe(self) -> list[Metric]:
        return []  # the series depend on the ranks, known only at scrape time

    def collect(self) -> list[Metric]:
        ranks = self.ranks()
        if not ranks:
            return []
        families = [
            _gauge("rank_up", "1 while the rank's process runs.", [(r, r.exit_code is None) for r in ranks]),
            GaugeMetricFamily(PREFIX + "rank_info", "The rank's process id.", labels=["rank", "pid"]),
            _gauge("rank_exit_code", "Exit code of a rank that exited.", [(r, r.exit_code) for r in ranks]),
            _counter("rank_steps", "Steps the rank ran its shard for.", [(r, r.num_steps) for r in ranks]),
            _counter(
                "rank_forward_seconds",
                "Seconds the rank spent running its shard.",
                [(r, r.forward_seconds) for r in ranks],
            ),
            _gauge(
                "rank_kv_cache_usage_perc",
                "Fraction of the rank's KV blocks its requests hold (0 to 1).",
                [(r, r.kv_cache_usage) for r in ranks],
            ),
            _gauge(
                "rank_kv_cache_blocks", "Blocks in the rank's KV pool.", [(r, r.kv_num_blocks) for r in ranks]
            ),
            _gauge(
                "rank_kv_cache_bytes", "Bytes of the rank's KV pool.", [(r, r.kv_cache_bytes) for r in ranks]
            ),
        ]
        for rank in ranks:
            families[1].add_metric([str(rank.rank), str(rank.pid)], 1)
        return families + _expert_load(ranks)


class LoRACollector(Collector):
    """Requests running and waiting under each loaded LoRA adapter, as `llmserve:lora_requests_*
    {lora_name}` series read at scrape time, and vLLM's `lora_requests_info` (the adapters with running
    and with waiting requests, comma-joined, and `max_lora` as labels; the scrape's time as value);
    none without --enable-lora."""

    def __init__(
        self, adapters: Callable[[], Sequence[tuple[str, int, int]]], max_loras: Callable[[], int]
    ) -> None:
        self.adapters = adapters
        self.max_loras = max_loras

    def describe(self) -> list[Metric]:
        return []  # the series depend on the adapters loaded, known only at scrape time

    def collect(self) -> list[Metric]:
        adapters = self.adapters()
        if not adapters:
            return []
        running = GaugeMetricFamily(
            PREFIX + "lora_requests_running", "Requests running under the LoRA adapter.", labels=["lora_name"]
        )
        waiting = GaugeMetricFamily(
            PREFIX + "lora_requests_waiting", "Requests waiting under the LoRA adapter.", labels=["lora_name"]
        )
        for name, num_running, num_waiting in adapters:
            running.add_metric([name], num_running)
            waiting.add_metric([name], num_waiting)
        info = GaugeMetricFamily(
            PREFIX + "lora_requests_info",
            "Running stats on LoRA requests (vLLM's series): its labels name the adapters.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        waiting_names = ",".join(name for name, _, num_waiting in adapters if num_waiting)
        running_names = ",".join(name for name, num_running, _ in adapters if num_running)
        info.add_metric([str(self.max_loras()), waiting_names, running_names], time.time())
        return [running, waiting, info]


def _gauge(name: str, documentation: str, values: list[tuple[RankStats, float | None]]) -> Metric:
    family = GaugeMetricFamily(PREFIX + name, documentation, labels=["rank"])
    for rank, value in values:
        if value is not None:
            family.add_metric([str(rank.rank)], float(value))
    return family


def _counter(name: str, documentation: str, values: list[tuple[RankStats, float]]) -> Metric:
    family = CounterMetricFamily(PREFIX + name, documentation, labels=["rank"])
    for rank, value in values:
        family.add_metric([str(rank.rank)], float(value))
    return family


def _expert_load(ranks: Sequence[RankStats]) -> list[Metric]:
    """Mixture-of-experts load per rank and expert (none for a dense model): divided by the rank's
    steps, the tokens each expert took per step and the all-to-all bytes per step."""
    if not any(rank.expert_tokens for rank in ranks):
        return []
    tokens = CounterMetricFamily(
        PREFIX + "rank_expert_tokens",
        "(token, expert) pairs the rank computed for the expert, over its expert layers.",
        labels=["rank", "expert"],
    )
    for rank in ranks:
        for offset, count in enumerate(rank.expert_tokens):
            tokens.add_metric([str(rank.rank), str(rank.first_expert + offset)], float(count))
    sent = _counter(
        "rank_all_to_all_bytes",
        "Bytes the rank's expert-parallel all-to-alls sent to other ranks.",
        [(r, r.all_to_all_bytes) for r in ranks],
    )
    return [tokens, sent]


def _reason(completion: CompletionOutput) -> str:
    return completion.finish_reason or "abort"
