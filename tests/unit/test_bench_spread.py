"""The speed-up interval over resampled rounds: a drift that every strategy's step of a
round shares cancels in it; the steps' own scatter widens it. The same for ``auto``
against the best other strategy."""

from __future__ import annotations

import random
import statistics

import pytest

from xronos.bench.spread import LEAST_ROUNDS, against_best_other, speedup_interval


def _drifting(rounds: int, seed: int) -> list[float]:
    """``single``'s steps on a host whose speed strays by up to 30 % from round to round."""
    rng = random.Random(seed)
    return [0.5 * (1.0 + 0.3 * rng.random()) for _ in range(rounds)]


def test_a_drift_shared_by_each_round_cancels() -> None:
    single = _drifting(16, seed=1)
    faster = [0.8 * t for t in single]  # the same drift, every step 0.8 x single's
    found = speedup_interval(single, faster)
    assert found is not None
    lo, hi = found
    # the ratio of the medians of any resample is 1 / 0.8 exactly, up to float rounding
    assert abs(lo - 1.25) < 1e-9 and abs(hi - 1.25) < 1e-9


def test_scatter_of_its_own_widens_the_interval_around_the_estimate() -> None:
    single = _drifting(16, seed=2)
    rng = random.Random(3)
    calm = [0.8 * t * (1.0 + 0.02 * rng.uniform(-1, 1)) for t in single]
    rough = [0.8 * t * (1.0 + 0.20 * rng.uniform(-1, 1)) for t in single]
    narrow, wide = speedup_interval(single, calm), speedup_interval(single, rough)
    assert narrow is not None and wide is not None
    for (lo, hi), steps in ((narrow, calm), (wide, rough)):
        estimate = statistics.median(single) / statistics.median(steps)
        assert lo <= estimate <= hi
    # ±2 % per step keeps the interval ~0.05 wide here; ±20 % spreads it to ~0.25
    assert narrow[1] - narrow[0] < 0.1 < wide[1] - wide[0]


def test_the_same_steps_give_the_same_interval() -> None:
    single, steps = _drifting(16, seed=4), _drifting(16, seed=5)
    assert speedup_interval(single, steps) == speedup_interval(single, steps)


def test_no_interval_without_the_same_rounds_or_with_too_few() -> None:
    single = _drifting(16, seed=6)
    assert speedup_interval(single, single[:-1]) is None  # not timed round by round
    short = single[: LEAST_ROUNDS - 1]
    assert speedup_interval(short, short) is None


def test_auto_against_the_best_other_keeps_a_shared_drift_out() -> None:
    single = _drifting(16, seed=7)
    xronos = [0.76 * t for t in single]
    auto = [0.80 * t for t in single]
    found = against_best_other(auto, {"xronos": xronos, "single": single})
    assert found is not None and found["best_other"] == "xronos"
    assert found["ratio"] == pytest.approx(0.80 / 0.76)
    # every resample scales all three by the same drift: one value, up to float rounding
    lo, hi = found["interval"]
    assert lo == pytest.approx(0.80 / 0.76) and hi == pytest.approx(0.80 / 0.76)


def test_the_best_other_is_chosen_anew_in_each_resample() -> None:
    rng = random.Random(8)
    single = _drifting(32, seed=9)
    # two others of the same speed with scatter of their own: in a resample either may lead
    a = [0.8 * t * (1.0 + 0.1 * rng.uniform(-1, 1)) for t in single]
    b = [0.8 * t * (1.0 + 0.1 * rng.uniform(-1, 1)) for t in single]
    auto = [0.8 * t for t in single]
    found = against_best_other(auto, {"a": a, "b": b, "single": single})
    assert found is not None
    lo, hi = found["interval"]
    assert lo <= found["ratio"] <= hi
    # against the faster of two in each resample auto looks slower than against either alone
    alone = against_best_other(auto, {"a": a})
    assert alone is not None
    assert hi >= alone["interval"][1]


def test_against_the_best_other_needs_others_and_rounds_for_its_interval() -> None:
    single = _drifting(16, seed=10)
    assert against_best_other(single, {}) is None
    assert against_best_other([], {"single": single}) is None
    found = against_best_other(single[:-1], {"single": single})  # not timed round by round
    assert found is not None and found["interval"] is None
    assert found["ratio"] == pytest.approx(
        statistics.median(single[:-1]) / statistics.median(single)
    )
