"""The queue-wait predictor and the admission policy over it, with exact numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmserve.core.wait_predictor import WaitPredictor
from llmserve.entrypoints.openai.admission import Admission, AdmissionConfig, Refused
from llmserve.metrics.stats import StepStats
from llmserve.outputs import RequestOutput


def _step(prompt: int, generated: int, seconds: float) -> StepStats:
    return StepStats(0, 0, 0.0, 1, prompt, generated, 0, seconds)


def _finished(count: int) -> list[RequestOutput]:
    return [RequestOutput(f"r{i}", None, [1], finished=True) for i in range(count)]


def test_the_prediction_is_tokens_ahead_over_the_measured_rate_plus_slots_over_the_finish_rate():
    predictor = WaitPredictor()
    assert predictor.predict(10_000, 5) == 0.0  # nothing measured: admit
    predictor.on_step(_step(900, 100, 0.5), _finished(1))
    predictor.on_step(_step(0, 100, 0.5), _finished(3))
    predictor.on_step(None, _finished(7))  # an abort's output is not a step
    assert predictor.seconds_per_token == pytest.approx(1.0 / 1100)
    assert predictor.seconds_per_finished_request == pytest.approx(0.25)
    assert predictor.predict(2200) == pytest.approx(2.0)
    assert predictor.predict(2200, requests_over_slots=4) == pytest.approx(3.0)
    assert predictor.predict(2200, requests_over_slots=-3) == pytest.approx(2.0)  # free slots: no wait


def test_the_warm_up_steps_are_the_prior_and_give_no_finish_rate():
    predictor = WaitPredictor()
    predictor.prime([_step(27, 1, 0.028), _step(0, 1, 0.004), _step(0, 1, 0.004), _step(0, 1, 0.004)])
    assert predictor.seconds_per_token == pytest.approx(0.04 / 31)
    assert predictor.seconds_per_step == pytest.approx(0.01)
    assert predictor.seconds_per_finished_request is None  # its requests' ends are not a workload's
    assert predictor.predict(3100) == pytest.approx(2 * 4.0)  # the cold start's margin
    predictor.on_step(_step(0, 2, 0.01), _finished(2))  # the first real finishes give the rate
    assert predictor.seconds_per_finished_request == pytest.approx(0.025)
    assert predictor.margin == 2.0
    for _ in range(40):  # a served finish (above) and 32 served steps: the margin goes
        predictor.on_step(_step(0, 2, 0.01), [])
        predictor.on_step(None, _finished(1))  # an abort's output is neither a step nor a finish
    assert predictor.margin == 1.0
    assert predictor.predict(3100) == pytest.approx(3100 * predictor.seconds_per_token)
    predictor.prime([_step(27, 1, 0.028)])  # a restarted engine's warm-up: cold again
    for _ in range(40):
        predictor.on_step(_step(0, 2, 0.01), [])
    assert predictor.margin == 2.0  # no served finish since
    predictor.on_step(_step(0, 2, 0.01), _finished(1))
    assert predictor.margin == 1.0
    predictor.prime([_step(27, 1, 0.028)])
    predictor.on_step(_step(0, 2, 0.01), _finished(1))
    assert predictor.margin == 2.0  # a finish, but only one served step since the warm-up


def test_without_a_warm_up_the_served_steps_need_no_margin():
    predictor = WaitPredictor()
    predictor.on_step(_step(0, 2, 0.01), [])
    assert predictor.margin == 1.0 and predictor.service(0, 10) == pytest.approx(0.1)


def test_a_cold_start_burst_is_refused_from_the_warm_up_prior():
    engine = _Engine(queued=0, max_num_seqs=2)
    admission = Admission(engine, AdmissionConfig())
    admission.check([10], timeout=0.5, in_flight=5, max_tokens=100)  # nothing measured: admitted
    warm_up = [_step(10, 0, 0.01)] + [_step(0, 1, 0.01)] * 4  # 10 ms a step
    engine.warmup_listeners[0](warm_up)
    # its service: 10 prompt tokens (10 x 1/14 x 50 ms) and 100 steps of 10 ms = 1.036 s, twice over
    # (the cold start's margin): 2.071 s
    admission.check([10], timeout=2.1, in_flight=1, max_tokens=100)  # a free slot: no wait
    with pytest.raises(Refused, match=r"predicted time of 2.1 s \(queue wait 0.0 s\)"):
        admission.check([10], timeout=2.0, in_flight=1, max_tokens=100)
    # 5 in flight on 2 slots, nothing finished yet: they started together; the 6th waits for 2 rounds
    assert admission.predicted_wait(in_flight=5, service=1.0) == pytest.approx(2.0)
    with pytest.raises(Refused, match=r"predicted time of 6.2 s \(queue wait 4.1 s\)") as refused:
        admission.check([10], timeout=4.5, in_flight=5, max_tokens=100)
    assert refused.value.retry_after == 2  # ceil(6.21 - 4.5)
    tight = Admission(engine, AdmissionConfig(max_queue_delay=1.0))
    engine.warmup_listeners[1](warm_up)
    with pytest.raises(Refused, match="--max-queue-delay of 1 s") as refused:
        tight.check([10], None, in_flight=5, max_tokens=100)
    assert refused.value.retry_after == 4  # ceil(4.14 - 1)


def test_only_the_recent_steps_count():
    predictor = WaitPredictor(recent_steps=2)
    predictor.on_step(_step(1000, 0, 100.0), [])  # slow, then forgotten
    predictor.on_step(_step(100, 0, 1.0), [])
    predictor.on_step(_step(100, 0, 1.0), [])
    assert predictor.seconds_per_token == pytest.approx(0.01)


class _Engine(SimpleNamespace):
    """What Admission reads of AsyncLLM."""

    def __init__(self, queued: int, max_num_seqs: int = 4) -> None:
        super().__init__(
            step_listeners=[],
            warmup_listeners=[],
            add_warmup_listener=lambda listener: self.warmup_listeners.append(listener),
            queued_prompt_tokens=queued,
            config=SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs)),
        )


def test_admission_refuses_past_the_deadline_with_the_time_until_it_would_fit():
    engine = _Engine(queued=1000)
    admission = Admission(engine, AdmissionConfig(max_queue_delay=30.0))
    engine.step_listeners[0](_step(100, 0, 1.0), _finished(1))  # 10 ms per token, 1 s per finish
    # 6 in flight, 4 slots: the 7th waits for 3 to finish
    assert admission.predicted_wait(in_flight=6) == pytest.approx(1000 * 0.01 + 3 * 1.0)  # 13 s
    admission.check([50], timeout=None, in_flight=6)  # under --max-queue-delay
    # with its own service: 50 prompt tokens (0.5 s) and 10 steps of 1 s: 23.5 s in all
    admission.check([50], timeout=24.0, in_flight=6, max_tokens=10)
    with pytest.raises(Refused, match=r"predicted time of 23.5 s \(queue wait 13.0 s\)") as refused:
        admission.check([50], timeout=20.0, in_flight=6, max_tokens=10)
    assert refused.value.retry_after == 4  # ceil(23.5 - 20)
    with pytest.raises(Refused) as refused:  # its service alone exceeds it: retry once the queue is gone
        admission.check([50], timeout=5.0, in_flight=6, max_tokens=10)
    assert refused.value.retry_after == 13
    tight = Admission(engine, AdmissionConfig(max_queue_delay=2.5))
    tight.predictor.on_step(_step(100, 0, 1.0), _finished(1))
    with pytest.raises(Refused, match="--max-queue-delay of 2.5 s") as refused:
        tight.check([50], timeout=None, in_flight=6)
    assert refused.value.retry_after == 11


def test_admission_bounds_the_queued_prompt_tokens():
    engine = _Engine(queued=900)
    admission = Admission(engine, AdmissionConfig(max_waiting_tokens=1000))
    admission.check([100], timeout=None)
    with pytest.raises(Refused, match="holds 900 prompt tokens and admits at most 1000") as refused:
        admission.check([60, 50], timeout=None)
    assert refused.value.retry_after == 1  # nothing measured yet: the minimum


def _costed(rows: int, prefill: int, seconds: float) -> StepStats:
    """A step whose stats carry the engine's step-time model: 10 ms + 2 ms a decode row + 0.1 ms a
    prompt token."""
    return StepStats(0, 0, 0.0, rows, prefill, rows, 0, seconds, step_cost=(0.010, 0.002, 0.0001, 0.0, 0.0))


def test_a_burst_is_served_at_the_batch_it_makes_not_at_the_recent_pace():
    predictor = WaitPredictor()
    predictor.prime([_step(64, 1, 0.05)])  # the engine's model not fitted yet: the recent pace
    assert predictor.step_cost is None
    # twice over while the prediction rests on the warm-up (the cold start's margin)
    assert predictor.service(10, 100) == pytest.approx(2 * (10 * 0.05 / 65 + 100 * 0.05))
    predictor.prime([_costed(rows, 0, 0.010 + 0.002 * rows) for rows in (1, 2, 16)])
    assert predictor.step_cost == (0.010, 0.002, 0.0001, 0.0, 0.0)  # read from the engine, not fitted here
    alone = predictor.service(10, 100)  # 100 steps of one row (12 ms) after a 1 ms prefill
    assert alone == pytest.approx(2 * (0.001 + 100 * 0.012))
    assert predictor.service(10, 100, rows=16) == pytest.approx(2 * (0.001 + 100 * 0.042))
    predictor.on_step(_step(0, 1, 0.5), [])  # a step without the model (a pipeline's): the last one holds
    assert predictor.service(10, 100) == pytest.approx(alone)
    engine = _Engine(queued=0, max_num_seqs=16)
    admission = Admission(engine, AdmissionConfig())
    engine.warmup_listeners[0]([_costed(rows, 0, 0.010 + 0.002 * rows) for rows in (1, 2, 16)])
    admission.check([10], timeout=2.5, in_flight=0, max_tokens=100)  # alone: 1.2 s (2.4 cold)
    with pytest.raises(Refused):  # the 16th of a burst: 100 steps of 16 rows, 4.2 s (8.4 cold)
        admission.check([10], timeout=2.5, in_flight=15, max_tokens=100)
