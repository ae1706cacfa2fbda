"""When a pipeline starts again: the speed watch on each device's compute, the planner's
forecast at the observed speeds (or at the first steps' against the plan's prediction), and
whether a restart pays for itself. The decision alone; the restart is the returning
device's path (tests/unit/test_elastic.py, tests/e2e/test_device_lost.py)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

import pytest

from xronos.comm.mappings import TPGroup
from xronos.metrics.records import Span, StepRecord
from xronos.planner.replan import Forecast
from xronos.run.rebalance import COOLDOWN, FIRST_MOVE_STEPS
from xronos.run.restage import Restager, device_compute


def _records(step: int, compute: dict[str, float]) -> list[StepRecord]:
    """One step's records: each device computes its seconds in two spans, the step lasts
    the longest compute plus a little."""
    top = max(compute.values())
    return [
        StepRecord(
            r,
            name,
            step,
            0.0,
            top + 0.01,
            computes=(Span("fwd:mb0", 0.0, c / 2, "compute"), Span("bwd:mb0", c / 2, c, "compute")),
        )
        for r, (name, c) in enumerate(compute.items())
    ]


def test_each_device_computes_the_sum_of_its_spans() -> None:
    got = device_compute(_records(1, {"fast": 0.3, "slow": 0.5}), ["slow", "fast", "gone"])
    assert got == pytest.approx([0.5, 0.3, 0.0])


class Planner:
    """The planner's view: each device predicted to compute 0.3 s a step; the running
    plan's step grows with the slow device's factor against the fast one's, the best
    plan's by a third of that; it keeps every factor it was asked about."""

    def __init__(self) -> None:
        self.asked: list[dict[str, float]] = []

    def compute_s(self) -> dict[str, float]:
        return {"fast": 0.3, "slow": 0.3}

    def forecast(self, factors: Mapping[str, float]) -> Forecast:
        self.asked.append(dict(factors))
        slow = factors["slow"] / factors["fast"]
        return Forecast(0.3 * slow, 0.3 * (1 + (slow - 1) / 3), "pp-1f1b [slow -> fast]")


def _run(
    steps: int, opened_s: float, slow_after: float
) -> tuple[int | None, list[dict[str, Any]], Planner]:
    """A 2-stage pipeline stepping at balance, the slow device's compute multiplied by
    ``slow_after`` from step 40; the step at which the run would start again (None: never),
    what it emitted, and what the planner was asked."""
    said: list[dict[str, Any]] = []
    planner = Planner()
    watch = Restager(["fast", "slow"], planner, steps, opened_s, said.append, balance=False)
    for step in range(1, steps + 1):
        slow = 0.3 * (slow_after if step > 40 else 1.0)
        if watch.after(step, TPGroup(), _records(step, {"fast": 0.3, "slow": slow})):
            return step, said, planner
    return None, said, planner


def test_a_lasting_change_the_planner_can_use_starts_the_run_again() -> None:
    step, said, planner = _run(400, opened_s=10.0, slow_after=2.0)
    # once half the recent window (8 steps) holds the new speed its median moves; the
    # watch is asked every 4 steps, and not before the cooldown
    assert step is not None and 44 <= step <= 52 and step >= COOLDOWN
    [ev] = said
    assert ev["kind"] == "restage" and ev["step"] == step and ev["pays"]
    assert ev["relative"]["slow"] > 1.25 and ev["relative"]["fast"] < 1.0
    # the planner saw each device's compute over its baseline: the slow one's doubled
    assert planner.asked[-1] == pytest.approx({"fast": 1.0, "slow": 2.0})
    assert (ev["now_s"], ev["best_s"]) == pytest.approx((0.6, 0.4))
    # the saving is the measured step's (the slow device's 0.6 s and a little) times the
    # fraction the planner saves, a third
    slow = statistics.median(0.3 * (2.0 if s > 40 else 1.0) for s in range(step - 7, step + 1))
    assert ev["saving_s"] == pytest.approx((slow + 0.01) / 3)
    assert ev["restart_s"] == pytest.approx(10.0 + FIRST_MOVE_STEPS * (slow + 0.01))


