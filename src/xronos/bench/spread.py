"""How far a strategy's speed-up over ``single`` could move with the host's noise: a
percentile interval from resampling the bench's rounds.

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
from collections.abc import Sequence

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
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(
            statistics.median(single[i] for i in picks) / statistics.median(steps[i] for i in picks)
        )
    ratios.sort()
    k = round((1.0 - LEVEL) / 2 * (resamples - 1))  # as many resamples cut from each tail
    return ratios[k], ratios[-1 - k]
