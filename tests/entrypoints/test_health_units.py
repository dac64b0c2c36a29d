"""The health state machine, the watchdog's limit and the restart back-off, without processes."""

from __future__ import annotations

import pytest

from llmserve.engine.health import EngineHealth, HealthState, WatchdogConfig
from llmserve.engine.supervision import RestartBudget, RestartPolicy
from llmserve.metrics.stats import StepStats

MS_PER_PROMPT_TOKEN = (0.0, 0.0, 0.001, 0.0, 0.0)  # the engine's step-time model: 1 ms a prefill token


def _step(tokens: int, seconds: float, cost: tuple[float, ...] | None = None) -> StepStats:
    return StepStats(0, 0, 0.0, 1, tokens, 0, 0, seconds, step_cost=cost)


def test_the_limit_is_the_engine_models_full_budget_prefill_or_the_slowest_recent_step():
    health = EngineHealth(
        WatchdogConfig(min_seconds=1.0, factor=10.0, warmup_seconds=99.0), max_step_tokens=2048
    )
    health.set(HealthState.WARMING)
    assert health.step_limit() == 99.0  # before the first step: the warm-up limit
    health.on_step(_step(1, 5.0))  # the warm-up step (kernels build) predicts nothing
    assert health.state is HealthState.READY and health.step_limit() == 99.0
    health.on_step(_step(512, 0.512))  # no model fitted yet: the largest step's rate, scaled to 2048 tokens
    assert health.step_limit() == pytest.approx(10.0 * 0.512 * 2048 / 512)
    health.on_step(_step(1, 0.01, MS_PER_PROMPT_TOKEN))  # fitted: a 2048-token prefill takes 2.048 s
    assert health.step_limit() == pytest.approx(10.0 * 2.048)
    # 5 ms a step, and 2048 x 1024 attention pairs at 10 ms a million, count once in the largest step
    health.on_step(_step(1, 0.01, (0.005, 0.0004, 0.001, 0.0009, 0.01)))
    assert health.step_limit() == pytest.approx(10.0 * (0.005 + 2.048 + 0.01 * 2048 * 1024 / 1e6))
    health.on_step(_step(2, 3.0, MS_PER_PROMPT_TOKEN))  # a step slower than the predicted prefill rules
    assert health.step_limit() == pytest.approx(30.0)


def test_a_long_prefill_within_the_limit_is_not_a_stall_and_a_hang_is():
    health = EngineHealth(WatchdogConfig(min_seconds=1.0, factor=10.0), max_step_tokens=2048)
    health.set(HealthState.WARMING)
    health.on_step(_step(10, 0.01))  # warm-up
    health.on_step(_step(10, 0.01, MS_PER_PROMPT_TOKEN))  # a full 2048-token prefill ~2 s: the limit 20.5 s
    start = health._last_progress
    assert not health.check(busy=True, now=start + 15.0)
    assert health.state is HealthState.READY
    assert not health.check(busy=False, now=start + 100.0)  # idle resets the clock
    assert health.check(busy=True, now=start + 121.0)
    assert health.state is HealthState.STALLED and "limit 20.5 s" in health.reason
    assert not health.check(busy=True, now=start + 200.0)  # counted once per stall
    assert health.num_stalls == 1
    health.on_step(_step(1, 0.001))
    assert health.state is HealthState.READY


def test_the_warm_up_ends_warming_and_its_steps_are_the_first_speeds():
    health = EngineHealth(
        WatchdogConfig(min_seconds=1.0, factor=10.0, warmup_seconds=99.0), max_step_tokens=2048
    )
    health.set(HealthState.WARMING)
    assert not health.check(busy=True, now=health._last_progress + 98.0)  # warming: the warm-up limit
    health.on_warmed_up([_step(512, 0.512), _step(1, 0.01, MS_PER_PROMPT_TOKEN)])
    assert health.state is HealthState.READY
    assert health.step_limit() == pytest.approx(10.0 * 2.048)  # the engine's model after its warm-up
    health.set(HealthState.WARMING)  # a restarted engine: the previous one's model predicts nothing
    health.on_warmed_up([_step(10, 0.02)])
    assert health.step_limit() == pytest.approx(10.0 * 0.02 / 10 * 2048)  # its step's rate at 2048 tokens


def test_only_ready_answers_200():
    from types import SimpleNamespace

    from llmserve.entrypoints.openai.health import health_of

    health = EngineHealth()
    engine = SimpleNamespace(health=health, failure=None, is_running=True)
    assert health_of(engine)[1] == 503 and health_of(engine)[0].state == "starting"
    health.set(HealthState.WARMING, "the engine is warming up")
    body, status = health_of(engine)
    assert (status, body.status, body.reason) == (503, "warming", "the engine is warming up")
    assert body.error.type == "server_error"
    health.on_warmed_up([])
    assert health_of(engine)[0].model_dump(exclude_none=True) == {"status": "healthy", "state": "ready"}
    engine.is_running = False
    assert health_of(engine)[0].state == "stopping"


def test_stopping_is_final():
    health = EngineHealth()
    health.set(HealthState.STOPPING, "bye")
    health.set(HealthState.READY)
    assert health.state is HealthState.STOPPING and not health.state.serving


def test_restarts_back_off_exponentially_and_are_bounded_within_the_window():
    budget = RestartBudget(
        RestartPolicy(max_restarts=3, backoff_seconds=1.0, max_backoff_seconds=3.0, window_seconds=100)
    )
    assert [budget.next_delay(now=t) for t in (0.0, 1.0, 2.0)] == [1.0, 2.0, 3.0]  # 4.0 capped at 3.0
    assert budget.next_delay(now=3.0) is None
    assert budget.next_delay(now=150.0) == 1.0  # the old restarts left the window
