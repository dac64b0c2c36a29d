"""Online serving benchmark: an async load generator for any OpenAI-compatible completions server.

Requests stream from /v1/completions (`stream`, `stream_options.include_usage`, `ignore_eos`), sent
at Poisson arrival times (or all at once), optionally capped at C in flight. Latency is taken on the
client from the SSE chunks as they arrive, so the numbers include the server's HTTP and detokenizing
path, which is what a user sees; the same file of requests can be replayed against llmserve, vLLM
or llama.cpp. The client is aiohttp (as in vLLM's benchmark): on a 2-core machine every CPU second
the load generator spends is taken from the server under test, and aiohttp's C parser and line
reader cost the client a fraction of httpx's CPU. The run reports that CPU time next to its
throughput.

Metrics per request: TTFT (send -> first chunk with a token), TPOT ((e2e - TTFT) / (tokens - 1)),
inter-token latency (gaps between chunks) and e2e. Goodput (benchmarks/goodput.py, vLLM's
`request_goodput`) counts only requests meeting every latency target: throughput that misses its targets
is not useful throughput, and a failed or refused request is a miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import httpx
import numpy as np

from llmserve.benchmarks.goodput import DEFAULT_GOODPUT, finite_or_text, meets_targets, offered_percentiles
from llmserve.benchmarks.results import bench_dependency, format_table, pyplot, save_figure
from llmserve.benchmarks.workload import BenchRequest

if TYPE_CHECKING:
    import aiohttp  # the bench extra's client, imported when a load runs

PERCENTILES = (50, 90, 99)
_KEEPALIVE_SECONDS = 2.0  # an idle client connection's life: under the servers' keep-alive


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds."""

    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str = ""
    sent_at: float | None = None  # seconds from the run's start to this request's send

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for a single-token output)."""
        if self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def meets(self, targets_ms: dict[str, float]) -> bool:
        """Completed within every latency target (ms by metric: ttft, tpot, e2el)."""
        return meets_targets(self.ok, self.ttft, self.tpot, self.e2e, targets_ms)


class StreamTracker:
    """Folds the SSE lines of one streamed completion into a `RequestResult`.

    A chunk with a choice counts as tokens arriving (servers send one per detokenized step); the
    final usage chunk (no choices) gives exact token counts. Without usage, output tokens fall back
    to the number of chunks, which undercounts when a server merges tokens into one chunk.
    """

    def __init__(self, start: float, prompt_tokens: int) -> None:
        self.start = start
        self.chunk_times: list[float] = []
        self.usage: dict | None = None
        self.prompt_tokens = prompt_tokens
        self.done = False

    def feed(self, line: bytes, now: float) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return  # blank separators, comments, event names
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if chunk.get("error"):
            raise RuntimeError(f"server error in stream: {chunk['error']}")
        if chunk.get("choices"):
            self.chunk_times.append(now)
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def result(self, end: float) -> RequestResult:
        if not self.chunk_times:
            return RequestResult(error="the stream carried no tokens", e2e=end - self.start)
        usage = self.usage or {}
        return RequestResult(
            ok=True,
            prompt_tokens=usage.get("prompt_tokens", self.prompt_tokens),
            output_tokens=usage.get("completion_tokens", len(self.chunk_times)),
            ttft=self.chunk_times[0] - self.start,
            e2e=end - self.start,
            itls=np.diff(self.chunk_times).tolist(),
        )


def completion_payload(
    request: BenchRequest, model: str, prompt_format: str = "ids", temperature: float = 0.0
) -> dict:
    prompt = request.prompt_token_ids if prompt_format == "ids" else request.prompt
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": request.max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


async def send_request(
    client: aiohttp.ClientSession, url: str, payload: dict, prompt_tokens: int
) -> RequestResult:
    """POST one streaming completion and time its chunks; failures come back as results, not raises."""
    client_error = bench_dependency("aiohttp").ClientError
    start = time.perf_counter()
    tracker = StreamTracker(start, prompt_tokens)
    try:
        async with client.post(f"{url}/v1/completions", json=payload) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                return RequestResult(error=f"HTTP {response.status}: {body[:300]}")
            async for line in response.content:  # one SSE line at a time
                tracker.feed(line, time.perf_counter())
                if tracker.done:
                    break
    except (TimeoutError, client_error, RuntimeError, ValueError) as error:  # ValueError: bad JSON
        return RequestResult(error=f"{type(error).__name__}: {error}")
    return tracker.result(time.perf_counter())


def salt_requests(requests: Sequence[BenchRequest], salt_id: int, salt_text: str) -> list[BenchRequest]:
    """The requests with one run-specific token (or text) in front of every prompt.

    Repeating a workload against a server with automatic prefix caching (every run of a sweep, or
    a second invocation) would otherwise find every prompt cached and measure no prefill at all.
    A different first token changes every block hash, so nothing of an earlier run is reused,
    while the workload keeps its shape (one more prompt token per request).
    """
    return [
        BenchRequest(salt_text + r.prompt, [salt_id, *r.prompt_token_ids], r.max_tokens) for r in requests
    ]


def pick_salts(requests: Sequence[BenchRequest], count: int, seed: int | None = None) -> list[int]:
    """`count` distinct token ids that occur in the workload (so valid for its tokenizer), at random."""
    vocabulary = np.unique(np.concatenate([np.asarray(r.prompt_token_ids) for r in requests]))
    if len(vocabulary) < count:
        raise ValueError(f"the workload has only {len(vocabulary)} distinct tokens for {count} salts")
    return np.random.default_rng(seed).choice(vocabulary, size=count, replace=False).tolist()


def arrival_offsets(num_requests: int, request_rate: float, seed: int = 0) -> np.ndarray:
    """Send times (s from the start) of a Poisson process at `request_rate`/s; inf sends all at 0."""
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, num_requests)
    return np.cumsum(gaps) - gaps[0]  # the first request goes at once


def drawn_rate(offsets: np.ndarray) -> float | None:
    """The rate a draw of send times offers: its gaps over its span, None for fewer than two sends or
    all at once. A finite draw strays from its nominal rate (seed 0's 800 arrivals at 2/s span 415.6 s,
    1.92/s), so a server keeping up completes this many per second, not the nominal rate."""
    span = float(offsets[-1] - offsets[0]) if len(offsets) > 1 else 0.0
    return (len(offsets) - 1) / span if span > 0 else None


@dataclass
class LoadGenerator:
    """Sends requests at Poisson arrival times (all at once for rate inf), at most C in flight."""

    url: str
    model: str
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    prompt_format: str = "ids"  # "ids" sends prompt_token_ids (exact lengths), "text" the prompt text
    extra_body: dict | None = None  # fields added to every request (a response_format, say)

    async def run(self, requests: Sequence[BenchRequest], progress=None) -> tuple[list[RequestResult], float]:
        """Results in request order, and seconds from the first send to the last response."""
        offsets = arrival_offsets(len(requests), self.request_rate, self.seed)
        limit = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
        # no cap of its own (max_concurrency is the only one); an idle connection is dropped before the
        # server's keep-alive ends (uvicorn's: 5 s), or a send may reuse one the server is closing
        # ("Can not write request body": one request of a sweep lost so)
        http = bench_dependency("aiohttp")
        connector = http.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_SECONDS)
        timeout = http.ClientTimeout(total=None)
        async with http.ClientSession(connector=connector, timeout=timeout) as client:
            start = time.perf_counter()
            sends = [
                self._send_at(client, request, start, offset, limit, progress)
                for request, offset in zip(requests, offsets.tolist(), strict=True)
            ]
            results = await asyncio.gather(*sends)
            return list(results), time.perf_counter() - start

    async def _send_at(
        self,
        client: aiohttp.ClientSession,
        request: BenchRequest,
        run_start: float,
        offset: float,
        limit: asyncio.Semaphore | None,
        progress,
    ) -> RequestResult:
        await asyncio.sleep(max(0.0, run_start + offset - time.perf_counter()))
        payload = completion_payload(request, self.model, self.prompt_format) | (self.extra_body or {})
        async with limit or contextlib.nullcontext():
            sent = time.perf_counter()
            result = await send_request(client, self.url, payload, request.prompt_len)
        result.sent_at = sent - run_start
        if progress is not None:
            progress.update(1)
        return result


def served_model_name(url: str) -> str:
    """The first model the server lists, for servers that insist on a model name."""
    response = httpx.get(f"{url}/v1/models", timeout=30)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{url}/v1/models lists no model; pass --model")
    return models[0]["id"]


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Distribution | None:
        if len(seconds) == 0:
            return None
        values = 1e3 * np.asarray(seconds, dtype=np.float64)
        p50, p90, p99 = np.percentile(values, PERCENTILES)
        return cls(float(values.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class ServeMetrics:
    num_requests: int
    num_ok: int
    duration: float  # first send -> last response, seconds
    prompt_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    request_goodput: float  # requests / s meeting every latency target (vLLM's field)
    # the send schedule's own rate (drawn_rate), None for all at once; request_throughput over it is
    # the share of the offered load the server kept up with, the drain of the last requests included
    offered_rate: float | None
    slo_attainment: float  # fraction of the offered requests meeting every target
    goodput_targets_ms: dict[str, float]  # metric (ttft, tpot, e2el) -> target
    latency_ms: dict[str, Distribution | None]  # ttft, tpot, itl, e2e, over the completed requests
    # ttft, tpot, e2e percentiles over every offered request, a failed one ranked as inf (goodput.py)
    latency_ms_offered: dict[str, dict[str, float]]
    errors: list[str]
    # CPU the load generator itself used during the run: on a machine with few cores it is taken
    # from the server, so a reader needs it next to the throughput
    client_cpu_seconds: float | None = None
    # The server's prefix-cache queries and hits (tokens) during the run, summed and per replica, from
    # its /metrics (benchmarks/prefix_hits.py); None if it has no such counters
    prefix_cache: dict | None = None
    # Every request in workload order (send time, lengths, TTFT / TPOT / e2e in ms), so that a p99 can
    # be traced to the requests behind it
    per_request: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        data = asdict(self)
        data["latency_ms_offered"] = {
            metric: {name: finite_or_text(value) for name, value in values.items()}
            for metric, values in self.latency_ms_offered.items()
        }
        return data


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    goodput: dict[str, float] | None = None,
    client_cpu_seconds: float | None = None,
    offered_rate: float | None = None,
) -> ServeMetrics:
    """The run's metrics; `goodput`: latency targets in ms by metric (default ttft 1000, tpot 50)."""
    targets = dict(DEFAULT_GOODPUT if goodput is None else goodput)
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    meeting = sum(r.meets(targets) for r in results)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itls],
        "e2e": [r.e2e for r in ok],
    }
    return ServeMetrics(
        num_requests=len(results),
        num_ok=len(ok),
        duration=duration,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(prompt_tokens + output_tokens) / duration,
        request_goodput=meeting / duration,
        offered_rate=offered_rate,
        slo_attainment=meeting / len(results) if results else 0.0,
        goodput_targets_ms=targets,
        latency_ms={name: Distribution.of(values) for name, values in samples.items()},
        latency_ms_offered=offered_latencies(results),
        errors=sorted({r.error for r in results if not r.ok})[:10],
        client_cpu_seconds=client_cpu_seconds,
        per_request=[request_record(r) for r in results],
    )


