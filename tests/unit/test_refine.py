"""``auto``'s re-plan from a candidate's own trial steps (pure functions)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.test_calibrate import _profile, _true_times
from xronos.config import small
from xronos.planner import plan_tp
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.profile import DeviceProfile
from xronos.planner.solve import predict
from xronos.run.rebalance import BALANCE_GAIN
from xronos.run.refine import REFINE_GAIN, Refinement, StepTimes, refine

CFG = small()
CHUNKS = (32, 32)


def _steps(profiles: list[DeviceProfile], slowdown: list[float], plan: Plan) -> StepTimes:
    """What each device measures in one step of ``plan`` when it runs ``slowdown`` × its
    profile."""
    return [
        _true_times(p, dict.fromkeys(SEGMENTS, k), plan, i)
        for i, (p, k) in enumerate(zip(profiles, slowdown, strict=True))
    ]


def test_steps_of_an_unbalanced_plan_call_for_the_balanced_one() -> None:
    """Calibration planned for a slow device at 0.4 of the fast one; the trial steps show it
    at 0.25 (its whole compute 1.6 × the profile's). The re-plan is the plan for the speeds
    the steps show, and it is predicted faster by more than the bar."""
    profiles = [_profile("fast", 1.0), _profile("slow", 0.4)]
    plan = plan_tp(CFG, profiles, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    steps = [_steps(profiles, [1.0, 1.6], plan)] * 3
    got = refine("xronos:0,1", CFG, profiles, plan, steps, CHUNKS)
    assert got is not None
    truth = [profiles[0], _profile("slow", 0.25)]
    want = plan_tp(CFG, truth, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    assert all(got.after.split(s) == want.split(s) for s in SEGMENTS)
    assert sum(got.after.split("mlp")[1:]) < sum(plan.split("mlp")[1:])  # less on the slow one
    assert got.predicted_after_s < (1 - REFINE_GAIN) * got.predicted_before_s
    # the predictions are the planner's, at the speeds the steps show
    assert got.predicted_before_s == pytest.approx(predict(plan, truth)["step_time_s"], rel=0.02)


def test_steps_that_agree_with_the_plan_change_nothing() -> None:
    profiles = [_profile("fast", 1.0), _profile("slow", 0.4)]
    plan = plan_tp(CFG, profiles, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    # both devices 10 % slower than profiled: the balance is the same
    steps = [_steps(profiles, [1.1, 1.1], plan)] * 3
    assert refine("xronos:0,1", CFG, profiles, plan, steps, CHUNKS) is None


def test_a_one_unit_move_below_the_move_bar_is_raced() -> None:
    """The slow device 10 % slower than calibrated: the steps call for one MLP unit less on
    it, predicted to save more than the trial bar but less than a live move's bar — a trial
    races it (nothing moves), where a running plan would keep its own."""
    assert REFINE_GAIN < BALANCE_GAIN
    profiles = [_profile("fast", 1.0), _profile("slow", 0.4)]
    plan = plan_tp(CFG, profiles, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    steps = [_steps(profiles, [1.0, 1.1], plan)] * 3
    got = refine("xronos:0,1", CFG, profiles, plan, steps, CHUNKS)
    assert got is not None
    assert got.after.split("mlp")[1] == plan.split("mlp")[1] - 1
    gain = 1 - got.predicted_after_s / got.predicted_before_s
    assert REFINE_GAIN <= gain < BALANCE_GAIN


def test_a_small_gain_is_not_worth_a_second_trial() -> None:
    """Steps a little off the plan's balance (the slow device 4 % slower than profiled):
    another plan may be a few vocabulary units better, but not by the trial bar."""
    profiles = [_profile("fast", 1.0), _profile("slow", 0.4)]
    plan = plan_tp(CFG, profiles, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    steps = [_steps(profiles, [1.0, 1.04], plan)] * 3
    assert refine("xronos:0,1", CFG, profiles, plan, steps, CHUNKS) is None


def test_no_steps_or_one_device_nothing_to_refine() -> None:
    profiles = [_profile("fast", 1.0), _profile("slow", 0.4)]
    plan = plan_tp(CFG, profiles, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    assert refine("xronos:0,1", CFG, profiles, plan, [], CHUNKS) is None
    alone = plan_tp(CFG, profiles[:1], mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    steps = [_steps(profiles[:1], [2.0], alone)]
    assert refine("xronos:0", CFG, profiles[:1], alone, steps, CHUNKS) is None


def test_the_faster_measured_plan_is_kept_and_reported() -> None:
    profiles = [_profile("fast", 1.0), _profile("slow", 0.4)]
    before = plan_tp(CFG, profiles, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    after = plan_tp(
        CFG, [profiles[0], _profile("slow", 0.25)], mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1]
    )
    r = Refinement("xronos:0,1", before, after, 0.5, 0.4)
    assert r.kept is before  # not measured yet: the plan as tried stands
    faster = dataclasses.replace(r, measured_before_s=0.52, measured_after_s=0.41)
    slower = dataclasses.replace(r, measured_before_s=0.41, measured_after_s=0.52)
    assert faster.kept is after and slower.kept is before
    d = faster.to_dict()
    assert d["kept"] == "after" and d["candidate"] == "xronos:0,1"
    assert d["before"]["mlp"] == list(before.split("mlp"))
    assert d["after"]["mlp"] == list(after.split("mlp"))
    assert (d["measured_before_s"], d["measured_after_s"]) == (0.52, 0.41)
