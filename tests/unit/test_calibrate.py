"""Calibration: robust per-pass segment times and the pooled fit (pure functions)."""

from __future__ import annotations

import dataclasses

import pytest

from xronos.config import small
from xronos.engine.calibrate import Round, fit, segment_times, settled
from xronos.metrics.records import Span, StepRecord
from xronos.planner import plan_tp
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.solve import DEFAULT_REPLICATED_SHARE
from xronos.planner.profile import CostCurve, DeviceProfile

CFG = small()


def _record(spans: list[tuple[str, float]], tail: float = 0.0) -> StepRecord:
    """A pass whose compute before each named collective lasts the given seconds; every
    collective itself lasts 1 ms."""
    t, out = 0.0, []
    for name, compute in spans:
        out.append(Span(name, t + compute, t + compute + 0.001))
        t += compute + 0.001
    return StepRecord(0, "d", 0, 0.0, t + tail, collectives=tuple(out))


def test_layer_segments_are_the_median_layer_times_the_layer_count() -> None:
    fwd = [(f"L{i}.attn.out.fwd", 0.010) for i in range(4)]
    fwd[2] = ("L2.attn.out.fwd", 0.050)  # one span stretched by a hiccup
    mlp = [(f"L{i}.mlp.out.fwd", 0.020) for i in range(4)]
    bwd = [(f"L{i}.attn.in.bwd", 0.005) for i in range(4)]
    rec = _record(
        [
            ("embed.fwd", 0.001),
            *fwd,
            *mlp,
            ("vocab.ce", 0.007),
            ("head.bwd", 0.003),
            *bwd,
            ("grads.norm", 0.004),
        ],
        tail=0.002,
    )
    t = segment_times(rec)
    assert t["attn"] == pytest.approx(4 * (0.010 + 0.005))  # the 50 ms span does not count
    assert t["mlp"] == pytest.approx(4 * 0.020)
    assert t["vocab"] == pytest.approx(0.001 + 0.007 + 0.003)
    assert t["other"] == pytest.approx(0.004 + 0.002)


def _profile(name: str, speed: float) -> DeviceProfile:
    per_unit = {"attn": 0.02, "mlp": 0.004, "vocab": 0.001}
    return DeviceProfile(
        name=name,
        segments={s: CostCurve(0.002 / speed, per_unit[s] / speed) for s in SEGMENTS},
        replicated_s=0.03 / speed,
    )


def _true_times(p: DeviceProfile, k: dict[str, float], plan: Plan, i: int) -> dict[str, float]:
    """What device ``i`` would measure if its real cost were ``k`` × its profile."""
    out = {
        s: k[s]
        * (p.replicated_before(s, DEFAULT_REPLICATED_SHARE) + p.segments[s](plan.split(s)[i]))
        for s in SEGMENTS
    }
    return {**out, "other": 0.004}


def test_fit_recovers_per_segment_factors_and_the_plan_they_imply() -> None:
    profiles = [_profile("fast", 1.0), _profile("slow", 0.4)]
    # The real devices differ from the profile per segment, and differently per device.
    truth = [{"attn": 1.3, "mlp": 0.9, "vocab": 1.1}, {"attn": 0.7, "mlp": 1.2, "vocab": 1.0}]
    real = [
        dataclasses.replace(
            p,
            segments={s: CostCurve(c.a * k[s], c.b * k[s]) for s, c in p.segments.items()},
            replicated_split={
                s: k[s] * p.replicated_before(s, DEFAULT_REPLICATED_SHARE) for s in SEGMENTS
            },
        )
        for p, k in zip(profiles, truth, strict=True)
    ]
    first = plan_tp(CFG, profiles)
    second = plan_tp(CFG, [profiles[0], _profile("slow", 0.3)])  # another split, same truth
    rounds = [
        Round(
            plan,
            [
                _true_times(p, k, plan, i)
                for i, (p, k) in enumerate(zip(profiles, truth, strict=True))
            ],
            w,
        )
        for plan, w in ((first, 1.0), (second, 2.0))
    ]
    fitted = fit(profiles, rounds)
    for f, r in zip(fitted, real, strict=True):
        for s in SEGMENTS:
            assert f.segments[s].a == pytest.approx(r.segments[s].a)
            assert f.segments[s].b == pytest.approx(r.segments[s].b)
            assert f.replicated_split[s] == pytest.approx(r.replicated_split[s])
        assert f.replicated_s == pytest.approx(sum(r.replicated_split.values()) + 0.004)
    want, got = plan_tp(CFG, real), plan_tp(CFG, fitted)
    assert all(got.split(s) == want.split(s) for s in SEGMENTS)
    assert any(first.split(s) != want.split(s) for s in SEGMENTS)  # calibration mattered


def test_fit_pools_rounds_by_weight() -> None:
    profiles = [_profile("a", 1.0), _profile("b", 1.0)]
    plan = plan_tp(CFG, profiles)
    slow = [_true_times(p, dict.fromkeys(SEGMENTS, 2.0), plan, i) for i, p in enumerate(profiles)]
    ok = [_true_times(p, dict.fromkeys(SEGMENTS, 1.0), plan, i) for i, p in enumerate(profiles)]
    fitted = fit(profiles, [Round(plan, slow, 1.0), Round(plan, ok, 3.0)])
    # (1·2 + 3·1) / (1 + 3) of the profiled cost
    assert fitted[0].segments["mlp"].b == pytest.approx(1.25 * profiles[0].segments["mlp"].b)


def test_settled_allows_one_unit_of_wobble() -> None:
    plan = Plan.even(CFG, ["a", "b"])
    d = plan.to_dict()
    moved = Plan.from_dict({**d, "attn": [d["attn"][0] + 1, d["attn"][1] - 1]})
    jumped = Plan.from_dict({**d, "mlp": [d["mlp"][0] + 4, d["mlp"][1] - 4]})
    assert settled(plan, moved) and not settled(plan, jumped)