def offered_latencies(results: Sequence[RequestResult]) -> dict[str, dict[str, float]]:
    """TTFT, TPOT and e2e percentiles (ms) over every offered request, a failed one as inf."""
    columns = {
        "ttft": [r.ttft if r.ok else None for r in results],
        "tpot": [(r.tpot or 0.0) if r.ok else None for r in results],  # one token: no TPOT to miss
        "e2e": [r.e2e if r.ok else None for r in results],
    }
    return {
        metric: dict(
            zip((f"p{p}" for p in PERCENTILES), offered_percentiles(values, PERCENTILES), strict=True)
        )
        for metric, values in columns.items()
    }


def describe_targets(targets_ms: dict[str, float]) -> str:
    names = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "e2e"}
    return " and ".join(f"{names[key]} <= {value:g} ms" for key, value in targets_ms.items())


def request_record(result: RequestResult) -> dict:
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1e3, 2)

    return {
        "ok": result.ok,
        "sent_s": None if result.sent_at is None else round(result.sent_at, 4),
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": result.output_tokens,
        "ttft_ms": ms(result.ttft),
        "tpot_ms": ms(result.tpot),
        "e2e_ms": ms(result.e2e),
    }


def format_report(metrics: ServeMetrics, label: str = "") -> str:
    rows = [{"metric": name, **asdict(dist)} for name, dist in metrics.latency_ms.items() if dist is not None]
    lines = [
        f"{label}{metrics.num_ok}/{metrics.num_requests} requests ok in {metrics.duration:.2f} s",
        f"throughput: {metrics.request_throughput:.2f} req/s, {metrics.output_throughput:,.1f} output tok/s, "
        f"{metrics.total_token_throughput:,.1f} total tok/s",
        *(
            [
                f"offered as drawn: {metrics.offered_rate:.2f} req/s; completed "
                f"{metrics.request_throughput / metrics.offered_rate:.3f}x that"
            ]
            if metrics.offered_rate
            else []
        ),
        *(
            [f"load generator CPU: {metrics.client_cpu_seconds:.2f} s"]
            if metrics.client_cpu_seconds is not None
            else []
        ),
        f"request goodput ({describe_targets(metrics.goodput_targets_ms)}): "
        f"{metrics.request_goodput:.2f} req/s, {100 * metrics.slo_attainment:.1f}% of "
        f"{metrics.num_requests} offered requests",
        format_table(rows, ("metric", "mean", "p50", "p90", "p99")) + "\n(latencies in ms)",
        "over every offered request (a failed one as inf): "
        + ", ".join(
            f"{metric.upper()} p99 {values['p99']:,.1f} ms"
            for metric, values in metrics.latency_ms_offered.items()
        ),
    ]
    timed = [(index, r) for index, r in enumerate(metrics.per_request) if r["ttft_ms"] is not None]
    if timed:
        index, slowest = max(timed, key=lambda item: item[1]["ttft_ms"])
        sent = "" if slowest["sent_s"] is None else f", sent at {slowest['sent_s']:.2f} s"
        lines.append(
            f"slowest TTFT: request {index} ({slowest['prompt_tokens']} prompt tokens{sent}): "
            f"{slowest['ttft_ms']:,.1f} ms"
        )
    if metrics.prefix_cache is not None and metrics.prefix_cache["hit_rate"] is not None:
        cache = metrics.prefix_cache
        lines.append(
            f"prefix cache: {cache['hits']:,.0f} of {cache['queries']:,.0f} prompt tokens hit "
            f"({100 * cache['hit_rate']:.1f}%) over {len(cache['by_replica'])} engine(s)"
        )
    lines += [f"error: {error}" for error in metrics.errors]
    return "\n".join(lines)


