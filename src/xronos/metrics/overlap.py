"""Compute / transfer / idle of an *overlapped* step, whose lanes run at once.

In an overlapped tensor-parallel step (:mod:`xronos.train.trainer`) one rank runs two
lanes on two threads: each lane is bounded by a compute span of kind ``lane`` named
``L<k>``, and its collectives are named ``L<k>:<name>``. Collectives of different lanes
overlap in time, and while one lane waits on the wire the other may compute, so a rank's
time is cut by what *all* its threads do at each instant::

    compute   some lane is inside its bounds and not in a collective
              (outside every lane: not in a collective)
    transfer  no thread computes, and some collective in progress has every rank arrived
    idle      no thread computes, and every collective in progress still waits for a rank

A collective is matched across ranks by its name and occurrence (each lane issues its own
collectives in the same order on every rank); its idle part ends when the last rank
arrives, as for a plain step (:mod:`xronos.metrics.analysis`).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Hashable, Sequence

from xronos.metrics.records import LANE, Phase, Span, StepRecord


def is_laned(records: Sequence[StepRecord]) -> bool:
    """True when some record holds lane spans (an overlapped step)."""
    return any(s.kind == LANE for r in records for s in r.computes)


def _lane_of(name: str) -> str:
    """``L<k>`` for a lane's collective, ``""`` for one issued outside the lanes."""
    head, sep, _ = name.partition(":")
    return head if sep and head.startswith("L") and head[1:].isdigit() else ""


def lanes_checked(rec: StepRecord) -> None:
    """Within each lane (and outside them) collectives must follow one another."""
    last: dict[str, float] = defaultdict(lambda: rec.start)
    for span in sorted(rec.collectives, key=lambda s: s.start):
        key = _lane_of(span.name)
        if span.start < last[key] or span.end < span.start or span.end > rec.end:
            raise ValueError(
                f"rank {rec.rank} step {rec.step}: collective {span.name!r} overlaps another "
                "of its lane or lies outside the step"
            )
        last[key] = span.end


def lane_keys(records: list[StepRecord]) -> list[list[Hashable]]:
    """Per rank, each collective's key ``(name, occurrence)``; every rank must hold the
    same keys (tensor parallelism: the same collectives on every rank)."""
    keys: list[list[Hashable]] = []
    for rec in records:
        seen: dict[str, int] = defaultdict(int)
        rank_keys: list[Hashable] = []
        for span in rec.collectives:
            rank_keys.append((span.name, seen[span.name]))
            seen[span.name] += 1
        keys.append(rank_keys)
    reference = sorted(map(str, keys[0]))
    for rec, rank_keys in zip(records[1:], keys[1:], strict=True):
        if sorted(map(str, rank_keys)) != reference:
            raise ValueError(
                f"step {rec.step}: rank {rec.rank} recorded other collectives than rank "
                f"{records[0].rank} in an overlapped step"
            )
    return keys


def lane_phases(rec: StepRecord, parts: Sequence[tuple[Span, float]]) -> list[Phase]:
    """Consecutive compute / idle / transfer phases covering ``rec`` (see the module
    docstring); ``parts``: each collective with the time its idle part ends."""
    lanes = [s for s in rec.computes if s.kind == LANE]
    cuts = {rec.start, rec.end}
    for lane in lanes:
        cuts |= {lane.start, lane.end}
    for span, mid in parts:
        cuts |= {span.start, mid, span.end}
    times = sorted(t for t in cuts if rec.start <= t <= rec.end)
    out: list[Phase] = []
    for a, b in itertools.pairwise(times):
        if b <= a:
            continue
        t = (a + b) / 2
        active = [(s, m) for s, m in parts if s.start <= t < s.end]
        blocked = {_lane_of(s.name) for s, _ in active}
        inside = [lane.name for lane in lanes if lane.start <= t < lane.end]
        busy = any(k not in blocked for k in inside) if inside else "" not in blocked
        if busy or not active:
            kind, name = "compute", "compute"
        else:
            moving = [s for s, m in active if t >= m]
            kind, name = ("transfer", moving[0].name) if moving else ("idle", active[0][0].name)
        if out and out[-1].kind == kind and out[-1].name == name and out[-1].end == a:
            out[-1] = Phase(kind, out[-1].start, b, name)
        else:
            out.append(Phase(kind, a, b, name))
    return out
