"""The single-segment balancer against brute force, plus the behaviour users rely on."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xronos.planner.balance import solve_segment
from xronos.planner.profile import CostCurve

# Integer-valued costs make exact ties common (the tie-break is exercised); fractional
# ones cover the general case.
coef = st.one_of(st.integers(0, 4).map(float), st.floats(0, 4, allow_nan=False))


@st.composite
def segment_cases(draw: st.DrawFn) -> tuple[list[CostCurve], int, list[float], list[int], list]:
    n = draw(st.integers(1, 4))
    total = draw(st.integers(0, 12))
    curves = [CostCurve(draw(coef), draw(coef)) for _ in range(n)]
    replicated = [draw(st.sampled_from([0.0, 0.0, 1.0, 2.5])) for _ in range(n)]
    low = [draw(st.sampled_from([0, 0, 0, 1, 2])) for _ in range(n)]
    high = [draw(st.one_of(st.none(), st.integers(0, 12))) for _ in range(n)]
    return curves, total, replicated, low, high


def brute_force(curves, total, replicated, low, high):
    """(least makespan, least compute at that makespan) over every split, or None."""
    ranges = [
        range(lo, (total if hi is None else min(hi, total)) + 1)
        for lo, hi in zip(low, high, strict=True)
    ]
    best = None
    for units in itertools.product(*ranges):
        if sum(units) != total:
            continue
        makespan = max(r + c(u) for c, r, u in zip(curves, replicated, units, strict=True))
        compute = sum(c(u) for c, u in zip(curves, units, strict=True))
        if best is None or (makespan, compute) < best:
            best = (makespan, compute)
    return best


@settings(max_examples=200, deadline=None)
@given(segment_cases())
def test_optimal_against_brute_force(case) -> None:
    curves, total, replicated, low, high = case
    expected = brute_force(curves, total, replicated, low, high)
    if expected is None:
        with pytest.raises(ValueError):
            solve_segment(curves, total, replicated=replicated, low=low, high=high)
        return
    sol = solve_segment(curves, total, replicated=replicated, low=low, high=high)
    assert sum(sol.units) == total
    for u, lo, hi in zip(sol.units, low, high, strict=True):
        assert lo <= u and (hi is None or u <= hi)
    # The optimum is one of the values r_i + t_i(u) and both sides compute those values by
    # the same expression, so the makespan matches exactly.
    assert sol.makespan_s == expected[0]
    compute = sum(c(u) for c, u in zip(curves, sol.units, strict=True))
    # The DP adds the same terms in another order: allow float reassociation only.
    assert compute == pytest.approx(expected[1], rel=1e-9, abs=1e-9)
    assert sol.finish_s == tuple(
        r + c(u) for c, r, u in zip(curves, replicated, sol.units, strict=True)
    )


def test_speeds_one_to_point_four_split_five_to_two() -> None:
    # Device 1 runs at 0.4x the speed of device 0 -> 2.5x the time per unit.
    total = 1000
    sol = solve_segment([CostCurve(0.0, 1.0), CostCurve(0.0, 2.5)], total)
    # Integer units: each share is within one unit of the real-valued 5/7 : 2/7.
    assert abs(sol.units[0] - total * 5 / 7) <= 1
    assert abs(sol.units[1] - total * 2 / 7) <= 1
    assert sum(sol.units) == total


def test_more_devices_than_units_leaves_some_with_none() -> None:
    curves = [CostCurve(0.1, 1.0)] * 6
    sol = solve_segment(curves, 4)
    assert sum(sol.units) == 4
    assert sorted(sol.units) == [0, 0, 1, 1, 1, 1]
    assert sol.makespan_s == pytest.approx(1.1)


def test_replicated_work_moves_units_away() -> None:
    # Equal shard speed, but device 0 spends 3 s more on replicated work before the barrier:
    # it must take 3 fewer units for both to arrive together (6 vs 9 units of 1 s).
    sol = solve_segment([CostCurve(0, 1), CostCurve(0, 1)], 15, replicated=[3.0, 0.0])
    assert sol.units == (6, 9)
    assert sol.finish_s == (9.0, 9.0)


def test_tie_break_prefers_least_compute() -> None:
    # Both (A=1, B=5) and (A=0, B=6) finish at 6 s; the second spends 6 s of compute
    # instead of 11 s, so it is the one chosen.
    sol = solve_segment([CostCurve(5, 1), CostCurve(0, 1)], 6)
    assert sol.makespan_s == 6
    assert sol.units == (0, 6)


def test_equal_devices_give_the_remainder_to_lower_ranks_and_are_deterministic() -> None:
    curves = [CostCurve(0, 1)] * 3
    first = solve_segment(curves, 7)
    assert first.units == (3, 2, 2)
    assert all(solve_segment(curves, 7) == first for _ in range(3))


def test_caps_respected_and_infeasible_caps_rejected() -> None:
    sol = solve_segment([CostCurve(0, 1), CostCurve(0, 10)], 10, high=[4, None])
    assert sol.units == (4, 6)
    with pytest.raises(ValueError, match="do not fit"):
        solve_segment([CostCurve(0, 1), CostCurve(0, 1)], 10, high=[4, 5])


def test_decreasing_curve_rejected() -> None:
    with pytest.raises(ValueError, match="decreasing"):
        solve_segment([CostCurve(1.0, -0.5)], 3)
    with pytest.raises(ValueError, match="decreasing"):
        solve_segment([CostCurve(-2.0, 1.0)], 3)


def test_large_segment_is_fast_enough_for_fine_chunks() -> None:
    # 16 devices x 16384 units (e.g. a 128k vocabulary in chunks of 8): O(N·U), not O(N·U²).
    curves = [CostCurve(0.001 * i, 1.0 + 0.1 * i) for i in range(16)]
    sol = solve_segment(curves, 16384)
    assert sum(sol.units) == 16384
    times = [c(u) for c, u in zip(curves, sol.units, strict=True)]
    # Balanced to within one unit of the slowest device's per-unit time.
    assert max(times) - min(times) <= max(c.b for c in curves) + max(c.a for c in curves)
