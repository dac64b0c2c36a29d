"""The step-time cost model: how long an engine step takes, predicted from the batch's shape.

    seconds = c0 + c1 x decode tokens + c2 x prefill tokens
                 + c3 x decode context (kilotokens) + c4 x prefill attention (megatoken pairs)

A decode row catches up from its generated tokens (1, or 1 + k drafts); every other scheduled token is a
prefill token (a prompt chunk, or the recompute of a preempted request). The decode context is the KV the
decode rows attend over (the sum of their lengths); a prefill chunk of n tokens after c cached ones attends
over n x (c + n / 2) pairs. c0 is what every step pays (weight reads, launch and Python overhead).

The coefficients are fitted online by least squares over the recent steps (exponentially forgotten,
about `recent_steps` of them), from the shapes the scheduler planned and the step times the engine
measured: no step is added, nothing is synchronized. A small ridge keeps a direction the recent steps
never varied (no prefill yet, say) at zero rather than at noise, and a coefficient the fit drives below
zero is held at zero: the fit is the best one whose coefficients are all non-negative (a step never
gets cheaper by adding work). Until `min_steps` steps were
seen the model is not fitted and predicts nothing (callers then apply no latency cap).

This is the one step-time model. The engine's scheduler (core/scheduler.py) owns the one fitted
instance and plans each step with it; the fitted coefficients are a `StepCost` value that each step's
stats carry to the server (metrics/stats.py StepStats.step_cost), where admission
(core/wait_predictor.py) and the watchdog (engine/health.py) read them: nothing else fits step times.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

_NUM_FEATURES = 5
_CONTEXT_UNIT = 1e3  # decode context in kilotokens, so all features are of similar size
_PAIRS_UNIT = 1e6  # prefill attention in megapairs
_RIDGE = 1e-6
_TINY = 1e-12
_REFIT_EVERY = 8  # steps between least-squares solves (observing is a few vector operations)


class StepShape(NamedTuple):
    """What one step computes (see the module docstring)."""

    decode_tokens: int = 0
    prefill_tokens: int = 0
    decode_context: int = 0  # KV tokens the decode rows attend over
    prefill_pairs: int = 0  # sum over prefill chunks of n x (c + n / 2)


def chunk_pairs(num_new: int, num_computed: int) -> int:
    """Attention (query, key) pairs of a prefill chunk of `num_new` tokens after `num_computed`."""
    return num_new * num_computed + num_new * num_new // 2


def _features(shape: StepShape) -> tuple[float, ...]:
    return (
        1.0,
        shape.decode_tokens,
        shape.prefill_tokens,
        shape.decode_context / _CONTEXT_UNIT,
        shape.prefill_pairs / _PAIRS_UNIT,
    )


class StepCost(NamedTuple):
    """Fitted coefficients (see the module docstring) and what they predict; a tuple, so it pickles as one."""

    c0: float  # seconds every step pays
    c1: float  # per decode token
    c2: float  # per prefill token
    c3: float  # per kilotoken of decode context
    c4: float  # per megapair of prefill attention

    def predict(self, shape: StepShape) -> float:
        """Seconds the step would take."""
        c0, c1, c2, c3, c4 = self
        return (
            c0
            + c1 * shape.decode_tokens
            + c2 * shape.prefill_tokens
            + c3 * shape.decode_context / _CONTEXT_UNIT
            + c4 * shape.prefill_pairs / _PAIRS_UNIT
        )

    def chunk_seconds(self, num_new: int, num_computed: int) -> float:
        """What a prefill chunk of `num_new` tokens after `num_computed` adds to a step."""
        return self.c2 * num_new + self.c4 * chunk_pairs(num_new, num_computed) / _PAIRS_UNIT

    def max_chunk(self, seconds: float, num_computed: int) -> int | None:
        """The largest prefill chunk after `num_computed` tokens that adds at most `seconds`; None: no
        bound (prefill measured as free)."""
        c2, c4 = self.c2, self.c4
        if c2 <= 0 and c4 <= 0:
            return None
        if seconds <= 0:
            return 0
        # a n^2 + b n <= seconds, with a = c4 / 2 / unit and b = c2 + c4 x num_computed / unit
        a, b = c4 / 2 / _PAIRS_UNIT, c2 + c4 * num_computed / _PAIRS_UNIT
        if a <= 0:
            return int(seconds / b)
        return int((-b + (b * b + 4 * a * seconds) ** 0.5) / (2 * a))


class StepCostModel:
    """Online least-squares fit of step seconds to `StepShape`, the engine's one instance; its current
    fit is `coefficients` (a `StepCost`), which the predictions below use."""

    def __init__(self, recent_steps: int = 256, min_steps: int = 8) -> None:
        self._decay = 1.0 - 1.0 / recent_steps
        self._min_steps = min_steps
        self._gram = np.zeros((_NUM_FEATURES, _NUM_FEATURES))  # sum of decayed x x^T
        self._moment = np.zeros(_NUM_FEATURES)  # sum of decayed x y
        self._pending: list[tuple[StepShape, float]] = []  # observed since the last refit
        self._num_steps = 0
        self._coefficients: StepCost | None = None

    @classmethod
    def fixed(cls, coefficients: tuple[float, ...]) -> StepCostModel:
        """A model with known coefficients (c0..c4) that keeps them: a calibration, or a test's."""
        model = cls()
        model._coefficients = StepCost(*map(float, coefficients))
        model._min_steps = math.inf  # never refitted
        return model

    @property
    def fitted(self) -> bool:
        return self._coefficients is not None

    @property
    def coefficients(self) -> StepCost | None:
        """(c0, c1, c2, c3, c4) in the units of the module docstring; None until fitted."""
        return self._coefficients

    def observe(self, shape: StepShape, seconds: float) -> None:
        # kept until the next refit, then folded in as one matrix product: numpy's per-call overhead
        # per step showed in batch-1 decode
        self._pending.append((shape, seconds))
        self._num_steps += 1
        if self._num_steps >= self._min_steps and (
            self._coefficients is None or self._num_steps % _REFIT_EVERY == 0
        ):
            self.refit()
        elif len(self._pending) >= _REFIT_EVERY:  # a fixed model folds too: `pending` stays bounded
            self._fold_pending()

    def _fold_pending(self) -> None:
        """The pending steps into the decayed sums, the oldest decayed most."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        x = np.array([_features(shape) for shape, _ in pending])
        y = np.array([seconds for _, seconds in pending])
        weights = self._decay ** np.arange(len(pending) - 1, -1, -1, dtype=np.float64)
        scale = self._decay ** len(pending)
        self._gram = self._gram * scale + (x * weights[:, None]).T @ x
        self._moment = self._moment * scale + (weights * y) @ x

    def refit(self) -> None:
        """The least-squares coefficients that are all non-negative (Lawson and Hanson's active set,
        on the normal equations): dropping every coefficient that comes out negative at once can keep
        a worse support than the best one."""
        self._fold_pending()
        # ridge relative to each feature's own size; a feature never seen stays exactly 0
        gram = self._gram + np.diag(_RIDGE * np.diag(self._gram) + _TINY)
        self._coefficients = StepCost(*map(float, _nonnegative_solve(gram, self._moment)))

    def predict(self, shape: StepShape) -> float | None:
        """Seconds the step would take; None until fitted."""
        cost = self._coefficients
        return None if cost is None else cost.predict(shape)

    def chunk_seconds(self, num_new: int, num_computed: int) -> float:
        """What a prefill chunk adds to a step (0 until fitted)."""
        cost = self._coefficients
        return 0.0 if cost is None else cost.chunk_seconds(num_new, num_computed)

    def max_chunk(self, seconds: float, num_computed: int) -> int | None:
        """The largest prefill chunk after `num_computed` tokens that adds at most `seconds`; None: no
        bound (not fitted, or prefill measured as free)."""
        cost = self._coefficients
        return None if cost is None else cost.max_chunk(seconds, num_computed)


def _nonnegative_solve(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """argmin over w >= 0 of w'Gw/2 - m'w, for a positive definite G: at most a few small solves."""
    size = len(moment)
    unconstrained = np.linalg.solve(gram, moment)
    if (unconstrained >= 0).all():  # the usual case: nothing to hold at zero
        return unconstrained
    solution = np.zeros(size)
    positive = np.zeros(size, dtype=bool)
    blocked = np.zeros(size, dtype=bool)  # dropped at once after entering (rounding): not re-entered
    tolerance = 1e-12 * (np.abs(moment).max() + _TINY)
    for _ in range(3 * size):  # the active set converges in far fewer; a bound, not a tuning
        gradient = moment - gram @ solution
        candidates = np.where(~positive & ~blocked & (gradient > tolerance))[0]
        if not len(candidates):
            break
        entering = candidates[np.argmax(gradient[candidates])]
        positive[entering] = True
        while True:
            trial = np.zeros(size)
            index = np.where(positive)[0]
            trial[index] = np.linalg.solve(gram[np.ix_(index, index)], moment[index])
            if (trial[index] > 0).all():
                solution = trial
                if positive[entering]:  # an index entered for good: the blocked ones may again
                    blocked[:] = False
                break
            # step from the solution towards the trial as far as every coefficient stays >= 0; the
            # one that reaches 0 first (and any other at 0) leaves the positive set
            falling = np.where(positive & (trial <= 0))[0]
            drop = solution[falling] - trial[falling]  # >= 0; 0 where a coefficient is 0 in both
            ratios = np.divide(solution[falling], drop, out=np.zeros_like(drop), where=drop > 0)
            solution = solution + ratios.min() * (trial - solution)
            solution[falling[np.argmin(ratios)]] = 0.0
            positive &= solution > 0
            solution[~positive] = 0.0
            if not positive[entering]:
                blocked[entering] = True
    return solution
