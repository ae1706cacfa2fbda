"""Placing the segments within each device's memory.

Device ``i`` must hold ``Σ_s u_{i,s}·unit_bytes[s]`` within its budget
``memory_bytes − base_bytes`` (``memory_bytes == 0``: unbounded), and this couples the
otherwise independent segments. :func:`place` first balances every segment with only its
own memory limit; when the combination fits every device — the usual case — it is the
exact optimum of the coupled problem, since each segment is at its own optimum under a
weaker constraint. When it does not fit, several allocations that respect memory are built
and the one with the shortest predicted step is kept:

- *proportional*: a device whose budget is a fraction φ of the bytes of every sharded unit
  holds at most ``floor(φ·U_s)`` units of each segment;
- *sequential*, in each of the six segment orders: each segment is balanced within the
  memory the earlier ones left;
- *packed*: any split that fits, ignoring speed (heaviest segment first, roomiest device
  first) — a feasible start when the others are not.

Each is then improved by re-balancing one segment at a time within the memory the other
two leave, while that shortens its barrier. Every segment is balanced exactly within its
caps, but the coupled search is not exhaustive: when memory binds, the result can be
slower than the best possible plan, and in rare, tightly packed cases no plan may be
found although one exists.

*What a device needs* (:func:`tp_need`, :func:`stage_need`): ``base_bytes`` plus its
units' bytes — the model's part. Its process needs more: the runtime (interpreter, torch,
the collectives' library) resident before any model is built. :func:`within_caps` turns a
device's cap into the memory usable by the model by taking off that runtime, measured on
the device, so that every check above compares like with like.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from itertools import permutations

from xronos.planner.balance import SegmentSolution, solve_segment
from xronos.planner.plan import SEGMENTS
from xronos.planner.profile import DeviceProfile

Caps = dict[str, list[int | None]]
"""Per segment, per device: the most units it may hold (None = unbounded)."""
Solutions = dict[str, SegmentSolution]


def unit_bytes(p: DeviceProfile, seg: str) -> int:
    """Bytes one unit of ``seg`` takes on ``p`` (0 when the profile does not say)."""
    return max(0, int(p.unit_bytes.get(seg, 0)))


def own_caps(profiles: Sequence[DeviceProfile], budgets: Sequence[int | None]) -> Caps:
    """Per segment and device: the most units that fit with nothing else on the device."""
    caps: Caps = {}
    for s in SEGMENTS:
        caps[s] = [
            None if b is None or unit_bytes(p, s) == 0 else b // unit_bytes(p, s)
            for p, b in zip(profiles, budgets, strict=True)
        ]
    return caps


def _proportional_caps(
    profiles: Sequence[DeviceProfile], budgets: Sequence[int | None], totals: Mapping[str, int]
) -> Caps:
    """Caps ``floor(φ_i·U_s)`` with φ_i = budget / bytes of every sharded unit (see top)."""
    caps: Caps = {s: [] for s in SEGMENTS}
    for p, b in zip(profiles, budgets, strict=True):
        whole = sum(totals[s] * unit_bytes(p, s) for s in SEGMENTS)
        for s in SEGMENTS:
            bounded = b is not None and whole > b and unit_bytes(p, s) > 0
            caps[s].append((totals[s] * b) // whole if bounded and b is not None else None)
    return caps


def fits(
    units: Mapping[str, Sequence[int]],
    profiles: Sequence[DeviceProfile],
    budgets: Sequence[int | None],
) -> bool:
    """Whether every device holds its units of all segments within its budget."""
    return all(
        b is None or sum(units[s][i] * unit_bytes(p, s) for s in SEGMENTS) <= b
        for i, (p, b) in enumerate(zip(profiles, budgets, strict=True))
    )


def tp_need(p: DeviceProfile, units: Mapping[str, int]) -> int:
    """Bytes ``p`` needs for the model when it holds ``units`` of each segment of a
    tensor-parallel plan: the replicated part (``base_bytes``) and its units."""
    return p.base_bytes + sum(u * unit_bytes(p, s) for s, u in units.items())


def stage_need(
    p: DeviceProfile,
    totals: Mapping[str, int],
    num_layers: int,
    layers: int,
    *,
    first: bool,
    last: bool,
    tied: bool,
) -> int:
    """Bytes ``p`` needs for a pipeline stage of ``layers`` decoder layers: the replicated
    part, the layers' share of the attention and MLP units, the LM head on the last stage
    and, when the embedding is tied to the head, the embedding on a first stage that is
    not also the last (a copy there, with its own gradient; counted as the head's bytes,
    moments included, which the copy does not keep — it is updated by the last stage — nor
    does the first stage hold the logits' activations: this errs high by those)."""
    per_layer = (
        unit_bytes(p, "attn") * totals["attn"] + unit_bytes(p, "mlp") * totals["mlp"]
    ) // max(num_layers, 1)
    head = unit_bytes(p, "vocab") * totals["vocab"]
    embed = head if tied and first and not last else 0
    return p.base_bytes + layers * per_layer + (head if last else 0) + embed


def within_caps(
    profiles: Sequence[DeviceProfile], caps: Sequence[int | None], runtime: Sequence[int]
) -> list[DeviceProfile]:
    """``profiles`` with the memory usable by the model on each capped device: its cap
    less ``runtime`` (the bytes its process holds before any model: interpreter, torch,
    the collectives' library), at least 1 byte so that the device stays bounded. An
    uncapped device keeps its profile."""
    return [
        p if cap is None else replace(p, memory_bytes=max(1, int(cap) - int(rt)))
        for p, cap, rt in zip(profiles, caps, runtime, strict=True)
    ]


def fits_alone(p: DeviceProfile, totals: Mapping[str, int]) -> bool:
    """Whether ``p`` holds the whole model (every unit of every segment) on its own."""
    if p.memory_bytes <= 0:
        return True
    budget = p.memory_bytes - p.base_bytes
    return budget >= 0 and fits({s: [totals[s]] for s in SEGMENTS}, [p], [budget])


class Placement:
    """Everything fixed while the planner searches: curves, replicated work, bounds."""

    def __init__(
        self,
        profiles: Sequence[DeviceProfile],
        totals: Mapping[str, int],
        share: Mapping[str, float],
        low: Mapping[str, int],
    ) -> None:
        self.profiles = profiles
        self.totals = totals
        self.share = share
        self.low = low

    def solve(self, seg: str, caps: Sequence[int | None]) -> SegmentSolution | None:
        """The optimal split of ``seg`` under ``caps``, or None if they cannot hold it."""
        n = len(self.profiles)
        low = [self.low[seg]] * n
        if any(c is not None and c < lo for c, lo in zip(caps, low, strict=True)) or (
            all(c is not None for c in caps)
            and sum(c for c in caps if c is not None) < self.totals[seg]
        ):
            return None
        return solve_segment(
            [p.segments[seg] for p in self.profiles],
            self.totals[seg],
            replicated=[p.replicated_before(seg, self.share) for p in self.profiles],
            low=low,
            high=caps,
        )

    def solve_all(self, caps: Caps) -> Solutions | None:
        out = {s: self.solve(s, caps[s]) for s in SEGMENTS}
        return None if any(v is None for v in out.values()) else out  # type: ignore[return-value]

    def evaluate(self, seg: str, units: Sequence[int]) -> SegmentSolution:
        """The times of a given split of ``seg``."""
        finish = tuple(
            p.replicated_before(seg, self.share) + p.segments[seg](u)
            for p, u in zip(self.profiles, units, strict=True)
        )
        return SegmentSolution(tuple(units), finish, max(finish))

    def packed(self, budgets: Sequence[int | None]) -> Solutions | None:
        """Any split that fits, ignoring speed: after the ``min_units``, the heaviest segment
        first, each filling the device with the most memory left first (first fit)."""
        n = len(self.profiles)
        units = {s: [self.low[s]] * n for s in SEGMENTS}
        left = [
            None if b is None else b - sum(self.low[s] * unit_bytes(p, s) for s in SEGMENTS)
            for p, b in zip(self.profiles, budgets, strict=True)
        ]
        heavy_first = sorted(SEGMENTS, key=lambda s: -max(unit_bytes(p, s) for p in self.profiles))
        for s in heavy_first:
            rest = self.totals[s] - self.low[s] * n
            roomiest = sorted(range(n), key=lambda i: -_room(left[i]))
            for i in roomiest:
                w, b = unit_bytes(self.profiles[i], s), left[i]
                take = rest if b is None or w == 0 else min(rest, max(b, 0) // w)
                units[s][i] += take
                rest -= take
                left[i] = None if b is None else b - take * w
            if rest > 0:
                return None
        if any(b is not None and b < 0 for b in left):
            return None
        return {s: self.evaluate(s, units[s]) for s in SEGMENTS}

    def sequential(self, budgets: Sequence[int | None], order: Sequence[str]) -> Solutions | None:
        """Segments in ``order``, each solved within the memory the earlier ones left."""
        left = list(budgets)
        out: Solutions = {}
        for s in order:
            sol = self.solve(s, self._caps_within(s, left))
            if sol is None:
                return None
            out[s] = sol
            left = [
                None if b is None else b - u * unit_bytes(p, s)
                for p, b, u in zip(self.profiles, left, sol.units, strict=True)
            ]
        return out

    def improve(self, sols: Solutions, budgets: Sequence[int | None]) -> Solutions:
        """Re-solve one segment at a time within the memory the others leave, while that
        shortens its barrier (each pass can only improve; it stops at a fixed point)."""
        sols = dict(sols)
        improved = True
        while improved:
            improved = False
            for s in SEGMENTS:
                left = [
                    None
                    if b is None
                    else b - sum(sols[o].units[i] * unit_bytes(p, o) for o in SEGMENTS if o != s)
                    for i, (p, b) in enumerate(zip(self.profiles, budgets, strict=True))
                ]
                new = self.solve(s, self._caps_within(s, left))
                if new is not None and new.makespan_s < sols[s].makespan_s:
                    sols[s], improved = new, True
        return sols

    def _caps_within(self, seg: str, left: Sequence[int | None]) -> list[int | None]:
        return [
            None if b is None or unit_bytes(p, seg) == 0 else max(b, 0) // unit_bytes(p, seg)
            for p, b in zip(self.profiles, left, strict=True)
        ]


def _room(budget: int | None) -> float:
    return math.inf if budget is None else budget


def _step(solutions: Mapping[str, SegmentSolution]) -> float:
    return sum(sol.makespan_s for sol in solutions.values())


def place(problem: Placement, budgets: Sequence[int | None]) -> Solutions | None:
    """The best placement found (see the module docstring), or None if none fits."""
    profiles = problem.profiles
    best = problem.solve_all(own_caps(profiles, budgets))
    if best is not None and fits({s: best[s].units for s in SEGMENTS}, profiles, budgets):
        return best
    tries = [problem.solve_all(_proportional_caps(profiles, budgets, problem.totals))]
    tries += [problem.sequential(budgets, order) for order in permutations(SEGMENTS)]
    tries.append(problem.packed(budgets))
    feasible = [problem.improve(t, budgets) for t in tries if t is not None]
    return min(feasible, key=_step) if feasible else None
