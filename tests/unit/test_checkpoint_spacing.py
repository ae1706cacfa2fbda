"""Checkpoint spacing without --save-every: a lost device costs at most about a minute of
training; --save-every N is taken as given; only the newest automatic checkpoints stay."""

from __future__ import annotations

from pathlib import Path

import pytest

from xronos.checkpoint import checkpoint_path, complete_checkpoints, prune_checkpoints
from xronos.run.spacing import LOSS_BUDGET_S, TIMED_STEPS, CheckpointSpacing, checkpoint_interval


@pytest.mark.parametrize(
    ("step_s", "interval"),
    [(0.15, 400), (0.5, 120), (7.0, 8), (59.9, 1), (60.0, 1), (600.0, 1)],
)
def test_interval_fits_the_budget(step_s: float, interval: int) -> None:
    assert checkpoint_interval(step_s) == interval


@pytest.mark.parametrize("step_s", [0.013, 0.15, 0.7, 3.3, 29.0, 59.0])
def test_interval_is_the_most_steps_within_the_budget(step_s: float) -> None:
    k = checkpoint_interval(step_s)
    assert k * step_s <= LOSS_BUDGET_S < (k + 1) * step_s


@pytest.mark.parametrize("step_s", [0.0, -1.0, float("nan"), float("inf")])
def test_interval_needs_a_step_time(step_s: float) -> None:
    with pytest.raises(ValueError):
        checkpoint_interval(step_s)


class FakeClock:
    def __init__(self, times: list[float]) -> None:
        self.times = iter(times)

    def __call__(self) -> float:
        return next(self.times)


def _due(spacing: CheckpointSpacing, steps: int, agree: list[float]) -> list[int]:
    def agreed(mine: float) -> float:
        agree.append(mine)
        return max(mine, 3.0)  # another rank was slower: every rank takes the slowest's

    return [s for s in range(1, steps + 1) if spacing.due(s, agreed)]


def test_automatic_spacing_from_the_measured_steps() -> None:
    # step 1 ends at 10 s (warm-up, not timed); then steps of 2, 2, 9, 2 s: median 2 s
    ends = [10.0, 12.0, 14.0, 23.0, 25.0] + [25.0 + 2 * k for k in range(1, 200)]
    spacing = CheckpointSpacing(None, clock=FakeClock(ends))
    agree: list[float] = []
    due = _due(spacing, 100, agree)
    assert agree == [2.0]  # asked once, with this rank's median, after TIMED_STEPS steps
    assert spacing.step_s == 3.0 and spacing.interval == 20  # the slowest rank's: 60 / 3
    assert due == [20, 40, 60, 80, 100]
    assert spacing.automatic


def test_nothing_is_due_before_the_steps_are_timed() -> None:
    spacing = CheckpointSpacing(None, clock=FakeClock([float(k) for k in range(100)]))
    agree: list[float] = []
    assert _due(spacing, TIMED_STEPS, agree) == [] and agree == []
    assert spacing.interval is None


@pytest.mark.parametrize(("every", "want"), [(5, [5, 10, 15]), (0, [])])
def test_save_every_is_taken_as_given(every: int, want: list[int]) -> None:
    spacing = CheckpointSpacing(every, clock=FakeClock([]))  # the clock is never read
    agree: list[float] = []
    assert _due(spacing, 17, agree) == want and agree == []
    assert not spacing.automatic


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        d = checkpoint_path(tmp_path, step)
        d.mkdir(parents=True)
        (d / "COMPLETE").write_text("{}")
    unfinished = checkpoint_path(tmp_path, 50)
    unfinished.mkdir()  # a save cut short: not a checkpoint, not pruned
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step-00000010", "step-00000020"]
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [30, 40]
    assert unfinished.is_dir() and not checkpoint_path(tmp_path, 10).exists()
