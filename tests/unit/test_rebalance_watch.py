"""When live re-balancing sees a persistent change in a device's speed, and only then; and
the one balance check of the first plan against its own steps."""

from __future__ import annotations

from tests.unit.test_calibrate import _profile as speed_profile
from tests.unit.test_calibrate import _true_times as true_times
from xronos.config import ModelConfig
from xronos.planner import plan_tp
from xronos.planner.calibrate import Round, fit, typical
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.solve import predict
from xronos.run.rebalance import (
    BALANCE_GAIN,
    COOLDOWN,
    UNDO_MARGIN,
    WARMUP,
    WINDOW,
    SpeedWatch,
    Undo,
    propose,
)

CFG = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
)
PLAN = Plan.even(CFG, ("fast", "slow"))


def _times(fast: float, slow: float) -> list[dict[str, float]]:
    # a step's compute per segment; the split across segments does not matter here
    return [
        {"attn": 0.4 * t, "mlp": 0.4 * t, "vocab": 0.1 * t, "other": 0.1 * t} for t in (fast, slow)
    ]


def _feed(watch: SpeedWatch, steps: list[tuple[float, float]]) -> list[list[float] | None]:
    out = []
    for fast, slow in steps:
        watch.observe(PLAN, _times(fast, slow))
        out.append(watch.changed())
    return out


def test_steady_speeds_change_nothing() -> None:
    seen = _feed(SpeedWatch(), [(1.0, 1.0)] * (COOLDOWN + 20))
    assert all(s is None for s in seen)


def test_a_device_that_slows_down_for_good_is_seen_after_the_window() -> None:
    steady = COOLDOWN + 2
    seen = _feed(SpeedWatch(), [(1.0, 1.0)] * steady + [(1.0, 2.0)] * 2 * WINDOW)
    first = next(i for i, s in enumerate(seen) if s is not None)
    # the recent median moves once more than half the window is slow
    assert steady + WINDOW // 2 - 1 <= first <= steady + WINDOW
    relative = seen[-1]
    assert relative is not None
    assert relative == [0.5, 2.0]  # each device against the other: twice as long, and half


def test_a_spike_of_a_few_steps_is_not_a_change() -> None:
    steps = [(1.0, 1.0)] * (COOLDOWN + 2) + [(1.0, 3.0)] * 3 + [(1.0, 1.0)] * 20
    assert all(s is None for s in _feed(SpeedWatch(), steps))


def test_a_host_that_slows_every_device_alike_changes_nothing() -> None:
    steps = [(1.0, 1.0)] * (COOLDOWN + 2) + [(1.5, 1.5)] * 3 * WINDOW
    assert all(s is None for s in _feed(SpeedWatch(), steps))


def test_nothing_moves_before_the_cooldown_and_a_new_plan_starts_a_new_baseline() -> None:
    watch = SpeedWatch()
    early = _feed(watch, [(1.0, 1.0)] * (WARMUP + WINDOW) + [(1.0, 2.0)] * 4)
    assert all(s is None for s in early)  # changed, but within the cooldown
    watch.restart()
    after = _feed(watch, [(1.0, 2.0)] * (COOLDOWN + 4))  # the new speeds are the baseline
    assert all(s is None for s in after)


# -- the balance check of the first plan --------------------------------------------------
# fine enough that a few per cent moves a unit: 16 heads, 64 MLP and 128 vocabulary units
FINE = ModelConfig(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=512,
    num_layers=2,
    num_heads=16,
    num_kv_heads=16,
)
CHUNKS = (8, 8)
PROFILES = [speed_profile("fast", 1.0), speed_profile("slow", 0.4)]


def _measured(plan: Plan, slow_factor: float) -> list[dict[str, float]]:
    """A step as the devices measure it when the slow one is ``slow_factor`` × its profile
    (the fast one exactly its profile)."""
    factors = (dict.fromkeys(SEGMENTS, 1.0), dict.fromkeys(SEGMENTS, slow_factor))
    pairs = enumerate(zip(PROFILES, factors, strict=True))
    return [true_times(p, k, plan, i) for i, (p, k) in pairs]


def _watched(plan: Plan, slow_factor: float, steps: int) -> SpeedWatch:
    watch = SpeedWatch()
    for _ in range(steps):
        watch.observe(plan, _measured(plan, slow_factor))
    return watch


def test_the_balance_is_checked_once_when_the_first_baseline_is_in() -> None:
    watch = _watched(PLAN, 1.0, WARMUP + WINDOW - 1)
    assert watch.balance_check() is None  # no baseline yet
    watch.observe(PLAN, _measured(PLAN, 1.0))
    first = watch.balance_check()
    assert first is not None and max(first) == 1.0
    assert watch.balance_check() is None  # once
    watch.restart()  # a plan made from real steps is not checked again
    for _ in range(WARMUP + WINDOW):
        watch.observe(PLAN, _measured(PLAN, 1.0))
    assert watch.balance_check() is None


