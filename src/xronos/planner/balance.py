"""Exact balancing of one segment: give ``total`` units to devices so the last one to reach
the segment's barrier arrives as early as possible.

Device ``i`` arrives at the barrier at ``f_i(u) = r_i + t_i(u)``, where ``r_i`` is the
replicated work it does before the barrier (a constant) and ``t_i`` its cost curve
(``t(0) = 0``, ``t(u) = a + b·u``, non-decreasing). The problem::

    minimise   max_i f_i(u_i)
    subject to Σ_i u_i = total,   low_i ≤ u_i ≤ high_i,   u_i integer

**Why it is exact.** For a target time ``T`` device ``i`` can take any
``u ≤ cap_i(T) = max{u ≤ high_i : f_i(u) ≤ T}``, and ``T`` is feasible iff
``T ≥ max_i f_i(low_i)`` and ``Σ_i cap_i(T) ≥ total``. Feasibility is monotone in ``T`` and
only changes at the values ``f_i(u)``, so the optimum is one of them. Because each
``f_i`` is non-decreasing, ``Σ_i (cap_i(T) − low_i)`` is the number of *candidates*
``f_i(u)``, ``low_i < u ≤ high_i``, that are ``≤ T``; the optimum is therefore
``T* = max(max_i f_i(low_i), k-th smallest candidate)`` with ``k = total − Σ low_i``,
found by merging the devices' sorted candidate sequences (``O(k log N)``).

**Tie-break.** Usually many assignments reach ``T*`` (every device below the barrier has
slack). Among them we take the one with the least total compute ``Σ_i t_i(u_i)`` — the same
step time for the fewest CPU-seconds, which on an edge device is energy and headroom for
everything else it runs. That is a small knapsack over ``low_i ≤ u_i ≤ cap_i(T*)``, solved
exactly by dynamic programming in ``O(N · total)`` (a sliding-window minimum per device).
Identical devices (same curve, replicated work and bounds) that hold units then share them
evenly — this changes neither the makespan nor the compute, and keeps them off the barrier
together; any remaining tie goes to the lower rank (later devices take fewer units).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import NamedTuple

from xronos.planner.profile import CostCurve

_Finish = Callable[[int, int], float]
"""``finish(device, units)``: when that device reaches the barrier holding that many units."""


class SegmentSolution(NamedTuple):
    """One segment's assignment and what it costs."""

    units: tuple[int, ...]
    """Units per device, summing to the segment's total."""
    finish_s: tuple[float, ...]
    """``r_i + t_i(u_i)``: when each device reaches the barrier (seconds)."""
    makespan_s: float
    """``max(finish_s)``: when the barrier releases; minimal over all assignments."""


def check_curve(curve: CostCurve) -> str | None:
    """Why ``curve`` cannot be planned with (not finite, or decreasing), or None if fine."""
    if not (math.isfinite(curve.a) and math.isfinite(curve.b)):
        return f"non-finite cost curve (a={curve.a}, b={curve.b})"
    if curve.b < 0 or curve.a + curve.b < 0:
        return f"decreasing cost curve (a={curve.a:.3g}, b={curve.b:.3g})"
    return None


def solve_segment(
    curves: Sequence[CostCurve],
    total: int,
    *,
    replicated: Sequence[float] | None = None,
    low: Sequence[int] | None = None,
    high: Sequence[int | None] | None = None,
) -> SegmentSolution:
    """Optimal integer split of ``total`` units over devices (see the module docstring).

    Args:
        curves: per device, the time of ``u`` units of this segment.
        total: units to place (``>= 0``).
        replicated: per device, replicated work done before this barrier (default 0).
        low: per device, the fewest units it must hold (default 0).
        high: per device, the most units it may hold (memory), None = unbounded.

    Raises:
        ValueError: a curve is decreasing, or the bounds admit no assignment.
    """
    n = len(curves)
    r = [float(x) for x in (replicated if replicated is not None else [0.0] * n)]
    lo = [int(x) for x in (low if low is not None else [0] * n)]
    hi = [total if h is None else min(int(h), total) for h in (high or [None] * n)]
    if not (len(r) == len(lo) == len(hi) == n) or n == 0:
        raise ValueError(
            "solve_segment: curves, replicated, low and high need one entry per device"
        )
    for curve in curves:
        if (why := check_curve(curve)) is not None:
            raise ValueError(f"solve_segment: {why}")
    if total < 0 or any(x < 0 for x in lo) or any(a > b for a, b in zip(lo, hi, strict=True)):
        raise ValueError(f"solve_segment: infeasible bounds low={lo} high={hi}")
    if not sum(lo) <= total <= sum(hi):
        raise ValueError(f"solve_segment: {total} units do not fit low={lo} high={hi}")

    def finish(i: int, u: int) -> float:
        return r[i] + curves[i](u)

    target = max(finish(i, lo[i]) for i in range(n))
    extra = total - sum(lo)
    if extra > 0:
        target = max(target, _kth_candidate(finish, lo, hi, extra))
    caps = [_cap_at(finish, i, lo[i], hi[i], target) for i in range(n)]
    units = _even_out(_least_compute(curves, lo, caps, total), curves, r, lo, hi)
    times = tuple(finish(i, u) for i, u in enumerate(units))
    return SegmentSolution(units, times, max(times))


