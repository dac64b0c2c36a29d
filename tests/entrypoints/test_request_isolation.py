"""Faults injected into one marked request (its output stage, its logits processor): it alone fails;
a raising forward pass fails its batch; and a hung step turns /health 'stalled'."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from llmserve import SamplingParams
from llmserve.config import EngineArgs
from llmserve.engine.async_llm import AsyncLLM, RequestFailedError
from llmserve.engine.health import HealthState, WatchdogConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.output_processor import OutputProcessor
from tests.helpers import wait_until

pytestmark = pytest.mark.process

MARK = 4242  # a prompt starting with this token id is the one the fault hits
HANG_GATE = "LLMSERVE_TEST_HANG_GATE"  # the file that ends the hang; the engine process inherits it


class _FaultyOutputProcessor(OutputProcessor):
    def _detokenize_new_tokens(self, request, state, index, entries):
        if request.prompt_token_ids[0] == MARK and request.num_output_tokens >= 2:
            raise KeyError("/internal/path/detokenizer.py: injected fault")
        return super()._detokenize_new_tokens(request, state, index, entries)


class _FaultyOutputEngine(LLMEngine):
    """Detokenizing the marked request raises once it has two tokens."""

    def __init__(self, args: EngineArgs, **kwargs) -> None:
        super().__init__(args, **kwargs)
        self.output_processor = _FaultyOutputProcessor(self.tokenizer, kwargs.get("apply_output_kinds", True))


class _FaultyForwardEngine(LLMEngine):
    """A forward pass whose batch holds the marked request raises."""

    def _execute(self, plan):
        if any(r.prompt_token_ids[0] == MARK for r in self.scheduler.running):
            raise RuntimeError("injected forward failure")
        return super()._execute(plan)


class _RaisingProcessor:
    """A logits processor (as a grammar mask is) that raises for the marked request once it has two
    output tokens; on other rows it leaves the logits alone. Every row with a logit_bias gets it."""

    def applies_to(self, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def apply(self, logits, rows, params, output_token_ids) -> None:
        for p, tokens in zip(params, output_token_ids, strict=True):
            if MARK in p.logit_bias and len(tokens) >= 2:
                raise KeyError("/internal/path/grammar.py: injected processor fault")


class _FaultyProcessorEngine(LLMEngine):
    """The raising processor joins the engine-wide ones (in the engine process: this module is imported
    there to build it)."""

    def __init__(self, args: EngineArgs, **kwargs) -> None:
        import llmserve.sample.logits_processors as processors

        processors.PROCESSORS = (*processors.PROCESSORS, _RaisingProcessor())
        super().__init__(args, **kwargs)


class _HangingEngine(LLMEngine):
    """A step with the marked request in it hangs (to a watchdog of 1 s) until the test, having seen
    the stall, creates the file HANG_GATE names."""

    def _execute(self, plan):
        if any(r.prompt_token_ids[0] == MARK for r in self.scheduler.running):
            wait_until(Path(os.environ[HANG_GATE]).exists, 60, "the test to end the hang")
        return super()._execute(plan)


@pytest.fixture(scope="module")
def engine_args(tiny_model_dir) -> EngineArgs:
    return EngineArgs(model=tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")


async def _collect(llm: AsyncLLM, prompt: list[int], params: SamplingParams, request_id: str):
    last = None
    async for output in llm.generate(prompt, params, request_id):
        last = output
    return last


def _run_both(llm: AsyncLLM, max_tokens: int = 8):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def both():
        return await asyncio.wait_for(
            asyncio.gather(
                _collect(llm, [MARK, 5, 6], params, "marked"),
                _collect(llm, [7, 8, 9], params, "other"),
                return_exceptions=True,
            ),
            timeout=120,
        )

    return asyncio.run(both())


def test_a_raising_output_stage_fails_its_request_alone(engine_args):
    llm = AsyncLLM(engine_args, engine_factory=_FaultyOutputEngine)
    try:
        marked, other = _run_both(llm)
        assert isinstance(marked, RequestFailedError)
        assert "processing this request's output" in str(marked)
        assert "internal" not in str(marked) and "KeyError" not in str(marked)
        assert other.finished and len(other.outputs[0].token_ids) == 8
        again = asyncio.run(_collect(llm, [MARK, 1], SamplingParams(max_tokens=1), "again"))
        assert again.finished  # one token: the fault does not fire; the engine serves on
        assert llm.gauges.num_running == 0 and llm.gauges.kv_cache_usage == 0
    finally:
        llm.shutdown()


def test_a_raising_logits_processor_fails_its_request_alone(engine_args):
    llm = AsyncLLM(engine_args, engine_factory=_FaultyProcessorEngine)
    try:
        greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        biased = SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={11: 100.0})
        marked_params = SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={MARK: 0.0})
        alone = [asyncio.run(_collect(llm, [7, 8, 9], greedy, "alone"))]  # the reference, alone

        async def batch():
            return await asyncio.wait_for(
                asyncio.gather(
                    _collect(llm, [MARK, 5, 6], marked_params, "marked"),
                    _collect(llm, [7, 8, 9], greedy, "plain"),
                    _collect(llm, [1, 2, 3], biased, "biased"),  # same processor, other row: not failed
                    return_exceptions=True,
                ),
                timeout=120,
            )

        marked, plain, biased_out = asyncio.run(batch())
        assert isinstance(marked, RequestFailedError), marked
        assert "applying this request's logits processors" in str(marked)
        assert "internal" not in str(marked) and "KeyError" not in str(marked)
        assert plain.outputs[0].token_ids == alone[0].outputs[0].token_ids  # its normal output
        assert biased_out.outputs[0].token_ids == [11] * 8  # its logit_bias still applied
        assert llm.gauges.num_running == 0 and llm.gauges.kv_cache_usage == 0
    finally:
        llm.shutdown()


def test_a_raising_forward_pass_fails_only_its_batch(engine_args):
    args = EngineArgs(**{**engine_args.__dict__, "max_num_seqs": 1})  # the other request waits its turn
    llm = AsyncLLM(args, engine_factory=_FaultyForwardEngine)
    try:
        marked, other = _run_both(llm)
        assert isinstance(marked, RequestFailedError) and "engine step running this request failed" in str(
            marked
        )
        assert other.finished and len(other.outputs[0].token_ids) == 8
        assert llm.gauges.kv_cache_usage == 0
    finally:
        llm.shutdown()


def test_a_hung_step_turns_health_stalled_then_ready(engine_args, tmp_path, monkeypatch):
    gate = tmp_path / "end-the-hang"
    monkeypatch.setenv(HANG_GATE, str(gate))
    watchdog = WatchdogConfig(min_seconds=1.0, factor=1.0, warmup_seconds=1.0, poll_seconds=0.1)
    args = EngineArgs(**{**engine_args.__dict__, "max_num_batched_tokens": 256})
    llm = AsyncLLM(args, engine_factory=_HangingEngine, watchdog=watchdog)
    try:
        assert llm.health.state is HealthState.READY  # warmed up before it said so
        asyncio.run(_collect(llm, [7, 8], SamplingParams(max_tokens=2), "warm-up"))
        asyncio.run(_collect(llm, list(range(10, 200)), SamplingParams(max_tokens=4), "measured"))
        assert llm.health.state is HealthState.READY
        # the limit comes from measured steps (a busy machine's are slower); the hang outlasts it
        assert llm.health.step_limit() < 30.0

        async def hang_until_stalled():
            task = asyncio.ensure_future(_collect(llm, [MARK, 1], SamplingParams(max_tokens=1), "hangs"))
            stalled = lambda: llm.health.state is HealthState.STALLED  # the watchdog thread sets it
            await asyncio.to_thread(wait_until, stalled, 60, "/health stalled")
            gate.touch()  # the step finishes: progress again
            return await task

        output = asyncio.run(asyncio.wait_for(hang_until_stalled(), timeout=120))
        assert output.finished
        assert "no engine step has finished" in llm.health.reason or llm.health.state is HealthState.READY
        assert llm.health.num_stalls == 1 and llm.health.state is HealthState.READY
        time.sleep(1.5)  # the behaviour under test: idle past the watchdog's 1 s minimum is no stall
        assert llm.health.state is HealthState.READY and llm.health.num_stalls == 1
    finally:
        llm.shutdown()
