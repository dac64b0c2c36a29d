"""Server pieces without a model: engine failures over HTTP, the metrics listener, naming, token bytes."""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.engine.async_llm import AsyncLLM, RequestFailedError
from llmserve.engine.health import EngineHealth
from llmserve.entrypoints.openai.api_server import build_app, default_served_model_name
from llmserve.entrypoints.openai.serving import merge_streams, raw_token_bytes
from llmserve.metrics.prometheus import PrometheusMetrics
from llmserve.metrics.stats import EngineGauges, StepStats
from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams


class _Tokenizer:
    """Bytes as tokens: enough to render prompts and text."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")


class FailingEngine:
    """An AsyncLLM stand-in whose requests produce `fail_after` tokens, then fail (None: never)."""

    def __init__(self, fail_after: int | None) -> None:
        self.fail_after = fail_after
        self.tokenizer = _Tokenizer()
        self.step_listeners: list = []
        self.request_listeners: list = []
        self.is_running = True
        model = types.SimpleNamespace(max_model_len=64, arch=types.SimpleNamespace(vocab_size=256))
        self.config = types.SimpleNamespace(
            model=model, structured_outputs=types.SimpleNamespace(compile_timeout=10.0)
        )
        self.gauges = EngineGauges()
        self.health = EngineHealth()
        self.queued_prompt_tokens = 0
        # no LoRA adapters (AsyncLLM.lora)
        self.lora = types.SimpleNamespace(names=(), adapters={}, cache_keys=dict)
        self.memory = None  # no memory report (AsyncLLM.memory: the engine measures its model)

    def has_request(self, request_id: str) -> bool:
        return False

    def add_warmup_listener(self, listener) -> None:
        pass  # never warms up: admission keeps no prior

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    async def generate(
        self, prompt, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator:
        prompt_ids = self.encode_prompt(prompt)
        kind = params.output_kind
        for count in range(1, params.max_tokens + 1):
            await asyncio.sleep(0)
            if self.fail_after is not None and count > self.fail_after:
                raise RequestFailedError("the engine step failed")
            done = count == params.max_tokens
            if kind is RequestOutputKind.FINAL_ONLY and not done:
                continue
            new = 1 if kind is RequestOutputKind.DELTA else count
            completion = CompletionOutput(0, "x" * new, [120] * new, "length" if done else None)
            yield RequestOutput(request_id, None, prompt_ids, [completion], finished=done)


async def post(app, path: str, body: dict) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, json=body)


def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.splitlines() if line]


def test_engine_error_mid_stream_ends_with_an_error_event_and_the_server_keeps_serving():
    engine = FailingEngine(fail_after=2)
    app = build_app(engine, "m")
    body = {"prompt": "hi", "max_tokens": 5, "stream": True}
    events = sse_events(asyncio.run(post(app, "/v1/completions", body)))
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "engine step failed" in error["message"]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-2]] == ["x", "x"]
    engine.fail_after = None
    assert asyncio.run(post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 3})).status_code == 200
    assert app.state.llmserve.ctx.in_flight == 0  # every admission was released


def test_engine_error_without_streaming_is_a_500_with_the_error_body():
    app = build_app(FailingEngine(fail_after=1), "m")
    response = asyncio.run(
        post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    )
    assert response.status_code == 500
    assert response.json() == {
        "error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}
    }


def _output(request_id: str, prompt_len: int, tokens: list[int], finish: str | None = None) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.3)
    if finish:
        metrics.finished_time = 1.0
    completion = CompletionOutput(0, "", tokens, finish)
    return RequestOutput(
        request_id, None, [1] * prompt_len, [completion], finished=bool(finish), metrics=metrics
    )


def _samples(metrics: PrometheusMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {
        s.name + "".join(f"{{{v}}}" for k, v in s.labels.items() if k not in ("le", "model_name")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "le" not in s.labels
    }


def test_metrics_listener_counts_exactly():
    """The listener gets each step's deltas: the tokens an output carries are new."""
    metrics = PrometheusMetrics()
    steps = [
        (StepStats(1, 1, 0.1, 1, 7, 1, 0, 0.01), [_output("a", 7, [5])]),
        (StepStats(2, 0, 0.2, 2, 3, 2, 1, 0.01), [_output("a", 7, [6]), _output("b", 3, [9])]),
        (
            StepStats(1, 0, 0.1, 2, 0, 2, 0, 0.01),
            [_output("a", 7, [7], "length"), _output("b", 3, [4])],
        ),
    ]
    for stats, outputs in steps:
        metrics.on_step(stats, outputs)
    metrics.on_step(steps[-1][0], [])  # an empty step repeats the last stats: not counted twice
    samples = _samples(metrics)
    assert samples["llmserve:prompt_tokens_total"] == 7 + 3  # once per request
    assert samples["llmserve:generation_tokens_total"] == 3 + 2
    assert samples["llmserve:request_success_total{length}"] == 1
    assert samples["llmserve:num_preemptions_total"] == 1
    assert samples["llmserve:iteration_tokens_total_count"] == 3
    assert samples["llmserve:iteration_tokens_total_sum"] == 8 + 5 + 2
    assert samples["llmserve:inter_token_latency_seconds_count"] == 2 + 1
    assert samples["llmserve:time_to_first_token_seconds_count"] == 2
    assert samples["llmserve:time_to_first_token_seconds_sum"] == pytest.approx(0.6)
    assert samples["llmserve:e2e_request_latency_seconds_sum"] == pytest.approx(1.0)
    assert samples["llmserve:request_queue_time_seconds_sum"] == pytest.approx(0.1)
    assert samples["llmserve:request_prefill_time_seconds_sum"] == pytest.approx(0.2)
    assert samples["llmserve:request_decode_time_seconds_sum"] == pytest.approx(0.7)