def _kth_candidate(finish: _Finish, lo: Sequence[int], hi: Sequence[int], k: int) -> float:
    """The k-th smallest (1-based) of all ``finish(i, u)`` for ``lo[i] < u <= hi[i]``."""

    def seq(i: int) -> Iterator[float]:
        return (finish(i, u) for u in range(lo[i] + 1, hi[i] + 1))

    merged = heapq.merge(*(seq(i) for i in range(len(lo))))
    return next(islice(merged, k - 1, k))


def _cap_at(finish: _Finish, i: int, lo: int, hi: int, target: float) -> int:
    """Largest ``u`` in ``[lo, hi]`` with ``finish(i, u) <= target`` (``finish(i, lo)`` is)."""
    good, bad = lo, hi + 1
    while bad - good > 1:
        mid = (good + bad) // 2
        if finish(i, mid) <= target:
            good = mid
        else:
            bad = mid
    return good


def _least_compute(
    curves: Sequence[CostCurve], lo: Sequence[int], hi: Sequence[int], total: int
) -> tuple[int, ...]:
    """Minimise ``Σ t_i(u_i)`` s.t. ``Σ u_i = total``, ``lo_i <= u_i <= hi_i`` (exact DP).

    ``best[k]`` is the least compute placing ``k`` units on the devices seen so far. For
    ``u >= 1`` units on device ``i``: ``best[k-u] + a + b·u = (best[j] - b·j) + a + b·k``
    with ``j = k - u``, so the minimum over the window ``j ∈ [k-hi, k-max(lo,1)]`` is a
    sliding-window minimum. Ties prefer fewer units on the current device.
    """
    best = [0.0] + [math.inf] * total
    picks: list[list[int]] = []
    for curve, low, high in zip(curves, lo, hi, strict=True):
        first = max(low, 1)
        g = [v - curve.b * j for j, v in enumerate(best)]
        new, pick = [math.inf] * (total + 1), [-1] * (total + 1)
        window: deque[int] = deque()
        pushed = 0
        for k in range(total + 1):
            while pushed <= k - first:
                while window and g[window[-1]] >= g[pushed]:
                    window.pop()
                window.append(pushed)
                pushed += 1
            while window and window[0] < k - high:
                window.popleft()
            if low == 0:
                new[k], pick[k] = best[k], 0
            if window and first <= high:
                j = window[0]
                v = g[j] + curve.a + curve.b * k
                if v < new[k]:
                    new[k], pick[k] = v, k - j
        best = new
        picks.append(pick)
    units, k = [], total
    for pick in reversed(picks):
        units.append(pick[k])
        k -= pick[k]
    if k != 0 or min(units) < 0:  # unreachable when sum(lo) <= total <= sum(hi)
        raise ValueError("solve_segment: no assignment within bounds")
    return tuple(reversed(units))


def _even_out(
    units: tuple[int, ...],
    curves: Sequence[CostCurve],
    replicated: Sequence[float],
    lo: Sequence[int],
    hi: Sequence[int],
) -> tuple[int, ...]:
    """Split the units of each group of identical active devices evenly (remainder first).

    Same curve and units held -> same compute (``a`` is paid once per active device), and
    the group's largest share can only shrink, so the optimum is kept.
    """
    out = list(units)
    groups: dict[tuple[float, float, float, int, int], list[int]] = {}
    for i, u in enumerate(units):
        if u > 0:
            key = (curves[i].a, curves[i].b, replicated[i], lo[i], hi[i])
            groups.setdefault(key, []).append(i)
    for members in groups.values():
        held = sum(units[i] for i in members)
        share, extra = divmod(held, len(members))
        for rank, i in enumerate(members):
            out[i] = share + (1 if rank < extra else 0)
    return tuple(out)
