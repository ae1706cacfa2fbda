"""Compute / transfer / idle of overlapped steps, whose two lanes run at once."""

from __future__ import annotations

import itertools

import pytest

from xronos.metrics.analysis import analyze_step, step_phases
from xronos.metrics.records import LANE, Span, StepRecord


def _rank(rank: int, coll: list[tuple[str, float, float]]) -> StepRecord:
    lanes = (Span("L0", 0.0, 8.0, LANE), Span("L1", 0.0, 9.0, LANE))
    spans = tuple(Span(n, a, b) for n, a, b in coll)
    return StepRecord(rank, f"d{rank}", 3, 0.0, 10.0, collectives=spans, computes=lanes)


def _records() -> list[StepRecord]:
    # rank 0 arrives early everywhere; rank 1's arrivals end each collective's idle part
    r0 = _rank(0, [("L0:a", 2.0, 5.0), ("L1:a", 3.0, 6.0), ("grads.norm", 9.0, 10.0)])
    r1 = _rank(1, [("L0:a", 4.0, 5.0), ("L1:a", 5.0, 6.0), ("grads.norm", 9.5, 10.0)])
    return [r0, r1]


def test_a_lane_that_computes_while_the_other_waits_counts_as_compute() -> None:
    m = analyze_step(_records())
    d0 = m.devices[0]
    # rank 0: [2,3] lane 1 still computes (compute); [3,4] both lanes wait for rank 1
    # (idle); [4,5] lane 0's data moves (transfer); after the lanes, the norm's all-reduce
    # waits 0.5 (idle) and moves 0.5 (transfer). Every other instant some lane computes.
    assert d0.idle_s == pytest.approx(1.5)
    assert d0.transfer_s == pytest.approx(1.5)
    assert d0.compute_s == pytest.approx(7.0)
    # the phases tile the step without overlap, and add up to the same split
    phases = step_phases(_records())[0]
    assert phases[0].start == 0.0 and phases[-1].end == 10.0
    assert all(a.end == b.start for a, b in itertools.pairwise(phases))
    total = {k: sum(p.end - p.start for p in phases if p.kind == k) for k in ("idle", "transfer")}
    assert total == pytest.approx({"idle": 1.5, "transfer": 1.5})


def test_ranks_that_recorded_other_collectives_are_an_error() -> None:
    r0, r1 = _records()
    r1 = StepRecord(
        1,
        "d1",
        3,
        0.0,
        10.0,
        collectives=r1.collectives[:1] + r1.collectives[2:],
        computes=r1.computes,
    )
    with pytest.raises(ValueError, match="other collectives"):
        analyze_step([r0, r1])


def test_collectives_of_one_lane_must_not_overlap() -> None:
    _, r1 = _records()
    bad = _rank(0, [("L0:a", 2.0, 5.0), ("L0:b", 4.0, 6.0)])
    with pytest.raises(ValueError, match="overlaps another of its lane"):
        analyze_step([bad, r1])
