"""Compute / transfer / idle arithmetic (docs/architecture.md, Measurement) on records with
known timings."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xronos.errors import UserError
from xronos.metrics import (
    DeviceMetrics,
    Span,
    StepMetrics,
    StepRecord,
    analyze_pipeline_step,
    analyze_step,
    efficiency,
    ideal_step_time,
    is_pipeline,
    stall_ratio,
    step_phases,
    summarize,
)

# Hand-made timings are multiples of 0.1 s; sums of a handful of them in float64 are exact
# to ~1e-15 s, so 1e-9 s is a generous absolute tolerance that still catches any real error.
TOL = 1e-9


def _tp_step() -> list[StepRecord]:
    """Three ranks, two all-reduces.  max arrive: c0 = 4.0 (rank 1), c1 = 8.0 (rank 2)."""
    return [
        StepRecord(0, "fast", 0, 0.0, 10.0, (Span("c0", 2.0, 5.0), Span("c1", 6.0, 9.0))),
        StepRecord(1, "slow", 0, 0.0, 10.0, (Span("c0", 4.0, 5.0), Span("c1", 7.0, 9.5))),
        StepRecord(2, "mid", 0, 0.5, 10.0, (Span("c0", 3.0, 5.2), Span("c1", 8.0, 9.2))),
    ]


def test_tp_step_split_matches_hand_arithmetic() -> None:
    m = analyze_step(_tp_step())
    # rank 0: idle (4-2)+(8-6)=4, transfer (5-4)+(9-8)=2, step 10 -> compute 4
    # rank 1: idle 0+(8-7)=1,     transfer 1+1.5=2.5,     step 10 -> compute 6.5
    # rank 2: idle (4-3)+0=1,     transfer 1.2+1.2=2.4,   step 9.5 -> compute 6.1
    expected = {0: (4.0, 2.0, 4.0, 10.0), 1: (1.0, 2.5, 6.5, 10.0), 2: (1.0, 2.4, 6.1, 9.5)}
    assert [d.rank for d in m.devices] == [0, 1, 2]
    for d in m.devices:
        idle, transfer, compute, step = expected[d.rank]
        assert d.idle_s == pytest.approx(idle, abs=TOL)
        assert d.transfer_s == pytest.approx(transfer, abs=TOL)
        assert d.compute_s == pytest.approx(compute, abs=TOL)
        assert d.idle_ratio == pytest.approx(idle / step, abs=TOL)
    assert m.step_time_s == pytest.approx(10.0, abs=TOL)
    assert m.idle_ratio_max == pytest.approx(0.4, abs=TOL)
    assert m.idle_ratio_mean == pytest.approx((0.4 + 0.1 + 1 / 9.5) / 3, abs=TOL)


def test_tp_records_in_any_order_give_the_same_result() -> None:
    records = _tp_step()
    assert analyze_step(records[::-1]) == analyze_step(records)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda r: StepRecord(r.rank, r.device, r.step, r.start, r.end, r.collectives[:1]),
            "recorded 2 collectives but rank 1 recorded 1",
        ),
        (
            lambda r: StepRecord(
                r.rank, r.device, r.step, r.start, r.end, (r.collectives[0], Span("c9", 7.0, 9.5))
            ),
            "collective #1 is 'c1' on rank 0 but 'c9' on rank 1",
        ),
        (lambda r: StepRecord(r.rank, r.device, 7, r.start, r.end, r.collectives), "mix steps"),
        (lambda r: StepRecord(0, r.device, r.step, r.start, r.end, r.collectives), "same rank"),
    ],
)
def test_inconsistent_tp_records_are_rejected(mutate, match) -> None:  # type: ignore[no-untyped-def]
    records = _tp_step()
    records[1] = mutate(records[1])
    with pytest.raises(ValueError, match=match):
        analyze_step(records)


def test_overlapping_spans_are_rejected() -> None:
    bad = StepRecord(0, "d", 0, 0.0, 5.0, (Span("a", 1.0, 3.0), Span("b", 2.0, 4.0)))
    with pytest.raises(ValueError, match="overlaps"):
        analyze_step([bad])


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.lists(st.floats(0.0, 5.0), min_size=4, max_size=4), min_size=1, max_size=4),
    transfers=st.lists(st.floats(0.0, 2.0), min_size=3, max_size=3),
    starts=st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4),
)
def test_simulated_tp_step_recovers_the_simulation(chunks, transfers, starts) -> None:  # type: ignore[no-untyped-def]
    """Simulate ranks that compute chunks[i][k] before collective k (which ends transfers[k]
    after the last arrival) and a tail chunks[i][3]; the analysis must give back exactly the
    simulated compute, waiting and transfer."""
    n = len(chunks)
    clock = [starts[i] for i in range(n)]
    spans: list[list[Span]] = [[] for _ in range(n)]
    waited = [0.0] * n
    for k, transfer in enumerate(transfers):
        arrive = [clock[i] + chunks[i][k] for i in range(n)]
        leave = max(arrive) + transfer
        for i in range(n):
            spans[i].append(Span(f"c{k}", arrive[i], leave))
            waited[i] += max(arrive) - arrive[i]
            clock[i] = leave
    records = [
        StepRecord(i, f"d{i}", 0, starts[i], clock[i] + chunks[i][3], tuple(spans[i]))
        for i in range(n)
    ]
    m = analyze_step(records)
    # Times stay below ~30 s; float64 rounding of ~20 additions is < 1e-13 s.
    for i, d in enumerate(m.devices):
        assert d.idle_s == pytest.approx(waited[i], abs=TOL)
        assert d.transfer_s == pytest.approx(sum(transfers), abs=TOL)
        assert d.compute_s == pytest.approx(sum(chunks[i]), abs=TOL)
        assert 0.0 <= d.idle_ratio <= 1.0
    assert 0.0 <= m.idle_ratio_mean <= m.idle_ratio_max <= 1.0
    for rank, phases in step_phases(records).items():
        rec = records[rank]
        assert phases == [] or phases[0].start == rec.start
        assert all(a.end == b.start for a, b in itertools.pairwise(phases))
        assert sum(p.end - p.start for p in phases) == pytest.approx(rec.duration, abs=TOL)
        idle = sum(p.end - p.start for p in phases if p.kind == "idle")
        assert idle == pytest.approx(m.devices[rank].idle_s, abs=TOL)


def _pp_step() -> list[StepRecord]:
    """Two stages, one microbatch, a loss message with no sender record, a loss all-reduce."""
    stage0 = (
        Span("send:act/mb0/0->1", 1.0, 1.5),  # partner arrived at 0.0 -> idle 0, transfer 0.5
        Span("recv:grad/mb0/1->0", 2.0, 8.0),  # partner arrives at 7.0 -> idle 5, transfer 1
        Span("loss.allreduce", 9.0, 9.8),  # other arrives 9.6 -> idle 0.6, transfer 0.2
    )
    stage1 = (
        Span("recv:act/mb0/0->1", 0.0, 1.5),  # partner arrives 1.0 -> idle 1, transfer 0.5
        Span("send:grad/mb0/1->0", 7.0, 8.0),  # last to arrive -> idle 0, transfer 1
        Span("recv:labels", 9.0, 9.5),  # unmatched: transfer = estimate, rest idle
        Span("loss.allreduce", 9.6, 9.8),  # idle 0, transfer 0.2
    )
    return [StepRecord(0, "s0", 4, 0.0, 10.0, stage0), StepRecord(1, "s1", 4, 0.0, 10.0, stage1)]


def test_pipeline_step_matches_hand_arithmetic() -> None:
    records = _pp_step()
    assert is_pipeline(records) and not is_pipeline(_tp_step())
    with pytest.raises(ValueError):
        analyze_step(records)
    m = analyze_pipeline_step(records, transfer_estimate_s=0.1)
    s0, s1 = m.devices
    assert (s0.idle_s, s0.transfer_s) == pytest.approx((5.6, 1.7), abs=TOL)
    assert (s1.idle_s, s1.transfer_s) == pytest.approx((1.4, 1.8), abs=TOL)
    assert (s0.compute_s, s1.compute_s) == pytest.approx((2.7, 6.8), abs=TOL)
    # The estimate may also depend on the message; it is capped at the wait itself.
    m2 = analyze_pipeline_step(records, transfer_estimate_s=lambda span: 99.0)
    assert m2.devices[1].transfer_s == pytest.approx(1.8 - 0.1 + 0.5, abs=TOL)


def test_summarize_uses_counted_steps_only() -> None:
    def step(n: int, wall: float, idle0: float) -> StepMetrics:
        return StepMetrics(
            n,
            wall,
            (
                DeviceMetrics(0, "a", wall, wall - idle0 - 0.5, 0.5, idle0),
                DeviceMetrics(1, "b", wall, wall - 0.5, 0.5, 0.0),
            ),
        )

    run = summarize(
        [step(0, 50.0, 40.0), step(1, 2.0, 1.0), step(2, 4.0, 1.0), step(3, 3.0, 1.0)], 1
    )
    assert run.step_time_s == 3.0  # median of 2, 4, 3
    assert run.step_time_s_all == (2.0, 4.0, 3.0)
    assert run.per_device[0].idle_s == pytest.approx(1.0, abs=TOL)
    assert run.per_device[0].compute_s == pytest.approx((0.5 + 2.5 + 1.5) / 3, abs=TOL)
    # idle ratio is time-weighted: 3 s idle out of 9 s for rank 0, none for rank 1.
    assert run.idle_ratio_max == pytest.approx(3 / 9, abs=TOL)
    assert run.idle_ratio_mean == pytest.approx(3 / 18, abs=TOL)
    assert run.to_dict()["per_device"][1]["name"] == "b"
    # each device's figures are means over the same steps, so they add up to its own mean
    # step (3 s), not to the run's median
    dev = run.to_dict()["per_device"][0]
    assert dev["step_time_s"] == pytest.approx(3.0, abs=TOL)
    assert dev["compute_s"] + dev["transfer_s"] + dev["idle_s"] == pytest.approx(3.0, abs=TOL)
    # every counted step's compute, per device and in order (the warm-up step left out)
    assert dev["compute_s_all"] == pytest.approx([0.5, 2.5, 1.5], abs=TOL)
    assert run.to_dict()["per_device"][1]["compute_s_all"] == pytest.approx([1.5, 3.5, 2.5])
    with pytest.raises(UserError, match="warm-up of 4"):
        summarize([step(0, 1.0, 0.0)] * 4, skip_warmup=4)


def test_stall_ratio_compares_matching_spans() -> None:
    observed = [Span("fwd:mb0", 0.0, 1.2, "forward"), Span("fwd:mb1", 2.0, 3.3, "forward")]
    observed.append(Span("unprofiled", 4.0, 9.0))  # no isolated reference: ignored
    isolated = [Span("fwd:mb0", 0.0, 0.9), Span("fwd:mb0", 1.0, 2.1), Span("fwd:mb1", 0.0, 1.0)]
    # t_observed = 1.2 + 1.3 = 2.5; t_isolated = mean(0.9, 1.1) + 1.0 = 2.0
    assert stall_ratio(observed, isolated) == pytest.approx(1 - 2.0 / 2.5, abs=TOL)
    assert stall_ratio(isolated[2:], observed[1:2]) == 0.0  # faster than isolated: clamped
    with pytest.raises(ValueError):
        stall_ratio(observed[2:], isolated)


def test_efficiency_and_ideal_step_time() -> None:
    # Two devices of 2 s and 6 s alone together need 1/(1/2 + 1/6) = 1.5 s, nothing moved.
    ideal = ideal_step_time([2.0, 6.0])
    assert ideal == pytest.approx(1.5, abs=TOL)
    assert efficiency(ideal, 3.0) == pytest.approx(0.5, abs=TOL)
    with pytest.raises(ValueError):
        efficiency(0.0, 1.0)
    with pytest.raises(ValueError):
        ideal_step_time([])
