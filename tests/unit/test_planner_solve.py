"""plan_tp, plan_even, predict and ideal_step_time on profiles built in the test."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xronos.config import ModelConfig, small, tiny
from xronos.errors import UserError
from xronos.planner import (
    SEGMENTS,
    Plan,
    ideal_step_time,
    plan_even,
    plan_tp,
    predict,
)
from xronos.planner.plan import segment_units
from xronos.planner.profile import CostCurve, DeviceProfile

#: Seconds per unit at speed 1 (made-up but of realistic proportions: a KV group costs
#: more than an MLP chunk, which costs more than a vocabulary chunk).
PER_UNIT = {"attn": 0.02, "mlp": 0.004, "vocab": 0.001}
SHARE = {"attn": 0.5, "mlp": 0.5, "vocab": 0.0}  # the planner's default replicated share


def profile(
    name: str,
    speed: float,
    *,
    a: float = 0.0,
    rep: float = 0.0,
    memory: int = 0,
    base: int = 0,
    unit_bytes: dict[str, int] | None = None,
    allreduce_s: float = 0.0,
) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        segments={s: CostCurve(a / speed, PER_UNIT[s] / speed) for s in SEGMENTS},
        replicated_s=rep / speed,
        memory_bytes=memory,
        base_bytes=base,
        unit_bytes=unit_bytes or {},
        allreduce_s=allreduce_s,
        allreduces_per_step=4 if allreduce_s else 0,
    )


def step_of(plan: Plan) -> float:
    return sum(max(plan.predicted_s[s]) for s in SEGMENTS)


def test_plan_covers_the_model_and_predictions_add_up() -> None:
    cfg = small()
    profiles = [profile("nuc", 1.0, rep=0.05), profile("pi", 0.4, rep=0.05), profile("hub", 0.7)]
    plan = plan_tp(cfg, profiles)
    plan.check(cfg)  # every segment's units sum to the model's
    assert plan.strategy == "xronos"
    assert plan.devices == ("nuc", "pi", "hub")
    for i, p in enumerate(profiles):
        units = {s: plan.split(s)[i] for s in SEGMENTS}
        # Same terms summed in another order.
        assert sum(plan.predicted_s[s][i] for s in SEGMENTS) == pytest.approx(p.step_time(units))
    # No replicated work before the vocabulary barrier: shares follow speed alone.
    assert plan.vocab[0] > plan.vocab[2] > plan.vocab[1]


# -- optimality against an independent brute force ------------------------------------------
def finish_time(p: DeviceProfile, seg: str, units: int) -> float:
    """The planner's cost model, written out again: replicated work before the barrier plus
    ``a + b·u`` for a device that holds units, and nothing for one that holds none."""
    curve = p.segments[seg]
    return p.replicated_s * SHARE[seg] + (0.0 if units == 0 else curve.a + curve.b * units)


def brute_force_segment(profiles: list[DeviceProfile], seg: str, total: int) -> float:
    """Least barrier time of ``seg`` over every integer split of ``total`` units."""
    return min(
        max(finish_time(p, seg, u) for p, u in zip(profiles, split, strict=True))
        for split in _compositions(total, len(profiles))
    )


@st.composite
def few_unit_cases(draw: st.DrawFn) -> tuple[ModelConfig, list[DeviceProfile]]:
    # Up to 4 KV groups, 8 MLP chunks and 6 vocabulary chunks of 8: every split of every
    # segment over 2-3 devices is enumerable. Integer-valued costs make ties common.
    kv = draw(st.integers(1, 4))
    cfg = ModelConfig(
        vocab_size=8 * draw(st.integers(1, 6)),
        hidden_size=12,
        intermediate_size=8 * draw(st.integers(1, 8)),
        num_layers=1,
        num_heads=kv,
        num_kv_heads=kv,
    )
    coef = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), st.floats(0, 3))
    profiles = [
        DeviceProfile(
            name=f"d{i}",
            segments={s: CostCurve(draw(coef), draw(coef)) for s in SEGMENTS},
            replicated_s=draw(st.sampled_from([0.0, 1.0, 2.5])),
        )
        for i in range(draw(st.integers(2, 3)))
    ]
    return cfg, profiles


@settings(max_examples=150, deadline=None)
@given(few_unit_cases())
def test_every_segment_matches_brute_force_and_never_loses_to_even(case) -> None:
    cfg, profiles = case
    plan = plan_tp(cfg, profiles, mlp_chunk=8, vocab_chunk=8)
    plan.check(cfg)  # every segment's units sum to the model's
    even = plan_even(cfg, profiles)
    assert (even.mlp_chunk, even.vocab_chunk) == (8, 8)  # the same units as the plan's
    totals = segment_units(cfg, 8, 8)
    for s in SEGMENTS:
        times = [finish_time(p, s, u) for p, u in zip(profiles, plan.split(s), strict=True)]
        # The predictions are the cost model applied to the plan's own units (the same
        # three terms; allow float reassociation only).
        assert plan.predicted_s[s] == pytest.approx(times, rel=1e-12, abs=1e-15)
        # The barrier is the least over every split (no memory limit here: exact).
        assert max(times) == pytest.approx(brute_force_segment(profiles, s, totals[s]), rel=1e-12)
        assert max(plan.predicted_s[s]) <= max(even.predicted_s[s]) * (1 + 1e-12)


def test_hand_computed_plan() -> None:
    # Two devices; b is twice as slow per unit, pays a = 1 s once it holds any unit, and has
    # 4 s of replicated work (2 s before the attn and mlp barriers, none before vocab).
    #   attn, 4 units:  a takes 4 -> max(4, 2) = 4  (3-1 would give max(3, 2+1+2) = 5)
    #   mlp,  8 units:  7-1 -> max(7, 2+1+2) = 7 = 6-2 -> max(6, 2+1+4); 7-1 computes
    #                   7+3 = 10 s, 6-2 computes 6+5 = 11 s: the least compute wins
    #   vocab, 6 units: 5-1 -> max(5, 1+2) = 5 = 4-2 -> max(4, 1+4); 5+3 < 4+5 s of compute
    cfg = ModelConfig(
        vocab_size=48,
        hidden_size=8,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
    )
    fast = DeviceProfile(name="a", segments={s: CostCurve(0, 1) for s in SEGMENTS}, replicated_s=0)
    slow = DeviceProfile(name="b", segments={s: CostCurve(1, 2) for s in SEGMENTS}, replicated_s=4)
    plan = plan_tp(cfg, [fast, slow], mlp_chunk=8, vocab_chunk=8)
    assert (plan.attn, plan.mlp, plan.vocab) == ((4, 0), (7, 1), (5, 1))
    # b holds no KV group: it reaches the attn barrier after its replicated work alone
    # (t(0) = 0, not a). Sums of small binary fractions: exact.
    assert plan.predicted_s == {"attn": (4.0, 2.0), "mlp": (7.0, 5.0), "vocab": (5.0, 3.0)}


# -- memory ---------------------------------------------------------------------------------
MICRO = ModelConfig(
    vocab_size=24, hidden_size=8, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2
)  # with chunks of 8: attn 2, mlp 4, vocab 3 units
MICRO_BYTES = {"attn": 3, "mlp": 2, "vocab": 1}


def _compositions(total: int, n: int):
    return [c for c in itertools.product(range(total + 1), repeat=n) if sum(c) == total]


def coupled_brute_force(profiles: list[DeviceProfile]) -> float | None:
    """Least predicted step over every split of every segment that fits memory."""
    totals = segment_units(MICRO, 8, 8)
    n, best = len(profiles), None
    per_seg = {s: _compositions(totals[s], n) for s in SEGMENTS}
    for combo in itertools.product(*(per_seg[s] for s in SEGMENTS)):
        units = dict(zip(SEGMENTS, combo, strict=True))
        used = [sum(units[s][i] * MICRO_BYTES[s] for s in SEGMENTS) for i in range(n)]
        if any(p.memory_bytes and u > p.memory_bytes for p, u in zip(profiles, used, strict=True)):
            continue
        step = sum(
            max(
                p.replicated_s * SHARE[s] + p.segments[s](units[s][i])
                for i, p in enumerate(profiles)
            )
            for s in SEGMENTS
        )
        best = step if best is None else min(best, step)
    return best


@st.composite
def tight_clusters(draw: st.DrawFn) -> list[DeviceProfile]:
    n = draw(st.integers(2, 3))
    coef = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])
    return [
        DeviceProfile(
            name=f"d{i}",
            segments={s: CostCurve(draw(coef), draw(coef)) for s in SEGMENTS},
            replicated_s=draw(st.sampled_from([0.0, 1.0])),
            memory_bytes=draw(st.sampled_from([0, 4, 6, 8, 10, 12])),
            unit_bytes=MICRO_BYTES,
        )
        for i in range(n)
    ]


@settings(max_examples=120, deadline=None)
@given(tight_clusters())
def test_memory_is_respected_and_unbinding_memory_keeps_the_optimum(profiles) -> None:
    best = coupled_brute_force(profiles)
    if best is None:
        with pytest.raises(UserError):
            plan_tp(MICRO, profiles, mlp_chunk=8, vocab_chunk=8)
        return
    plan = plan_tp(MICRO, profiles, mlp_chunk=8, vocab_chunk=8)
    for i, p in enumerate(profiles):
        used = sum(plan.split(s)[i] * MICRO_BYTES[s] for s in SEGMENTS)
        assert p.memory_bytes == 0 or used <= p.memory_bytes
    assert step_of(plan) >= best - 1e-12  # nothing beats brute force (sanity of the oracle)
    unconstrained = plan_tp(
        MICRO,
        [DeviceProfile.from_dict({**p.to_dict(), "memory_bytes": 0}) for p in profiles],
        mlp_chunk=8,
        vocab_chunk=8,
    )
    needs = [
        sum(unconstrained.split(s)[i] * MICRO_BYTES[s] for s in SEGMENTS)
        for i in range(len(profiles))
    ]
    if all(
        p.memory_bytes == 0 or u <= p.memory_bytes for p, u in zip(profiles, needs, strict=True)
    ):
        # Each segment at its own optimum and it fits: the exact coupled optimum.
        assert step_of(plan) == pytest.approx(best, rel=1e-12)


@st.composite
def bounded_clusters(draw: st.DrawFn) -> list[DeviceProfile]:
    # Every device bounded, most of them below the 14 B the whole model needs: memory binds.
    coef = st.sampled_from([0.0, 0.5, 1.0, 2.0])
    return [
        DeviceProfile(
            name=f"d{i}",
            segments={
                s: CostCurve(draw(coef), draw(st.sampled_from([0.5, 1.0, 2.0]))) for s in SEGMENTS
            },
            replicated_s=draw(st.sampled_from([0.0, 1.0])),
            memory_bytes=draw(st.integers(4, 10)),
            unit_bytes=MICRO_BYTES,
        )
        for i in range(draw(st.integers(2, 3)))
    ]


@settings(max_examples=150, deadline=None)
@given(bounded_clusters())
def test_tight_memory_plan_fits_and_no_segment_alone_can_do_better(profiles) -> None:
    # When memory binds, the coupled search is not exhaustive (planner.memory), but what it
    # returns must fit, and no single segment may be re-split, within the memory the other
    # two leave, to reach its barrier sooner: checked against every split of that segment.
    if coupled_brute_force(profiles) is None:
        with pytest.raises(UserError):
            plan_tp(MICRO, profiles, mlp_chunk=8, vocab_chunk=8)
        return
    plan = plan_tp(MICRO, profiles, mlp_chunk=8, vocab_chunk=8)
    plan.check(MICRO)
    n, totals = len(profiles), segment_units(MICRO, 8, 8)
    used = [sum(plan.split(s)[i] * MICRO_BYTES[s] for s in SEGMENTS) for i in range(n)]
    assert all(u <= p.memory_bytes for p, u in zip(profiles, used, strict=True)), used
    for s in SEGMENTS:
        left = [
            p.memory_bytes - (used[i] - plan.split(s)[i] * MICRO_BYTES[s])
            for i, p in enumerate(profiles)
        ]
        best = min(
            max(finish_time(p, s, u) for p, u in zip(profiles, split, strict=True))
            for split in _compositions(totals[s], n)
            if all(u * MICRO_BYTES[s] <= b for u, b in zip(split, left, strict=True))
        )  # never empty: the plan's own split is one of them
        # Same cost model on both sides; float reassociation only.
        assert max(plan.predicted_s[s]) == pytest.approx(best, rel=1e-12), s


def test_tight_packing_that_speed_alone_would_miss() -> None:
    # Equal speeds want one KV group each (3 B), but then the two MLP units (2 B each) do not
    # fit: the only split that fits puts both groups on 'a' (6 of 7 B) and the MLP on 'b'.
    segs = {s: CostCurve(0, 1) for s in SEGMENTS}
    cfg = MICRO.replace(vocab_size=8, intermediate_size=16)  # attn 2, mlp 2, vocab 1
    profiles = [
        DeviceProfile(
            name="a", segments=segs, replicated_s=0, memory_bytes=7, unit_bytes=MICRO_BYTES
        ),
        DeviceProfile(
            name="b", segments=segs, replicated_s=0, memory_bytes=4, unit_bytes=MICRO_BYTES
        ),
    ]
    plan = plan_tp(cfg, profiles, mlp_chunk=8, vocab_chunk=8)
    for i, p in enumerate(profiles):
        assert sum(plan.split(s)[i] * MICRO_BYTES[s] for s in SEGMENTS) <= p.memory_bytes
    plan.check(cfg)


def test_memory_poor_fast_device_holds_less_than_its_speed_share() -> None:
    cfg = small()
    mib = 2**20
    unit_bytes = {"attn": 8 * mib, "mlp": 1 * mib, "vocab": mib // 4}
    free = [
        profile("fast", 1.0, unit_bytes=unit_bytes),
        profile("slow", 0.5, unit_bytes=unit_bytes),
    ]
    tight = [profile("fast", 1.0, unit_bytes=unit_bytes, memory=60 * mib, base=10 * mib), free[1]]
    loose, capped = plan_tp(cfg, free), plan_tp(cfg, tight)
    used = sum(capped.split(s)[0] * unit_bytes[s] for s in SEGMENTS)
    assert used <= 50 * mib < sum(loose.split(s)[0] * unit_bytes[s] for s in SEGMENTS)
    capped.check(cfg)
    assert step_of(capped) > step_of(loose)


def test_device_too_small_for_one_unit_is_named() -> None:
    cfg = MICRO.replace(intermediate_size=32, vocab_size=8)  # attn 2, mlp 4, vocab 1 units
    ub = {"attn": 1, "mlp": 100, "vocab": 1}
    profiles = [
        profile("nuc", 1.0, memory=399, unit_bytes=ub),
        profile("pi", 0.5, memory=99, unit_bytes=ub),
    ]
    with pytest.raises(UserError, match=r"device 'pi' has .* but one mlp unit needs .*drop it"):
        plan_tp(cfg, profiles, mlp_chunk=8, vocab_chunk=8)
    # If the other device can absorb the rest, the small one simply gets no MLP units.
    profiles[0] = profile("nuc", 1.0, memory=500, unit_bytes=ub)
    plan = plan_tp(cfg, profiles, mlp_chunk=8, vocab_chunk=8)
    assert plan.mlp == (4, 0)


def test_memory_errors() -> None:
    cfg, ub = small(), {"attn": 2**20, "mlp": 2**20, "vocab": 2**20}
    with pytest.raises(UserError, match=r"cluster has .* usable but .* need"):
        plan_tp(
            cfg,
            [
                profile("a", 1.0, memory=2**20, unit_bytes=ub),
                profile("b", 1, memory=2**20, unit_bytes=ub),
            ],
        )
    with pytest.raises(UserError, match=r"device 'a' has .* before holding any shard"):
        plan_tp(cfg, [profile("a", 1.0, memory=100, base=200)])


def test_more_devices_than_kv_groups() -> None:
    cfg = tiny()  # 8 query heads (the attention units) in 4 KV groups
    profiles = [profile(f"d{i}", 1.0 - 0.05 * i) for i in range(10)]
    plan = plan_tp(cfg, profiles)
    plan.check(cfg)
    assert plan.attn.count(0) >= 2 and sum(plan.attn) == 8
    assert all(u > 0 for u in plan.mlp)


def test_min_units() -> None:
    cfg = tiny()
    profiles = [profile("fast", 1.0), profile("slow", 0.05)]
    assert plan_tp(cfg, profiles).attn == (8, 0)  # 20x slower: not worth a query head
    plan = plan_tp(cfg, profiles, min_units={"attn": 1})
    assert plan.attn == (7, 1)
    with pytest.raises(UserError, match="min_units asks every device for 5 attn units"):
        plan_tp(cfg, profiles, min_units={"attn": 5})
    with pytest.raises(UserError, match="unknown segment"):
        plan_tp(cfg, profiles, min_units={"embed": 1})


def test_bad_profiles_and_chunks() -> None:
    cfg = tiny()
    missing = DeviceProfile(name="x", segments={"attn": CostCurve(0, 1)}, replicated_s=0)
    with pytest.raises(UserError, match="no 'mlp' cost curve"):
        plan_tp(cfg, [missing])
    bad = DeviceProfile(name="x", segments={s: CostCurve(0, -1) for s in SEGMENTS}, replicated_s=0)
    with pytest.raises(UserError, match="decreasing cost curve"):
        plan_tp(cfg, [bad])
    with pytest.raises(UserError, match="no device profiles"):
        plan_tp(cfg, [])
    with pytest.raises(UserError, match="chunks must be"):
        plan_tp(cfg, [profile("a", 1.0)], mlp_chunk=-8)
    with pytest.raises(ValueError, match="replicated_share"):
        plan_tp(cfg, [profile("a", 1.0)], replicated_share={"attn": 0.7})


def test_deterministic_and_json_round_trip() -> None:
    cfg = small()
    profiles = [
        profile("a", 1.0, a=0.001, rep=0.01),
        profile("b", 0.4, rep=0.01),
        profile("c", 0.4),
    ]
    plan = plan_tp(cfg, profiles)
    again = plan_tp(cfg, profiles)
    assert plan == again and plan.predicted_s == again.predicted_s
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.predicted_s == plan.predicted_s
    assert "pred. s/step" in plan.table() and "c" in plan.table()
    # each device's row (4 decimals: abs 1e-4): its predicted seconds summed over the segments,
    # and its wait on the slowest device of each segment
    row = plan.table().splitlines()[3].split()
    pred = plan.predicted_s
    assert row[0] == "c" and float(row[4]) == pytest.approx(
        sum(v[2] for v in pred.values()), abs=1e-4
    )
    assert float(row[5]) == pytest.approx(sum(max(v) - v[2] for v in pred.values()), abs=1e-4)
    # a plan made without profiles predicts nothing, and says so
    even = Plan.even(cfg, ("a", "b")).table()
    assert "nan" not in even and even.splitlines()[1].split()[-2:] == ["-", "-"]


# -- predictions ----------------------------------------------------------------------------
def test_predict_even_vs_xronos() -> None:
    cfg = small()
    profiles = [profile("nuc", 1.0, rep=0.02, allreduce_s=0.003), profile("pi", 0.4, rep=0.02)]
    xr, ev = predict(plan_tp(cfg, profiles), profiles), predict(plan_even(cfg, profiles), profiles)
    for pred in (xr, ev):
        barriers = sum(seg["barrier_s"] for seg in pred["segments"].values())
        assert pred["transfer_s"] == pytest.approx(0.012)  # 4 all-reduces of 3 ms
        assert pred["step_time_s"] == pytest.approx(barriers + 0.012)
        assert all(x >= 0 for x in pred["idle_s"])
        assert pred["idle_ratio_max"] == max(pred["idle_ratio"])
    assert xr["step_time_s"] < ev["step_time_s"]
    assert xr["idle_ratio_mean"] < ev["idle_ratio_mean"] / 3  # even: nuc waits ~60% of a step
    with pytest.raises(UserError, match="do not match"):
        predict(plan_tp(cfg, profiles), profiles[::-1])


def test_plan_even_is_megatron_split() -> None:
    plan = plan_even(tiny(), ["a", "b", "c"])
    assert plan.strategy == "tp-even" and plan.attn == (3, 3, 2) and not plan.predicted_s


def test_ideal_of_two_identical_devices_is_half_the_solo_time() -> None:
    cfg = small()
    p = profile("a", 1.0, rep=0.05)
    totals = segment_units(cfg, Plan.single(cfg).mlp_chunk, Plan.single(cfg).vocab_chunk)
    solo = p.step_time(totals)
    assert ideal_step_time([p, profile("b", 1.0, rep=0.05)], cfg) == pytest.approx(solo / 2)
    assert ideal_step_time([p], cfg, transfer_s=0.5) == pytest.approx(solo + 0.5)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.05, 1.0), min_size=1, max_size=5), st.floats(0, 0.1))
def test_ideal_bounds_scaled_devices(speeds, rep) -> None:
    # Devices that are scaled copies of one another (the ideal's premise): no split beats it.
    cfg = small()
    profiles = [profile(f"d{i}", v, a=0.001, rep=rep) for i, v in enumerate(speeds)]
    plan_step = predict(plan_tp(cfg, profiles), profiles)["step_time_s"]
    # Both sides sum the same per-unit costs; allow float reassociation only.
    assert ideal_step_time(profiles, cfg) <= plan_step * (1 + 1e-9)