def plot_sweep(rates: Sequence[float], sweep: Sequence[ServeMetrics], path) -> None:
    """Goodput and completed requests against offered load, and latency against achieved output
    throughput; one point per request rate (an all-at-once run has no offered rate to plot against)."""
    plt = pyplot()
    figure, axes = plt.subplots(1, 4, figsize=(18, 4))
    _plot_goodput(axes[0], rates, sweep)
    throughput = [m.output_throughput for m in sweep]
    for axis, metric in zip(axes[1:], ("ttft", "tpot", "e2e"), strict=True):
        for percentile, style in (("p50", "-o"), ("p99", "--s")):
            values = [getattr(m.latency_ms[metric], percentile, math.nan) for m in sweep]  # nan: no data
            axis.plot(throughput, values, style, label=percentile)
        for rate, x, metrics in zip(rates, throughput, sweep, strict=True):
            if metrics.latency_ms[metric]:
                axis.annotate(f"{rate:g}/s", (x, metrics.latency_ms[metric].p50), fontsize=7)
        axis.set(xlabel="output tokens / s", ylabel=f"{metric.upper()} (ms)", title=metric.upper())
        axis.legend()
    save_figure(figure, path)


def _plot_goodput(axis, rates: Sequence[float], sweep: Sequence[ServeMetrics]) -> None:
    points = [(rate, m) for rate, m in zip(rates, sweep, strict=True) if math.isfinite(rate)]
    offered = [rate for rate, _ in points]
    axis.plot(offered, offered, ":", color="grey", label="offered")
    if all(m.offered_rate for _, m in points):  # what each draw actually offered (drawn_rate)
        axis.plot(offered, [m.offered_rate for _, m in points], "--", color="grey", label="offered as drawn")
    axis.plot(offered, [m.request_throughput for _, m in points], "-o", label="completed")
    axis.plot(offered, [m.request_goodput for _, m in points], "-s", label="goodput")
    targets = describe_targets(sweep[0].goodput_targets_ms) if sweep else ""
    axis.set(xlabel="offered load (req/s)", ylabel="requests / s", title=f"goodput ({targets})")
    axis.legend()


def plot_distributions(results: Sequence[RequestResult], path) -> None:
    """CDFs of TTFT, TPOT and e2e for a single run."""
    plt = pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    ok = [r for r in results if r.ok]
    columns = {
        "TTFT": [r.ttft for r in ok],
        "TPOT": [r.tpot for r in ok if r.tpot is not None],
        "e2e": [r.e2e for r in ok],
    }
    for axis, (name, seconds) in zip(axes, columns.items(), strict=True):
        values = np.sort(1e3 * np.asarray(seconds, dtype=np.float64))
        axis.plot(values, np.arange(1, len(values) + 1) / max(len(values), 1))
        axis.set(xlabel=f"{name} (ms)", ylabel="fraction of requests", title=f"{name} CDF")
    save_figure(figure, path)
