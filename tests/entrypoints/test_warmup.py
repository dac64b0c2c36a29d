"""Warm-up before ready (engine/warmup.py): it runs the paths the first requests would pay for, leaves
no trace a client could see, and /health says `warming` (503) until it is done."""

from __future__ import annotations

import multiprocessing

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineArgs
from llmserve.core.step_cost import StepCostModel, StepShape
from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.engine_core import run_engine_core
from llmserve.engine.health import EngineHealth, HealthState
from llmserve.engine.messages import EngineReady, EngineWarming, Shutdown
from llmserve.engine.warmup import warm_up, warmup_requests

PROMPTS = [[5, 6, 7, 8] * 6, list(range(1000, 1040)), [42, 43, 44]]


def _llm(model_dir: str, **kwargs) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB", **kwargs)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7),
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),  # the engine's seed
    ]


def _token_ids(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_warm_up_runs_a_prefill_decodes_a_cache_hit_and_drafts_then_forgets_them(tiny_model_dir):
    # early exit drafts whatever the model says (prompt lookup needs a model that repeats the pattern)
    engine = _llm(tiny_model_dir, speculative_method="early_exit").engine
    steps = []
    step = engine.step

    def recorded():
        outputs = step()
        steps.append(engine.last_step)
        return outputs

    engine.step = recorded
    assert engine.grammar_gate.compiler._compiler is None  # built on the first structured request
    warm_up(engine, prompt_len=100)
    assert engine.grammar_gate.compiler._compiler is not None  # structured outputs' vocabulary table
    prompt_len = len(warmup_requests(engine, 100)[0][0][1])
    assert prompt_len == 100
    assert any(s.num_prompt_tokens == prompt_len for s in steps)  # the prefill
    assert any(s.num_prefix_cache_hits > 0 for s in steps)  # B found A's blocks
    assert any(s.num_batched_seqs == 2 and s.num_prompt_tokens == 0 for s in steps)  # two decodes
    assert any(s.num_draft_tokens > 0 for s in steps)  # drafts verified
    assert any(s.num_batched_seqs == 16 and s.num_prompt_tokens == 0 for s in steps)  # a wide decode
    # forgotten: nothing running, nothing cached, no counts
    kv = engine.kv_cache_manager
    assert not engine.has_unfinished_requests()
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.num_blocks and kv.pool.num_cached_blocks == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    assert engine.spec_decode_stats.num_draft_tokens == 0 and engine.last_step is None
    engine.add_tokenized_request("again", warmup_requests(engine, 100)[0][0][1], SamplingParams(max_tokens=1))
    engine.step()
    assert engine.last_step.num_prefix_cache_hits == 0  # warm-up's prompt is not cached
    assert engine.last_step.num_prefix_cache_queries == prompt_len


@pytest.mark.parametrize("spec", [{}, {"speculative_method": "ngram"}])
def test_outputs_after_warm_up_are_a_fresh_engines(tiny_model_dir, spec):
    """Greedy, seeded and seedless sampled requests give the same tokens with and without warm-up."""
    expected = _token_ids(_llm(tiny_model_dir, **spec))
    warmed = _llm(tiny_model_dir, **spec)
    warm_up(warmed.engine)
    assert _token_ids(warmed) == expected


def test_a_failing_warm_up_leaves_a_serving_engine(tiny_model_dir, monkeypatch, caplog):
    llm = _llm(tiny_model_dir)
    expected = _token_ids(_llm(tiny_model_dir))
    calls = [0]
    step = llm.engine.step

    def failing():
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("boom")
        return step()

    monkeypatch.setattr(llm.engine, "step", failing)
    warm_up(llm.engine)
    monkeypatch.setattr(llm.engine, "step", step)
    assert "engine warm-up failed" in caplog.text
    assert not llm.engine.has_unfinished_requests()
    assert _token_ids(llm) == expected


def test_a_warm_up_whose_clean_up_raises_still_restores_the_engine(tiny_model_dir, monkeypatch):
    """Even when aborting the failed warm-up's requests raises, the engine leaves warm-up mode:
    KV events are published to a router again and nothing of the warm-up stays cached."""
    engine = _llm(tiny_model_dir).engine
    step, abort = engine.step, engine.abort_request

    def failing_step():
        if engine.has_unfinished_requests() and engine.last_step is not None:
            raise RuntimeError("boom")
        return step()

    def failing_abort(request_id):
        abort(request_id)
        raise RuntimeError("abort failed")

    monkeypatch.setattr(engine, "step", failing_step)
    monkeypatch.setattr(engine, "abort_request", failing_abort)
    with pytest.raises(RuntimeError, match="abort failed"):
        warm_up(engine)
    assert engine._publish_kv_events and engine.last_step is None
    assert engine.kv_cache_manager.pool.num_cached_blocks == 0


def test_the_cost_model_learns_the_measured_steps_and_not_the_kernel_building_ones(tiny_model_dir):
    """The first wave's steps build kernels: they are left out of the scheduler's step-cost model; the
    steps warm_up returns as measured are exactly what it learned."""
    engine = _llm(tiny_model_dir).engine
    measured = warm_up(engine)
    expected = StepCostModel()
    for stats in measured:
        if stats.num_batched_seqs:
            expected.observe(StepShape(*stats.step_shape), stats.step_seconds)
    assert expected.fitted and engine.scheduler.cost_model.coefficients == expected.coefficients


@pytest.mark.process
@pytest.mark.parametrize("warmup", [True, False])
def test_the_engine_process_says_warming_before_ready_unless_told_not_to(tiny_model_dir, warmup):
    args = EngineArgs(model=tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    context = multiprocessing.get_context("spawn")
    engine_commands, commands = context.Pipe(duplex=False)
    outputs, engine_outputs = context.Pipe(duplex=False)
    process = context.Process(
        target=run_engine_core,
        args=(args, engine_commands, engine_outputs),
        kwargs={"warmup": warmup},
    )
    process.start()
    try:
        first = outputs.recv()
        if warmup:
            assert isinstance(first, EngineWarming)
            first = outputs.recv()
        assert isinstance(first, EngineReady)
        assert first.memory.weights_memory_bytes > 0  # the loaded model's, measured in the engine process
        assert first.batch_invariance[0] == "--deterministic is off"  # why not (worker/batch_invariance.py)
        commands.send([Shutdown()])
        process.join(60)
        assert process.exitcode == 0
    finally:
        process.kill()
        process.join()


@pytest.mark.process
def test_health_is_warming_and_503_until_the_warm_up_ends(tiny_model_dir, monkeypatch):
    assert not HealthState.WARMING.serving and HealthState.READY.serving
    states = []
    set_state = EngineHealth.set

    def recorded(self, state, reason=""):
        states.append(state)
        set_state(self, state, reason)

    monkeypatch.setattr(EngineHealth, "set", recorded)
    args = EngineArgs(model=tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    llm = AsyncLLM(args)
    try:
        assert states == [HealthState.WARMING, HealthState.READY]
    finally:
        llm.shutdown()


@pytest.mark.full
@pytest.mark.slow
def test_the_default_model_follows_the_repeating_prompt_so_prompt_lookup_drafts_in_warm_up():
    llm = LLM(speculative_method="ngram", max_model_len=1024)
    steps = []
    step = llm.engine.step

    def recorded():
        outputs = step()
        steps.append(llm.engine.last_step)
        return outputs

    llm.engine.step = recorded
    warm_up(llm.engine)
    assert sum(s.num_accepted_tokens for s in steps) > 0


@pytest.mark.full
@pytest.mark.slow
def test_a_draft_head_drafts_with_its_network_in_warm_up():
    """B's prompt does not repeat, so the head itself (its compiled chain, built on first use) runs."""
    llm = LLM(speculative_method="draft_head", max_model_len=1024)
    warm_up(llm.engine)
    assert "compiled_chain" in vars(llm.engine.proposer)


def test_the_warm_up_maps_the_whole_kv_pool_before_its_first_step(tiny_model_dir, monkeypatch):
    """Mapping only the first blocks before ready left the first requests 20-35% slower."""
    engine = LLM(tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="256MiB").engine
    runner, events = engine.model_runner, []
    wait, step = runner.wait_for_kv_prefault, engine.step
    monkeypatch.setattr(runner, "wait_for_kv_prefault", lambda: (events.append("prefault"), wait())[1])
    monkeypatch.setattr(engine, "step", lambda: (events.append("step"), step())[1])
    warm_up(engine, prompt_len=100)
    assert events[0] == "prefault" and "step" in events
    assert runner.kv_prefault.chunks.take() is None and not runner.kv_prefault.chunks.failed


def test_a_server_engine_prepares_structured_outputs_beside_the_model_loading(tiny_model_dir):
    from llmserve.engine.llm_engine import LLMEngine

    args = EngineArgs(model=tiny_model_dir, dtype="float32", max_model_len=256, kv_cache_memory="16MiB")
    assert LLMEngine(args).structured_outputs_ready is None  # offline: on the first structured request
    engine = LLMEngine(args, prepare_structured_outputs=True)
    engine.structured_outputs_ready.result(timeout=60)
    assert engine.grammar_gate.compiler._compiler is not None


def test_the_kv_pool_is_allocated_and_prefaulting_before_the_weights_load(tiny_model_dir, monkeypatch):
    import llmserve.engine.llm_engine as llm_engine
    from llmserve.worker import model_runner

    early = []
    allocate = model_runner.allocate_kv_pool_early

    def recorded(config):
        early.append(allocate(config))
        return early[-1]

    monkeypatch.setattr(llm_engine, "allocate_kv_pool_early", recorded)
    runner = _llm(tiny_model_dir).engine.model_runner
    [pool] = early
    assert runner.kv_cache is pool.tensor and runner.kv_prefault is pool.prefault
    runner.wait_for_kv_prefault()
    assert not pool.prefault.chunks.failed and pool.prefault.chunks.take() is None


def test_an_early_pool_of_another_shape_is_not_taken_and_its_prefault_stops(tiny_model_dir):
    import torch

    from llmserve.worker.model_runner import EarlyKVPool, ModelRunner
    from llmserve.worker.prefault import populate_in_background

    engine = _llm(tiny_model_dir).engine
    wrong = torch.empty(1 << 20, dtype=torch.uint8)
    early = EarlyKVPool(wrong, populate_in_background(wrong))
    runner = ModelRunner(engine.config, engine.model_runner.model, early)
    assert runner.kv_cache is not wrong and runner.kv_cache.shape == engine.model_runner.kv_cache.shape
    assert runner.kv_prefault is not early.prefault and early.prefault.chunks.take() is None