def test_metrics_registry_is_private_and_extensible():
    first, second = PrometheusMetrics(), PrometheusMetrics()  # no duplicate-name clash: separate registries
    evictions = second.counter("kv_block_evictions", "Cached KV blocks evicted for reuse.")
    evictions.inc(3)
    assert _samples(second)["llmserve:kv_block_evictions_total"] == 3
    assert "llmserve:kv_block_evictions_total" not in _samples(first)


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
        ("qwen2-0_5b.f16.gguf", "qwen2-0_5b"),
        ("plain.gguf", "plain"),
    ],
)
def test_served_name_drops_the_quantization_tag(tmp_path, path, name):
    (tmp_path / path).write_bytes(b"")
    assert default_served_model_name(str(tmp_path / path)) == name
    assert default_served_model_name(str(tmp_path) + "/") == tmp_path.name


def test_raw_token_bytes():
    assert raw_token_bytes("ĠParis") == b" Paris"  # byte-level BPE: Ġ stands for a space
    assert raw_token_bytes("ðŁĺ") == "😀".encode()[:3]  # part of a character
    assert raw_token_bytes("<0xE2>") == b"\xe2"  # SentencePiece byte fallback
    assert raw_token_bytes("▁Paris") is None  # not a byte-level piece: fall back to the text


def test_one_event_loop_wakeup_per_step_delivers_every_stream_in_order():
    engine = AsyncLLM.__new__(AsyncLLM)  # only the delivery half; no model behind it
    loop = asyncio.new_event_loop()
    try:
        streams = {f"r{i}": asyncio.Queue() for i in range(3)}
        engine._streams = {rid: (loop, queue) for rid, queue in streams.items()}
        wakeups = []
        real_call = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: wakeups.append(args) or real_call(*args)
        outputs = [_output(rid, 2, [5]) for rid in ("r0", "r1", "r2", "gone")]
        engine._deliver_all([(o.request_id, o) for o in outputs])  # one step's outputs
        engine._deliver_all([("r1", outputs[1])])  # the next step's
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakeups) == 2
        assert [q.qsize() for q in streams.values()] == [1, 2, 1]
        assert streams["r0"].get_nowait() is outputs[0]
    finally:
        loop.close()
    engine._deliver_all([("r0", outputs[0])])  # a closed loop has no readers left: no error


@pytest.mark.parametrize("num_streams", [1, 3])
def test_closing_merged_streams_early_closes_every_engine_stream(num_streams):
    closed = []

    async def stream(index: int):
        try:
            for item in range(5):
                yield item
                await asyncio.sleep(0)
        finally:
            closed.append(index)  # in AsyncLLM.generate this is where the request is aborted

    async def first_two() -> list[tuple[int, int]]:
        merged = merge_streams([stream(i) for i in range(num_streams)])
        seen = [await anext(merged), await anext(merged)]
        await merged.aclose()
        return seen

    seen = asyncio.run(first_two())
    assert seen[0][1] == 0 and all(index < num_streams for index, _ in seen)
    assert sorted(closed) == list(range(num_streams))
