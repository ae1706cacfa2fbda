"""When live re-balancing sees a persistent change in a device's speed, and only then."""

from __future__ import annotations

from xronos.config import ModelConfig
from xronos.planner.plan import Plan
from xronos.run.rebalance import COOLDOWN, WARMUP, WINDOW, SpeedWatch

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
