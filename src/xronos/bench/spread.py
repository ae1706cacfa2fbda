"""How far a strategy's speed-up over ``single`` could move with the host's noise: a
percentile interval from resampling the bench's rounds. The same for ``auto`` against the
best other strategy of the run (:func:`against_best_other`).

The bench interleaves strategies round by round, so step ``i`` of every strategy ran at
about the same moment; the host's drift hits a round's steps alike. Resampling whole rounds
(with replacement) keeps that pairing: the interval shows what the steps' own scatter does
to ``median(single) / median(strategy)``, while a drift shared by a round's steps cancels
in the ratio. A strategy whose steps are ``single``'s times a constant gets an interval of
that one value; two strategies whose intervals overlap widely were not told apart by the
run (``--steps`` takes more rounds). Where memory caps make the bench run strategies in
turn, step ``i`` of two strategies did not run together: the interval is still a bootstrap
of the ratio, but a drift no longer cancels in it.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping, Sequence

RESAMPLES = 2000
"""Resampled runs per interval: enough for the 2.5 and 97.5 percentiles to settle within
a few tenths of a per cent."""
LEVEL = 0.95
"""The interval's coverage."""
LEAST_ROUNDS = 4
"""Fewer counted rounds than this give no interval."""


def speedup_interval(
    single: Sequence[float],
    steps: Sequence[float],
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float] | None:
    """The :data:`LEVEL` percentile interval of ``median(single) / median(steps)`` over
    rounds resampled with replacement (the same rounds for both); None where the two were
    not timed round by round (different counts) or over too few rounds. Deterministic for
    a given ``seed``."""
    n = len(steps)
    if n != len(single) or n < LEAST_ROUNDS or min(steps) <= 0:
        return None
    return _interval(
        lambda picks: _median(single, picks) / _median(steps, picks), n, resamples, seed
    )


def against_best_other(
    target: Sequence[float],
    others: Mapping[str, Sequence[float]],
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> dict[str, object] | None:
    """``median(target) / median(best)``, ``best`` the other strategy with the lowest
    median step (``single`` included): ``{"best_other", "ratio", "interval"}``, the
    interval that of the same statistic over resampled rounds, the best one chosen anew in
    each (None where some strategy was not timed round by round with the target, or over
    too few rounds). None where there is no other strategy or a step is not positive."""
    runs = {name: list(steps) for name, steps in others.items() if steps}
    if not target or not runs or min(target) <= 0 or min(min(s) for s in runs.values()) <= 0:
        return None
    n = len(target)
    best = min(runs, key=lambda name: statistics.median(runs[name]))
    ratio = statistics.median(target) / statistics.median(runs[best])
    paired = n >= LEAST_ROUNDS and all(len(s) == n for s in runs.values())

    def statistic(picks: Sequence[int]) -> float:
        return _median(target, picks) / min(_median(s, picks) for s in runs.values())

    interval = _interval(statistic, n, resamples, seed) if paired else None
    return {"best_other": best, "ratio": ratio, "interval": interval}


def _median(steps: Sequence[float], picks: Sequence[int]) -> float:
    return statistics.median(steps[i] for i in picks)


def _interval(
    statistic: Callable[[Sequence[int]], float], n: int, resamples: int, seed: int
) -> tuple[float, float]:
    """The :data:`LEVEL` percentile interval of ``statistic`` over ``resamples`` draws of
    ``n`` rounds with replacement."""
    rng = random.Random(seed)
    values = sorted(statistic([rng.randrange(n) for _ in range(n)]) for _ in range(resamples))
    k = round((1.0 - LEVEL) / 2 * (resamples - 1))  # as many resamples cut from each tail
    return values[k], values[-1 - k]