def test_a_first_plan_out_of_balance_moves_and_one_in_balance_stays() -> None:
    plan = plan_tp(FINE, PROFILES, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    # The slow device is 40 % slower in real steps than its calibration said, from the
    # start (no change for the change detector to see): the plan moves units to the fast one.
    watch = _watched(plan, 1.4, WARMUP + WINDOW)
    assert watch.changed() is None
    moved = propose(watch, PROFILES, plan, FINE, CHUNKS, steps_left=1000, move_s=1.0)
    assert moved is not None and moved.why == "balance"
    assert moved.then_s < (1 - BALANCE_GAIN) * moved.now_s
    assert moved.relative[1] == 1.0 and moved.relative[0] < 1.0  # the slow one is the busiest
    assert sum(moved.plan.split(s)[1] for s in SEGMENTS) < sum(plan.split(s)[1] for s in SEGMENTS)
    # checked once: the same steps again propose nothing
    assert propose(watch, PROFILES, plan, FINE, CHUNKS, steps_left=1000, move_s=1.0) is None
    # as calibrated: nothing to gain
    calm = _watched(plan, 1.0, WARMUP + WINDOW)
    assert propose(calm, PROFILES, plan, FINE, CHUNKS, steps_left=1000, move_s=1.0) is None


def test_the_balance_move_must_gain_enough_and_pay_for_itself() -> None:
    plan = plan_tp(FINE, PROFILES, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    # 10 % off: the refitted plan differs and would pay over many steps, but it saves less
    # than BALANCE_GAIN, within what the calibration itself varies by.
    watch = _watched(plan, 1.1, WARMUP + WINDOW)
    fitted = fit(PROFILES, list(watch.rounds))
    other = plan_tp(FINE, fitted, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    assert any(other.split(s) != plan.split(s) for s in SEGMENTS)
    now, then = predict(plan, fitted)["step_time_s"], predict(other, fitted)["step_time_s"]
    assert 0 < now - then < BALANCE_GAIN * now
    assert propose(watch, PROFILES, plan, FINE, CHUNKS, steps_left=100_000, move_s=1.0) is None
    # 40 % off gains enough, but not over 2 steps left
    watch = _watched(plan, 1.4, WARMUP + WINDOW)
    assert propose(watch, PROFILES, plan, FINE, CHUNKS, steps_left=2, move_s=1.0) is None


def test_a_few_stretched_steps_in_the_window_do_not_move_a_balanced_plan() -> None:
    plan = plan_tp(FINE, PROFILES, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    # The plan is balanced as calibrated, but a busy host stretched the slow device's
    # compute 2.5-fold in two of the window's eight steps (the kind of stretch seen on a
    # shared host during warm-up). Pooled as a mean, those two steps read as a device 38 %
    # slower and the check would move units off it; its median steps say it is not.
    watch = SpeedWatch()
    for step in range(WARMUP + WINDOW):
        stretched = step in (WARMUP + 1, WARMUP + 5)
        watch.observe(plan, _measured(plan, 2.5 if stretched else 1.0))
    assert watch.changed() is None
    pooled = fit(PROFILES, list(watch.rounds))  # the mean's reading moves the plan ...
    moved = plan_tp(FINE, pooled, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    now, then = predict(plan, pooled)["step_time_s"], predict(moved, pooled)["step_time_s"]
    assert now - then >= BALANCE_GAIN * now
    # ... the check, reading the medians, keeps it
    assert propose(watch, PROFILES, plan, FINE, CHUNKS, steps_left=1000, move_s=1.0) is None


def test_typical_round_is_the_median_per_device_and_segment() -> None:
    rounds = [Round(PLAN, _times(1.0, s)) for s in (1.0, 1.2, 5.0)]
    (one,) = typical(rounds)
    assert one.weight == 3.0
    assert one.measured == _times(1.0, 1.2)
    # rounds of different plans stay as they are: pooling them is what fits the curves
    other = Plan.even(CFG, ("slow", "fast"))
    assert typical([*rounds, Round(other, _times(1.0, 1.0))]) == [
        *rounds,
        Round(other, _times(1.0, 1.0)),
    ]


def test_a_balance_move_whose_steps_came_out_slower_is_undone_once_it_pays() -> None:
    before = plan_tp(FINE, PROFILES, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    undo = Undo(before, step_s=0.300)
    # the eight steps after the move: 6 % slower than the eight before it
    back = undo.due([0.318] * WINDOW, steps_left=1000, move_s=2.0)
    assert back is not None and back.why == "undo" and back.plan == before
    assert (back.now_s, back.then_s) == (0.318, 0.300)  # measured after, before
    # the median, not the mean: one stretched step of eight is not a slower plan
    assert undo.due([0.300] * (WINDOW - 1) + [0.600], steps_left=1000, move_s=2.0) is None
    # within what eight-step medians of one plan stray by: kept
    slower = 0.300 * (1 + UNDO_MARGIN) * 0.999
    assert undo.due([slower] * WINDOW, steps_left=1000, move_s=2.0) is None
    # 18 ms a step over 100 steps saves 1.8 s: less than twice a 2 s move
    assert undo.due([0.318] * WINDOW, steps_left=100, move_s=2.0) is None
