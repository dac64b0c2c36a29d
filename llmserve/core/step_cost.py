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
zero is dropped from the fit (a step never gets cheaper by adding work). Until `min_steps` steps were
seen the model is not fitted and predicts nothing (callers then apply no latency cap).

The scheduler (core/scheduler.py) predicts each step with it; the admission predictor
(core/wait_predictor.py) reads the same model for a prompt's prefill time.
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


class StepCostModel:
    """Online least-squares fit of step seconds to `StepShape`; `predict` is a 5-term dot product."""

    def __init__(self, recent_steps: int = 256, min_steps: int = 8) -> None:
        self._decay = 1.0 - 1.0 / recent_steps
        self._min_steps = min_steps
        self._gram = np.zeros((_NUM_FEATURES, _NUM_FEATURES))  # sum of decayed x x^T
        self._moment = np.zeros(_NUM_FEATURES)  # sum of decayed x y
        self._pending: list[tuple[StepShape, float]] = []  # observed since the last refit
        self._num_steps = 0
        self._coefficients: tuple[float, ...] | None = None

    @classmethod
    def fixed(cls, coefficients: tuple[float, ...]) -> StepCostModel:
        """A model with known coefficients (c0..c4) that keeps them: a calibration, or a test's."""
        model = cls()
        model._coefficients = tuple(map(float, coefficients))
        model._min_steps = math.inf  # never refitted
        return model

    @property
    def fitted(self) -> bool:
        return self._coefficients is not None

    @property
    def coefficients(self) -> tuple[float, ...] | None:
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
        """Solve the normal equations, dropping coefficients that come out negative."""
        self._fold_pending()
        active = list(range(_NUM_FEATURES))
        # ridge relative to each feature's own size; a feature never seen stays exactly 0
        ridge = np.diag(_RIDGE * np.diag(self._gram) + _TINY)
        solution = np.zeros(_NUM_FEATURES)
        while active:
            gram = (self._gram + ridge)[np.ix_(active, active)]
            values = np.linalg.solve(gram, self._moment[active])
            if (values >= 0).all():
                solution[active] = values
                break
            active = [index for index, value in zip(active, values, strict=True) if value >= 0]
        self._coefficients = tuple(float(value) for value in solution)

    def predict(self, shape: StepShape) -> float | None:
        """Seconds the step would take; None until fitted."""
        c = self._coefficients
        if c is None:
            return None
        return (
            c[0]
            + c[1] * shape.decode_tokens
            + c[2] * shape.prefill_tokens
            + c[3] * shape.decode_context / _CONTEXT_UNIT
            + c[4] * shape.prefill_pairs / _PAIRS_UNIT
        )

    def chunk_seconds(self, num_new: int, num_computed: int) -> float:
        """What a prefill chunk adds to a step (0 until fitted)."""
        c = self._coefficients
        if c is None:
            return 0.0
        return c[2] * num_new + c[4] * chunk_pairs(num_new, num_computed) / _PAIRS_UNIT

    def max_chunk(self, seconds: float, num_computed: int) -> int | None:
        """The largest prefill chunk after `num_computed` tokens that adds at most `seconds`; None: no
        bound (not fitted, or prefill measured as free)."""
        c = self._coefficients
        if c is None or (c[2] <= 0 and c[4] <= 0):
            return None
        if seconds <= 0:
            return 0
        # a n^2 + b n <= seconds, with a = c4 / 2 / unit and b = c2 + c4 x num_computed / unit
        a, b = c[4] / 2 / _PAIRS_UNIT, c[2] + c[4] * num_computed / _PAIRS_UNIT
        if a <= 0:
            return int(seconds / b)
        return int((-b + (b * b + 4 * a * seconds) ** 0.5) / (2 * a))
