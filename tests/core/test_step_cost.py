"""The step-time cost model: its online fit recovers known coefficients, and its inverse sizes chunks."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from llmserve.core.step_cost import StepCostModel, StepShape, chunk_pairs

# c0 s per step, c1 s per decode token, c2 s per prefill token, c3 s per 1k decode-context tokens,
# c4 s per 1M prefill attention pairs
TRUE = (0.008, 0.0004, 0.00015, 0.0009, 0.02)


def truth(shape: StepShape, coefficients=TRUE) -> float:
    c0, c1, c2, c3, c4 = coefficients
    return (
        c0
        + c1 * shape.decode_tokens
        + c2 * shape.prefill_tokens
        + c3 * shape.decode_context / 1e3
        + c4 * shape.prefill_pairs / 1e6
    )


def random_shapes(rng: np.random.Generator, count: int, prefill: bool = True) -> list[StepShape]:
    shapes = []
    for _ in range(count):
        rows = int(rng.integers(1, 64))
        context = int(rows * rng.integers(50, 1500))
        chunk, start = (int(rng.integers(0, 2048)), int(rng.integers(0, 2000))) if prefill else (0, 0)
        shapes.append(StepShape(rows, chunk, context, chunk_pairs(chunk, start)))
    return shapes


def test_the_fit_recovers_known_coefficients_from_noisy_step_times():
    rng = np.random.default_rng(0)
    model = StepCostModel(recent_steps=256)
    assert not model.fitted and model.predict(StepShape(1, 0, 10, 0)) is None
    for shape in random_shapes(rng, 400):
        model.observe(shape, truth(shape) * rng.normal(1.0, 0.01))  # 1% timing noise
    model.refit()
    assert model.coefficients == pytest.approx(TRUE, rel=0.05)
    shape = StepShape(32, 512, 32 * 700, chunk_pairs(512, 300))
    assert model.predict(shape) == pytest.approx(truth(shape), rel=0.01)


def test_steps_folded_in_batches_give_the_sums_of_one_step_at_a_time():
    rng = np.random.default_rng(1)
    model = StepCostModel(recent_steps=64)
    decay, gram, moment = 1 - 1 / 64, np.zeros((5, 5)), np.zeros(5)
    for count, shape in enumerate(random_shapes(rng, 45), start=1):
        seconds = truth(shape)
        model.observe(shape, seconds)
        x = np.array(
            [
                1.0,
                shape.decode_tokens,
                shape.prefill_tokens,
                shape.decode_context / 1e3,
                shape.prefill_pairs / 1e6,
            ]
        )
        gram, moment = gram * decay + np.outer(x, x), moment * decay + seconds * x
        assert len(model._pending) < 8 or count < model._min_steps
    model.refit()  # folds the 5 steps since the last refit
    np.testing.assert_allclose(model._gram, gram, rtol=1e-12)
    np.testing.assert_allclose(model._moment, moment, rtol=1e-12)


def test_a_fixed_model_keeps_no_growing_backlog_of_steps():
    model = StepCostModel.fixed(TRUE)
    for shape in random_shapes(np.random.default_rng(2), 100):
        model.observe(shape, truth(shape))
    assert len(model._pending) < 8 and model.coefficients == TRUE


def test_the_fit_follows_a_change_in_speed_within_its_recent_steps():
    rng = np.random.default_rng(1)
    model = StepCostModel(recent_steps=64)
    for shape in random_shapes(rng, 300):
        model.observe(shape, truth(shape))
    slower = tuple(2 * c for c in TRUE)  # the machine got busy: every step twice as slow
    for shape in random_shapes(rng, 600):
        model.observe(shape, truth(shape, slower))
    model.refit()
    assert model.coefficients == pytest.approx(slower, rel=0.02)


def test_a_direction_never_seen_stays_zero_and_no_coefficient_is_negative():
    rng = np.random.default_rng(2)
    model = StepCostModel()
    for shape in random_shapes(rng, 100, prefill=False):  # decodes only: prefill never measured
        model.observe(shape, truth(shape) * rng.normal(1.0, 0.05))
    c0, c1, c2, c3, c4 = model.coefficients
    assert c2 == 0.0 and c4 == 0.0
    assert min(model.coefficients) >= 0.0
    assert model.max_chunk(0.01, 0) is None  # prefill not measured: no bound on a chunk


def test_steps_whose_time_falls_with_a_feature_give_it_no_negative_cost():
    model = StepCostModel(min_steps=1)
    for rows in range(1, 40):  # a step's time that falls as decode rows grow (noise, other load)
        model.observe(StepShape(rows, 0, 100 * rows, 0), 0.05 - 0.0005 * rows)
    assert min(model.coefficients) >= 0.0


def test_the_fit_is_the_best_non_negative_one():
    """A warm-up's steps (ms): prefills, greedy decodes of two rows, sampled decodes of one row that
    cost more. Least squares wants a negative cost per decode row; dropping every negative
    coefficient at once then kept a fit that put one row's step at a third of what was measured."""
    steps = [((0, 64, 0, 2816), 5.06), ((0, 48, 0, 1152), 6.43)]
    steps += [((2, 0, 162 + 2 * i, 0), t) for i, t in enumerate((1.68, 1.48, 1.27, 1.10, 1.17))]
    steps += [((1, 0, 49 + i, 0), t) for i, t in enumerate((2.75, 2.71, 2.58, 2.65, 2.50))]
    model = StepCostModel(recent_steps=10**9)  # no forgetting: the plain least squares
    for shape, ms in steps:
        model.observe(StepShape(*shape), ms / 1e3)
    model.refit()
    x = np.array([[1.0, s[0], s[1], s[2] / 1e3, s[3] / 1e6] for s, _ in steps])
    y = np.array([ms / 1e3 for _, ms in steps])

    def error(w: np.ndarray) -> float:
        return float(np.sum((x @ w - y) ** 2))

    best = math.inf  # every support's unconstrained solution that is non-negative
    for size in range(1, 6):
        for support in itertools.combinations(range(5), size):
            w = np.zeros(5)
            w[list(support)] = np.linalg.lstsq(x[:, support], y, rcond=None)[0]
            if (w >= 0).all():
                best = min(best, error(w))
    fitted = np.array(model.coefficients)
    assert (fitted >= 0).all() and error(fitted) == pytest.approx(best, rel=1e-4)
    assert model.predict(StepShape(1, 0, 54, 0)) > 0.0015  # one row: nearer its 2.5-2.75 ms


