"""A segment's cost line from a few timed points, and when those points can be trusted.

Each segment is timed at two unit counts (a quarter and a half of its units) and a line
``t(u) = a + b·u`` goes through them. Two points make the line cheap and fragile: the work
of ``u`` units grows in proportion to ``u`` (matrix products of ``u`` columns), with a small
fixed part, so a timing stretched by the host on the smaller point tilts the line into a
large intercept and a small slope. The planner reads an intercept as a price every device
pays for its first unit, and a large one on a slow device leaves it none of the segment: in
one ``ci-2dev`` bench the slow device's attention line came out as 140 ms + 0 ms a head
(the smaller point taking as long as the larger), its plan gave it no head, and it waited
out every attention of every step, 30 % of its time.

So :func:`plausible` says whether a line's points rise as work does (the intercept at most
:data:`MAX_INTERCEPT` of the smaller point's time); the profiler times implausible points
again, and :func:`line_of` fits a line through points that still fall or stay flat as the
proportional line through the largest of them (timings only err long: the largest point's
minimum is the one least stretched, relatively).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from xronos.planner.profile import CostCurve

MAX_INTERCEPT = 0.5
"""The largest intercept, as a fraction of the smallest point's time, of a line whose points
are taken as measured. On ``ci-2dev``'s slow device (six profiles, each line timed after a
warm-up), attention's intercept came to 21–40 % of its 4-head point (22–26 % on a core at
full speed: its fixed cost is real) and the MLP's to 7–24 % of its 16-unit point; timed
without the warm-up (and without the workers' heap settings), one profile's attention
reached 61 %, and a bench's 100 %."""


def fit_line(points: Sequence[tuple[int, float]]) -> CostCurve:
    """Least-squares ``t = a + b·u`` through ``points``, clamped to a, b ≥ 0."""
    n = len(points)
    if n == 1:
        u, t = points[0]
        return CostCurve(0.0, t / max(u, 1))
    mu = sum(u for u, _ in points) / n
    mt = sum(t for _, t in points) / n
    var = sum((u - mu) ** 2 for u, _ in points)
    b = sum((u - mu) * (t - mt) for u, t in points) / var if var > 0 else mt / max(mu, 1)
    b = max(b, 1e-12)
    a = max(mt - b * mu, 0.0)
    return CostCurve(a, b)


def rising(points: Sequence[tuple[int, float]]) -> bool:
    """Whether the time grows with the units at all (always, for one unit count)."""
    by_units = sorted(points)
    return all(t1 > t0 for (u0, t0), (u1, t1) in itertools.pairwise(by_units) if u1 > u0)


def plausible(points: Sequence[tuple[int, float]]) -> bool:
    """Whether ``points`` rise and their line's intercept is at most :data:`MAX_INTERCEPT`
    of the smallest point's time."""
    if not points or not rising(points):
        return False
    return fit_line(points).a <= MAX_INTERCEPT * min(points)[1]


def line_of(points: Sequence[tuple[int, float]]) -> CostCurve:
    """The segment's line: :func:`fit_line`, or, where the points do not rise, the line
    through the origin and the point of the most units."""
    return fit_line(points if rising(points) else [max(points)])


def unit_points(total: int, step: int = 1) -> list[int]:
    """Two distinct unit counts (a quarter and a half of the total) where possible: enough
    for the line, and cheap — the real-step calibration corrects the scale afterwards.
    With ``step`` they are multiples of it (attention: whole KV groups, so the line through
    them carries each query head's share of its group's K/V)."""
    return sorted({max(step, total // 4 // step * step), max(step, total // 2 // step * step)})
