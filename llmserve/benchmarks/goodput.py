"""Goodput: the requests per second that meet every latency target (vLLM's `request_goodput`).

Targets are given as vLLM's `--goodput` takes them, `KEY:VALUE` pairs in milliseconds with KEY one of
`ttft` (time to first token), `tpot` (mean time per output token after the first; a one-token reply
has none and meets it) and `e2el` (end-to-end latency). A request counts when it completed and meets
all the given targets; goodput is their number over the run's duration. Every offered request is in
the count's denominator: a failed or refused (429) request is a miss, never left out. The latency
percentiles "over offered requests" rank a failed request as infinitely slow, so a p99 that a 2%
failure rate would hide in the completed requests' percentiles is inf here.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Sequence

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_GOODPUT = {"ttft": 1000.0, "tpot": 50.0}  # the server's default latency targets


def goodput_pair(text: str) -> tuple[str, float]:
    """One `KEY:VALUE` of `--goodput` (argparse type: a bad one is a one-line CLI error)."""
    key, colon, value = text.partition(":")
    if not colon:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KEY:VALUE; give targets as ttft:1000 tpot:50 (milliseconds; keys "
            f"{', '.join(GOODPUT_METRICS)})"
        )
    if key not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(
            f"unknown metric {key!r} in {text!r}; use {', '.join(GOODPUT_METRICS)}"
        )
    try:
        milliseconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} in {text!r} is not a number of milliseconds") from None
    if not (0 < milliseconds < math.inf):
        raise argparse.ArgumentTypeError(f"the {key} target must be a positive number of ms, got {value!r}")
    return key, milliseconds


def goodput_targets(
    pairs: Iterable[tuple[str, float]] | None, aliases: dict[str, float | None] | None = None
) -> dict[str, float]:
    """The targets in ms from `--goodput` pairs and the alias flags (`--slo-ttft-ms` ...); the defaults
    where neither gives any. Raises ValueError for a metric given twice."""
    targets: dict[str, float] = {}
    given = list(pairs or []) + [(key, value) for key, value in (aliases or {}).items() if value is not None]
    for key, value in given:
        if key in targets:
            raise ValueError(f"the {key} target is given twice (--goodput {key}:... and an alias flag)")
        targets[key] = value
    return targets or dict(DEFAULT_GOODPUT)


def meets_targets(
    ok: bool, ttft: float | None, tpot: float | None, e2e: float | None, targets_ms: dict[str, float]
) -> bool:
    """Whether a request (times in seconds) completed within every target."""
    if not ok:
        return False
    values = {"ttft": ttft, "tpot": 0.0 if tpot is None else tpot, "e2el": e2e}
    return all(values[key] is not None and values[key] * 1e3 <= limit for key, limit in targets_ms.items())


def offered_percentiles(seconds: Sequence[float | None], percentiles: Sequence[float]) -> list[float]:
    """Percentiles in ms over every offered request, a failed one (None) counting as infinitely slow;
    each is an actual request's value (the empirical quantile, no interpolation toward inf)."""
    if not seconds:
        return [math.nan] * len(percentiles)
    values = np.array([math.inf if s is None else 1e3 * s for s in seconds], dtype=np.float64)
    return [float(v) for v in np.percentile(values, percentiles, method="inverted_cdf")]


def finite_or_text(value: float) -> float | str | None:
    """JSON has no inf: a failed request's rank is written "inf" (and nan, no data, as null)."""
    if math.isnan(value):
        return None
    return value if math.isfinite(value) else "inf"