@pytest.mark.parametrize("computed", [0, 700, 5000])
def test_max_chunk_is_the_largest_chunk_within_the_seconds(computed):
    model = StepCostModel.fixed(TRUE)
    for seconds in (0.0, 0.001, 0.0234, 0.5):
        chunk = model.max_chunk(seconds, computed)
        assert model.chunk_seconds(chunk, computed) <= seconds + 1e-12
        assert model.chunk_seconds(chunk + 1, computed) > seconds
    assert StepCostModel.fixed((0.01, 0.001, 0.0, 0.0, 0.0)).max_chunk(1.0, 0) is None  # prefill free


def test_the_admission_predictor_reads_the_engines_fitted_model_from_the_step_stats():
    from llmserve.core.wait_predictor import WaitPredictor
    from llmserve.metrics.stats import StepStats

    rng = np.random.default_rng(3)
    engine_model, predictor = StepCostModel(), WaitPredictor()
    before = StepStats(0, 0, 0.0, 1, 100, 0, 0, 0.1)  # no model yet: the per-token rate, 1 ms a token
    predictor.on_step(before, [])
    assert predictor.service(500, 0) == pytest.approx(0.5)
    for shape in random_shapes(rng, 300):  # the engine fits its model; each step's stats carry it
        engine_model.observe(shape, truth(shape))
        stats = StepStats(0, 0, 0.0, 1, shape.prefill_tokens, shape.decode_tokens, 0, truth(shape))
        predictor.on_step(StepStats(**{**stats.__dict__, "step_cost": engine_model.coefficients}), [])
    assert predictor.step_cost == engine_model.coefficients == pytest.approx(TRUE, rel=0.01)
    # its prompt's prefill is now the model's: 500 tokens x 0.15 ms + 125,000 pairs x 20 ms per million
    prefill = 500 * TRUE[2] + chunk_pairs(500, 0) / 1e6 * TRUE[4]
    assert predictor.service(500, 0) == pytest.approx(prefill, rel=0.01)
