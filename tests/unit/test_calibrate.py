"""Calibration: robust per-pass segment times and the pooled fit (pure functions)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from xronos.comm.mappings import TPGroup
from xronos.config import small
from xronos.errors import UserError
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.metrics.records import COLLECTIVE, Span, StepRecord
from xronos.parallel.shard import build_model
from xronos.planner import plan_tp
from xronos.planner.calibrate import (
    Round,
    fit,
    left_out,
    pooled,
    probe_plan,
    segment_times,
    settled,
)
from xronos.planner.plan import SEGMENTS, Plan, parse_segment_kind, segment_kind
from xronos.planner.profile import CostCurve, DeviceProfile
from xronos.planner.solve import DEFAULT_REPLICATED_SHARE

CFG = small()


def _record(spans: list[tuple[str, float]], tail: float = 0.0) -> StepRecord:
    """A pass whose compute before each tagged collective lasts the given seconds; every
    collective itself lasts 1 ms. A tag is ``segment`` or ``segment@layer`` (what the
    seams record as the span's kind) or ``-`` for a collective that closes no segment."""
    t, out = 0.0, []
    for tag, compute in spans:
        kind = COLLECTIVE if tag == "-" else tag
        out.append(Span(f"c{len(out)}", t + compute, t + compute + 0.001, kind))
        t += compute + 0.001
    return StepRecord(0, "d", 0, 0.0, t + tail, collectives=tuple(out))


def test_layer_segments_are_the_median_layer_times_the_layer_count() -> None:
    fwd = [(segment_kind("attn", i), 0.010) for i in range(4)]
    fwd[2] = (segment_kind("attn", 2), 0.050)  # one span stretched by a hiccup
    mlp = [(segment_kind("mlp", i), 0.020) for i in range(4)]
    bwd = [(segment_kind("attn", i), 0.005) for i in range(4)]
    vocab = segment_kind("vocab")
    rec = _record(
        [(vocab, 0.001), *fwd, *mlp, (vocab, 0.007), (vocab, 0.003), *bwd, ("-", 0.004)],
        tail=0.002,
    )
    t = segment_times(rec)
    assert t["attn"] == pytest.approx(4 * (0.010 + 0.005))  # the 50 ms span does not count
    assert t["mlp"] == pytest.approx(4 * 0.020)
    assert t["vocab"] == pytest.approx(0.001 + 0.007 + 0.003)
    assert t["other"] == pytest.approx(0.004 + 0.002)


def test_every_tensor_parallel_collective_names_its_segment_and_layer() -> None:
    """The seams tag what calibration reads: a real forward+backward of a 2-rank shard (on
    the silent group: collectives recorded, no peer needed) closes each layer's attention
    and MLP with tagged collectives, the head's with ``vocab``, and nothing else but the
    step's tail is untagged."""
    cfg = dataclasses.replace(CFG, num_layers=3)
    plan = Plan.from_shares(cfg, [2.0, 1.0], mlp_chunk=8, vocab_chunk=8)
    model = build_model(cfg, plan, TPGroup(0, 2).silent(), seed=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    rec = SpanRecorder(0)
    rec.start_step(0)
    with use_recorder(rec):
        model.loss_sum(ids, ids).backward()
    record = rec.end_step()
    assert record is not None
    tags = [parse_segment_kind(c.kind) for c in record.collectives]
    assert None not in tags, [c.name for c in record.collectives]
    for seg in ("attn", "mlp"):
        layers = sorted(layer for s, layer in tags if s == seg and layer is not None)
        assert layers == sorted(2 * list(range(cfg.num_layers))), seg  # forward + backward
    assert any(s == "vocab" for s, _ in tags)
    assert segment_times(record)["attn"] > 0 and segment_times(record)["mlp"] > 0


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


def test_a_device_the_profile_leaves_out_of_a_segment_is_probed_with_a_unit() -> None:
    # The slow device's attention intercept, as a disturbed profile can give it: so large
    # that the planner gives it no head, and calibration would never measure its attention.
    slow = _profile("slow", 0.4)
    skewed = dataclasses.replace(
        slow, segments={**slow.segments, "attn": CostCurve(5.0, slow.segments["attn"].b)}
    )
    profiles = [_profile("fast", 1.0), skewed]

    def plan_with(least: dict[str, int]) -> Plan:
        return plan_tp(CFG, profiles, min_units=least)

    first = plan_with({})
    assert first.split("attn")[1] == 0 and min(first.split("mlp")) > 0
    probe = probe_plan(first, plan_with)
    assert probe is not None
    assert probe.split("attn")[1] >= 1  # the left-out segment: at least one unit each
    assert sum(probe.split("attn")) == sum(first.split("attn"))
    # every device already holds units of every segment: no probe
    even = [_profile("fast", 1.0), slow]
    assert probe_plan(plan_tp(CFG, even), lambda least: plan_tp(CFG, even, min_units=least)) is None

    # no plan can give the device a unit (here: the planner refuses): no probe
    def refuse(least: dict[str, int]) -> Plan:
        raise UserError("no room")

    assert probe_plan(first, refuse) is None
    assert probe_plan(Plan.single(CFG), plan_with) is None  # one device: nothing to probe


def test_a_round_reports_the_units_it_ran_and_what_each_device_measured() -> None:
    profiles = [_profile("a", 1.0), _profile("b", 0.5)]
    plan = plan_tp(CFG, profiles)
    measured = [
        _true_times(p, dict.fromkeys(SEGMENTS, 1.0), plan, i) for i, p in enumerate(profiles)
    ]
    d = Round(plan, measured, 2.0).to_dict()
    assert d["units"] == {s: list(plan.split(s)) for s in SEGMENTS}
    assert d["measured_s"] == measured
    assert d["weight"] == 2.0


def _rounds_at(profiles: list[DeviceProfile], plan: Plan, factors: list[float]) -> list[Round]:
    """Rounds of one plan, weighted 1, 2, …, in which every device measured its profiled
    cost times that round's factor."""
    return [
        Round(
            plan,
            [_true_times(p, dict.fromkeys(SEGMENTS, k), plan, i) for i, p in enumerate(profiles)],
            w,
        )
        for w, k in enumerate(factors, start=1)
    ]


def test_one_stray_round_is_left_out_of_the_pool() -> None:
    profiles = [_profile("a", 1.0), _profile("b", 0.4)]
    plan = plan_tp(CFG, profiles)
    # The last (heaviest) of four rounds ran a third slow: a hiccup of the host.
    fitted = fit(profiles, _rounds_at(profiles, plan, [1.0, 1.02, 0.98, 1.33]))
    # (1·1.0 + 2·1.02 + 3·0.98) / 6 of the profiled cost: the stray round weighs nothing
    want = (1.0 + 2 * 1.02 + 3 * 0.98) / 6
    for f, p in zip(fitted, profiles, strict=True):
        for s in SEGMENTS:
            assert f.segments[s].b == pytest.approx(want * p.segments[s].b)
    # (pooled with it, the same rounds would have said (… + 4·1.33) / 10 = 1.13: 13 % off)


def test_rounds_within_the_hosts_noise_are_all_pooled() -> None:
    profiles = [_profile("a", 1.0), _profile("b", 0.4)]
    plan = plan_tp(CFG, profiles)
    # a host that drifts by 12 % over three rounds strays from no median by more than 15 %
    fitted = fit(profiles, _rounds_at(profiles, plan, [1.0, 1.06, 1.12]))
    want = (1.0 + 2 * 1.06 + 3 * 1.12) / 6
    assert fitted[1].segments["mlp"].b == pytest.approx(want * profiles[1].segments["mlp"].b)


def test_two_rounds_are_pooled_however_far_apart() -> None:
    # with two rounds neither can be told to be the stray one
    assert pooled([1.0, 2.0], [1.0, 1.0]) == [0, 1]
    assert pooled([1.0, 1.0, 1.6], [1.0, 1.0, 1.0]) == [0, 1]
    assert pooled([1.0, 0.0, 1.6], [1.0, 1.0, 1.0]) == [0, 1, 2]  # one round measured nothing


def test_the_round_left_out_is_reported_for_its_device_and_segment() -> None:
    profiles = [_profile("a", 1.0), _profile("b", 0.4)]
    plan = plan_tp(CFG, profiles)
    rounds = _rounds_at(profiles, plan, [1.0, 1.0, 1.0])
    # device b's MLP ran 30 % slow in the second round, nothing else did
    stretched = dict(rounds[1].measured[1], mlp=1.3 * rounds[1].measured[1]["mlp"])
    rounds[1] = Round(plan, [rounds[1].measured[0], stretched], rounds[1].weight)
    assert left_out(profiles, rounds) == [{}, {"mlp": [1]}, {}]
    fitted = fit(profiles, rounds)
    assert fitted[1].segments["mlp"].b == pytest.approx(profiles[1].segments["mlp"].b)