def test_no_restart_that_does_not_pay_nor_for_noise() -> None:
    # the same change with 70 steps left does not pay for a 60 s start twice over: the
    # offer is logged, once (its speeds are the baseline now)
    step, said, planner = _run(120, opened_s=60.0, slow_after=2.0)
    assert step is None and planner.asked
    [ev] = said
    assert ev["kind"] == "restage_kept" and not ev["pays"] and ev["why"] == "change"
    assert ev["saving_s"] * ev["left"] <= 2 * ev["restart_s"]
    assert ev["held"].endswith(f"not twice the {ev['restart_s']:.1f} s to start again")
    # 10 % slower: below the watch's threshold, the planner is not even asked
    step, said, planner = _run(400, opened_s=10.0, slow_after=1.1)
    assert (step, said, planner.asked) == (None, [], [])


def test_a_change_the_planner_cannot_use_keeps_the_plan() -> None:
    said: list[dict[str, Any]] = []

    class Same(Planner):  # no better plan at any speed
        def forecast(self, factors: Mapping[str, float]) -> Forecast:
            return Forecast(0.6, 0.6, "pp-1f1b [slow -> fast]")

    watch = Restager(["fast", "slow"], Same(), 400, 1.0, said.append)
    for step in range(1, 401):
        slow = 0.3 * (3.0 if step > 40 else 1.0)
        assert not watch.after(step, TPGroup(), _records(step, {"fast": 0.3, "slow": slow}))
    # the first plan's balance check (as predicted: nothing to gain), then the change,
    # once: it is the baseline after
    balance, change = said
    assert (
        balance["step"] == 12 and balance["why"] == "balance" and balance["held"].startswith("0%")
    )
    assert change["why"] == "change" and change["step"] > 40
    assert all(e["kind"] == "restage_kept" and e["saving_s"] == 0.0 for e in said)


def _first_steps(
    slow: float, balance: bool = True, steps: int = 400
) -> tuple[int | None, list[dict[str, Any]]]:
    """A pipeline whose slow device computes ``slow`` s a step from its first step, where
    the plan predicted 0.3 s on both: the step at which the run starts again, and what it
    emitted."""
    said: list[dict[str, Any]] = []
    watch = Restager(["fast", "slow"], Planner(), steps, 5.0, said.append, balance=balance)
    for step in range(1, 41):
        if watch.after(step, TPGroup(), _records(step, {"fast": 0.3, "slow": slow})):
            return step, said
    return None, said


def test_a_first_plan_out_of_balance_with_its_prediction_starts_again_at_once() -> None:
    # the baseline is in after 2 + 8 steps; the first agreement after it is at step 12
    step, said = _first_steps(0.45)
    [ev] = said
    assert step == 12 and ev["why"] == "balance" and ev["pays"]
    # its compute over its prediction: the slow device 1.5, the fast one 1
    assert ev["relative"] == pytest.approx({"fast": 1.0, "slow": 1.5})
    assert (ev["now_s"], ev["best_s"]) == pytest.approx((0.45, 0.35))


def test_the_balance_check_needs_a_real_gain_and_a_first_start() -> None:
    # 3 % slower than predicted: the best plan would save 2 %, under BALANCE_GAIN, though
    # over a million steps it would pay for the restart
    step, said = _first_steps(0.309, steps=10**6)
    [ev] = said
    assert step is None and ev["kind"] == "restage_kept" and ev["step"] == 12
    assert ev["held"] == "2% faster, under the 5% a first plan's restart needs"
    assert ev["saving_s"] * ev["left"] > 2 * ev["restart_s"]
    # a start after a restart (resumed) does not check its first plan again
    assert _first_steps(0.45, balance=False) == (None, [])
