"""``auto``'s second look at a heterogeneous tensor-parallel candidate: plan again from its
own trial steps.

Calibration (:mod:`xronos.profiler.calibrate`) plans from a few forward + backward passes
taken seconds before the trials. On a host whose speed strays for seconds at a time those
passes can leave the plan out of balance (measured on ``ci-2dev`` at 1 Gbit/s: query heads
12 : 4 where 13 : 3 balances, the fast device idle 95 ms a step; ``auto`` then found the
plan no faster than the fast device alone, and trained alone). The trial steps are whole
steps of that plan, update included, timed per segment like calibration's passes
(:func:`~xronos.planner.calibrate.segment_times`). Fitting the profiles to their medians
(calibration's own :func:`~xronos.planner.calibrate.fit`, through the live balance check's
:func:`~xronos.run.rebalance.replan`) and planning again gives the plan those steps call
for.
Where it differs and is predicted at least :data:`REFINE_GAIN` faster,
:mod:`xronos.run.trials` tries it too, against the same contenders, and the faster
measured of the two plans stands for the candidate. Nothing moves: the trials' sessions
are thrown away anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from xronos.config import ModelConfig
from xronos.planner.calibrate import Round
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.profile import DeviceProfile
from xronos.run.rebalance import replan

REFINE_GAIN = 0.02
"""Least predicted saving, as a fraction of the step, for which a trial's re-plan is raced.
Lower than a running plan's bar for a move (:data:`~xronos.run.rebalance.BALANCE_GAIN`,
5 %): a race moves nothing and costs only trial steps. On ``ci-2dev`` two calibrations of
one run can land an MLP unit apart (``47 : 17`` against ``48 : 16``), and the bench's
``auto`` ran the first 4 % slower than ``xronos`` ran the second (two runs), while a refit
predicts a one-unit move to save only 1–3 % of the step (the planner's model has the
barriers' compute, not the waits a busy host adds) — under the 5 % bar, never raced."""

StepTimes = list[dict[str, float]]
"""One step: every member's compute seconds per segment, in the group's rank order."""


@dataclass(frozen=True)
class Refinement:
    """A candidate's plan as tried, the plan its trial steps call for, and what each was
    predicted (from the profiles fitted to those steps) and measured to take."""

    key: str
    """The candidate (``strategy:ranks``)."""
    before: Plan
    after: Plan
    predicted_before_s: float
    predicted_after_s: float
    measured_before_s: float | None = None
    measured_after_s: float | None = None

    @property
    def kept(self) -> Plan:
        """The plan that stands for the candidate: the faster measured (``before`` while
        either is unmeasured)."""
        if self.measured_before_s is None or self.measured_after_s is None:
            return self.before
        return self.after if self.measured_after_s < self.measured_before_s else self.before

    def to_dict(self) -> dict[str, Any]:
        def units(p: Plan) -> dict[str, list[int]]:
            return {s: list(p.split(s)) for s in SEGMENTS}

        return {
            "candidate": self.key,
            "before": units(self.before),
            "after": units(self.after),
            "predicted_before_s": self.predicted_before_s,
            "predicted_after_s": self.predicted_after_s,
            "measured_before_s": self.measured_before_s,
            "measured_after_s": self.measured_after_s,
            "kept": "after" if self.kept is self.after else "before",
        }


def refine(
    key: str,
    cfg: ModelConfig,
    profiles: Sequence[DeviceProfile],
    plan: Plan,
    steps: Sequence[StepTimes],
    chunks: tuple[int, int],
) -> Refinement | None:
    """The plan that ``steps`` (trial steps of ``plan``) call for, when it differs from
    ``plan`` and is predicted at least :data:`REFINE_GAIN` faster; else None.

    Args:
        key: the candidate's name in the trials.
        profiles: the members' profiles as measured (the fit rescales them, as calibration
            does, rather than compounding corrections).
        steps: what each timed trial step measured.
        chunks: ``(mlp_chunk, vocab_chunk)``, the planner's unit sizes.
    """
    if not steps or plan.world_size < 2:
        return None
    found = replan(profiles, [Round(plan, list(times)) for times in steps], plan, cfg, chunks)
    if found is None:
        return None
    new, now_s, then_s = found
    if now_s - then_s < REFINE_GAIN * now_s:
        return None
    return Refinement(key, plan, new, now_s, then_s)
