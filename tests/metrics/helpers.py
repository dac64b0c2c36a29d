"""A metrics registry fed as a server's would be, without an engine: a fake engine client whose
listeners get hand-made steps."""

from __future__ import annotations

from llmserve.metrics.prometheus import PrometheusMetrics
from llmserve.metrics.stats import EngineGauges, StepStats
from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecDecodeStats
from llmserve.sampling_params import SamplingParams


class FakeEngineClient:
    def __init__(self) -> None:
        self.gauges = EngineGauges(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_swapped=1)
        self.step_listeners: list = []
        self.request_listeners: list = []

    def has_request(self, request_id: str) -> bool:
        return True


def output(request_id: str, prompt_len: int, samples: dict[int, list[int]], finish: str | None = None):
    """A delta of request `request_id`: new tokens per sample index; `finish` ends every sample."""
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.3)
    if finish:
        metrics.finished_time = 1.3
    completions = [CompletionOutput(i, "", tokens, finish) for i, tokens in samples.items()]
    return RequestOutput(
        request_id, None, [1] * prompt_len, completions, finished=bool(finish), metrics=metrics
    )


def fed_metrics(model_name: str = "tiny", metric_names: str = "both") -> PrometheusMetrics:
    """Two requests: `a` (n=2, 5 prompt tokens, samples of 3 and 1 tokens) and `b` (n=1, 2 prompt
    tokens, 2 tokens, under LoRA adapter `sql`); one swap and one recompute preemption, 4 swapped-out
    and 4 swapped-in blocks; 2 requests verifying drafts, accepting 2 and 0."""
    engine = FakeEngineClient()
    metrics = PrometheusMetrics(model_name=model_name, metric_names=metric_names)
    metrics.attach(engine)
    for listener in engine.request_listeners:
        listener("a", [1] * 5, SamplingParams(n=2, max_tokens=3))
        listener("b", [1] * 2, SamplingParams(max_tokens=8, lora_name="sql"))
    steps = [
        (
            StepStats(2, 0, 0.5, 2, 7, 3, 0, 0.01),
            [output("a", 5, {0: [5], 1: [6]}), output("b", 2, {0: [4]})],
        ),
        (
            StepStats(
                1,
                1,
                0.4,
                2,
                0,
                3,
                2,
                0.01,
                num_draft_tokens=5,
                num_accepted_tokens=2,
                num_drafts=2,
                num_preemptions_swap=1,
                num_swapped_out_blocks=4,
                accepted_per_position=(1, 1),
            ),
            [output("a", 5, {0: [7, 8]}), output("b", 2, {0: [9]}, "stop")],
        ),
        (
            StepStats(0, 0, 0.0, 1, 0, 0, 0, 0.01, num_swapped_in_blocks=4),
            [output("a", 5, {0: [], 1: []}, "length")],
        ),
    ]
    for stats, outputs in steps:
        for listener in engine.step_listeners:
            listener(stats, outputs)
    engine.gauges = EngineGauges(
        num_running=2,
        num_waiting=1,
        kv_cache_usage=0.25,
        num_swapped=1,
        swap_space_usage=0.5,
        spec_decode=SpecDecodeStats(2, 5, 2),
        lora_requests=(("sql", 1, 0), ("chat", 0, 2), ("idle", 0, 0)),  # as under --enable-lora
        max_loras=4,
    )
    return metrics
