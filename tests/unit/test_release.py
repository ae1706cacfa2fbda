"""When ``auto``'s run goes on with fewer devices (:mod:`xronos.run.release`): once the
steps it measures cost more than the fewer devices are predicted to, by enough to matter
and to pay for the move — and not while the collaboration pays."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.test_rebalance_watch import CHUNKS, FINE, true_times
from tests.unit.test_rebalance_watch import speed_profile as profile
from xronos.planner import plan_tp
from xronos.planner.calibrate import Round
from xronos.planner.plan import SEGMENTS, Plan, segment_units
from xronos.planner.profile import DeviceProfile
from xronos.run.rebalance import WINDOW
from xronos.run.release import RELEASE_GAIN, release_to

PAIR = [profile("fast", 1.0), profile("slow", 0.4)]


def _steps(
    profiles: list[DeviceProfile], plan: Plan, factors: list[float], wire_s: float = 0.0
) -> tuple[list[Round], list[float]]:
    """A window of steps of ``plan`` where device ``i`` computes ``factors[i]`` × its
    profile: each device's compute per segment, and the step's wall time (every segment
    ends at its slowest device's barrier, plus ``wire_s`` of transfer a step)."""
    times = [
        true_times(p, dict.fromkeys(SEGMENTS, k), plan, i)
        for i, (p, k) in enumerate(zip(profiles, factors, strict=True))
    ]
    wall = sum(max(t[s] for t in times) for s in [*SEGMENTS, "other"]) + wire_s
    return [Round(plan, times)] * WINDOW, [wall] * WINDOW


def _release(
    profiles: list[DeviceProfile],
    factors: list[float],
    wire_s: float = 0.0,
    *,
    keep_first: bool = False,
    steps_left: int = 1000,
) -> tuple[tuple[int, ...], Plan, float, float] | None:
    plan = plan_tp(FINE, profiles, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    rounds, durations = _steps(profiles, plan, factors, wire_s)
    found = release_to(
        FINE,
        profiles,
        rounds,
        durations,
        CHUNKS,
        keep_first=keep_first,
        steps_left=steps_left,
        move_s=1.0,
    )
    if found is None:
        return None
    fewer, measured = found
    return fewer.keep, fewer.plan, fewer.predicted_s, measured


def _alone(p: DeviceProfile) -> float:
    """The whole model on one device, as its profile says."""
    return p.step_time(segment_units(FINE, *CHUNKS))


def test_a_collaboration_that_pays_keeps_its_devices() -> None:
    # as profiled, the pair beats the fast device alone by far (0.4 of its speed joins it)
    assert _release(PAIR, [1.0, 1.0]) is None


def test_a_device_that_became_much_slower_is_released() -> None:
    # another program took four fifths of the slow device: the barriers wait on it
    found = _release(PAIR, [1.0, 5.0])
    assert found is not None
    keep, plan, predicted, measured = found
    assert keep == (0,) and plan.strategy == "single" and plan.devices == ("fast",)
    # its compute as the steps showed it, with the step's tail that no split shares
    tail = true_times(PAIR[0], dict.fromkeys(SEGMENTS, 1.0), plan, 0)["other"]
    assert predicted == pytest.approx(_alone(PAIR[0]) + tail)
    assert predicted <= (1 - RELEASE_GAIN) * measured


def test_a_link_that_became_slow_releases_though_no_device_computes_slower() -> None:
    # Compute exactly as profiled; the steps' wall time is what shows the wire: the pair's
    # barriers take ~0.76 of the fast device alone, and 0.5 of it more on the wire leaves
    # the pair slower than the fast device would be alone.
    single = _alone(PAIR[0])
    assert _release(PAIR, [1.0, 1.0], wire_s=0.1 * single) is None
    found = _release(PAIR, [1.0, 1.0], wire_s=0.5 * single)
    assert found is not None and found[0] == (0,)


def test_a_release_must_gain_enough_and_pay_for_itself() -> None:
    single = _alone(PAIR[0])
    rounds_plan = plan_tp(FINE, PAIR, mlp_chunk=CHUNKS[0], vocab_chunk=CHUNKS[1])
    _, (wall, *_) = _steps(PAIR, rounds_plan, [1.0, 1.0])
    # measured just 3 % over the fast device alone: within the noise of a window of steps
    assert _release(PAIR, [1.0, 1.0], wire_s=1.03 * single - wall) is None
    # far over it (~1.9 s a step to save), but with one step left the move (1 s) would not
    # pay twice over
    assert _release(PAIR, [1.0, 5.0], steps_left=1) is None


def test_the_coordinator_is_never_released() -> None:
    # the slow device is rank 0, the coordinator of a multi-host run: it stays, and alone
    # it is slower than the pair (whose wire costs as much as the fast device's whole step),
    # so the run keeps both; where any device may go, the fast one goes on alone
    pair = [profile("slow", 0.4), profile("fast", 1.0)]
    assert _release(pair, [1.0, 1.0], wire_s=_alone(pair[1]), keep_first=True) is None
    found = _release(pair, [1.0, 1.0], wire_s=_alone(pair[1]))
    assert found is not None and found[0] == (1,)


def test_of_three_devices_the_two_that_pay_go_on_together() -> None:
    trio = [profile("nuc", 1.0), profile("gateway", 0.8), profile("pi", 0.3)]
    found = _release(trio, [1.0, 1.0, 8.0])
    assert found is not None
    keep, plan, _, _ = found
    assert keep == (0, 1) and plan.strategy == "xronos" and plan.devices == ("nuc", "gateway")


def test_a_device_that_cannot_hold_the_model_alone_is_not_left_alone() -> None:
    # the fast device's memory cap leaves it too little for the whole model: going on alone
    # is no option however slow the other device became
    units = segment_units(FINE, *CHUNKS)
    per_unit = {s: 1000 for s in SEGMENTS}
    whole = sum(per_unit[s] * units[s] for s in SEGMENTS)
    capped = dataclasses.replace(PAIR[0], unit_bytes=per_unit, memory_bytes=whole * 3 // 4)
    assert _release([capped, PAIR[1]], [1.0, 5.0]) is None
    assert _release([PAIR[0], PAIR[1]], [1.0, 5.0]) is not None  # the cap is what keeps it
