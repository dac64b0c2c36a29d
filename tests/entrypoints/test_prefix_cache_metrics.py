"""Prefix-cache hits reported per request (`usage.prompt_tokens_details.cached_tokens`) and in total
(`llmserve:prefix_cache_queries_total`, `llmserve:prefix_cache_hits_total` on /metrics)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.config import EngineArgs
from llmserve.engine.llm_engine import LLMEngine
from llmserve.metrics.prometheus import PrometheusMetrics
from llmserve.metrics.stats import StepStats
from llmserve.sampling_params import SamplingParams
from tests.entrypoints.conftest import MAX_MODEL_LEN, ServerProcess, start_server, tiny_server_args

BLOCK_SIZE = 16
MODEL = "tiny-llama"
QUERIES, HITS = "llmserve:prefix_cache_queries_total", "llmserve:prefix_cache_hits_total"
NO_EOS = {"ignore_eos": True}  # at least two steps: the admission step's stats reach /metrics first


def cacheable(num_prompt_tokens: int) -> int:
    """Tokens a repeat of a prompt finds cached: its full blocks, less the last token's if it ends one."""
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def counters(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in (QUERIES, HITS)
    }


# -- in one process: the cache manager's counters reach the exported ones ---------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    args = EngineArgs(
        model=tiny_model_dir,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory="16MiB",
        block_size=BLOCK_SIZE,
    )
    return LLMEngine(args)


def run(engine: LLMEngine, metrics: PrometheusMetrics, request_id: str, prompt: list[int]) -> int:
    """Run one request to the end, feeding every step to the listener; returns its cached tokens."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        outputs = engine.step()
        metrics.on_step(engine.last_step, outputs)
    (output,) = [o for o in outputs if o.request_id == request_id]
    return output.num_cached_tokens


def test_cache_manager_counters_feed_the_exported_counters(engine):
    metrics, kv = PrometheusMetrics(), engine.kv_cache_manager
    prompt = list(range(1000, 1100))
    before = (kv.prefix_cache_queries, kv.prefix_cache_hits)
    cached = [run(engine, metrics, "first", prompt), run(engine, metrics, "again", prompt)]
    cached.append(run(engine, metrics, "half", prompt[:50] + list(range(2000, 2030))))
    assert cached == [0, cacheable(100), 48]
    grown = (kv.prefix_cache_queries - before[0], kv.prefix_cache_hits - before[1])
    assert grown == (100 + 100 + 80, sum(cached))
    assert counters(metrics.render().decode()) == {QUERIES: grown[0], HITS: grown[1]}


def test_lookups_of_a_step_that_raised_are_reported_with_the_next(engine, monkeypatch):
    prompt = list(range(3000, 3070))
    run(engine, PrometheusMetrics(), "warm", prompt)

    def fail(scheduled):
        raise RuntimeError("boom")

    with monkeypatch.context() as patch:
        patch.setattr(engine.model_runner, "execute", fail)
        engine.add_request("lost", prompt, SamplingParams(max_tokens=3))
        with pytest.raises(RuntimeError):
            engine.step()
    engine.abort_request("lost")  # what the engine process does with a failed step's requests
    engine.add_request("next", list(range(4000, 4040)), SamplingParams(max_tokens=1))
    engine.step()
    stats = engine.last_step
    assert (stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (70 + 40, cacheable(70))


def test_a_repeated_step_report_is_not_counted_twice():
    metrics = PrometheusMetrics()
    stats = StepStats(1, 0, 0.1, 1, 40, 1, 0, 0.01, num_prefix_cache_queries=40, num_prefix_cache_hits=32)
    metrics.on_step(stats, [])
    metrics.on_step(stats, [])  # the same report seen again is not counted twice
    metrics.on_step(StepStats(1, 0, 0.1, 1, 0, 1, 0, 0.01), [])
    assert counters(metrics.render().decode()) == {QUERIES: 40, HITS: 32}


# -- through the server: usage and /metrics agree with what the engine found ----------------------


@pytest.fixture(scope="module")
def cached_server(tiny_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = tiny_server_args(tiny_model_dir, "--block-size", str(BLOCK_SIZE))
    process = start_server(args, log)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(cached_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cached_server.base_url}/v1", api_key="unused", max_retries=0)


def scrape(server: ServerProcess) -> dict[str, float]:
    return counters(httpx.get(server.base_url + "/metrics", timeout=10).text)


def long_text(tag: str) -> str:
    """A prompt of a few hundred tokens that no other test sends."""
    return " ".join(f"{tag} sentence {i} says something about item {i * 7}." for i in range(25))


@pytest.mark.server
def test_completion_usage_reports_cached_tokens_as_openai_does(cached_server):
    prompt = long_text("completion")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **NO_EOS}
    before = scrape(cached_server)
    with httpx.Client(base_url=cached_server.base_url, timeout=60) as http:
        first, again = (http.post("/v1/completions", json=body).json()["usage"] for _ in range(2))
    length = first["prompt_tokens"]
    assert length > 4 * BLOCK_SIZE
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}  # present even when nothing hit
    assert again == {
        "prompt_tokens": length,
        "completion_tokens": 4,
        "total_tokens": length + 4,
        "prompt_tokens_details": {"cached_tokens": cacheable(length)},
    }
    after = scrape(cached_server)
    assert after[QUERIES] - before[QUERIES] == 2 * length
    assert after[HITS] - before[HITS] == cacheable(length)


@pytest.mark.server
def test_completion_stream_usage_chunk_and_parallel_samples(client, cached_server):
    prompt = long_text("stream")

    def usage(n: int):
        options = {"include_usage": True}
        kwargs = dict(model=MODEL, prompt=prompt, n=n, max_tokens=4, extra_body=NO_EOS)
        *_, last = client.completions.create(stream=True, stream_options=options, **kwargs)
        return last.usage

    before = scrape(cached_server)
    first, again = usage(1), usage(2)
    length = first.prompt_tokens
    assert first.prompt_tokens_details.cached_tokens == 0
    assert again.prompt_tokens_details.cached_tokens == cacheable(length) > 0
    assert (again.prompt_tokens, again.completion_tokens) == (length, 2 * 4)  # the prompt once for n = 2
    after = scrape(cached_server)
    assert after[QUERIES] - before[QUERIES] == 2 * length  # the second sample shares the first's blocks
    assert after[HITS] - before[HITS] == cacheable(length)


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True])
def test_chat_usage_reports_cached_tokens(client, cached_server, stream):
    messages = [{"role": "user", "content": long_text(f"chat-{stream}")}]

    def usage():
        kwargs = dict(model=MODEL, messages=messages, max_tokens=4, extra_body=NO_EOS)
        if not stream:
            return client.chat.completions.create(**kwargs).usage
        options = {"include_usage": True}
        *_, last = client.chat.completions.create(stream=True, stream_options=options, **kwargs)
        return last.usage

    before = scrape(cached_server)
    first, again = usage(), usage()
    length = first.prompt_tokens
    assert length > 4 * BLOCK_SIZE
    # The chat template's opening may be cached by earlier chats: whole blocks of it at most.
    cached = (first.prompt_tokens_details.cached_tokens, again.prompt_tokens_details.cached_tokens)
    assert cached[0] % BLOCK_SIZE == 0 and cached[0] < 4 * BLOCK_SIZE
    assert cached[1] == cacheable(length)
    after = scrape(cached_server)
    assert after[QUERIES] - before[QUERIES] == 2 * length
    assert after[HITS] - before[HITS] == sum(cached)
