"""Releasing devices that no longer pay: ``auto``'s tensor-parallel run goes on with fewer
devices — the fastest alone, or a subset — once its own steps show that the collaboration
costs more than it saves (another program took a device's CPU, a link got slower). A
released device takes no part in the run from the next step, not even in its collectives.

    every re-balancing check (:mod:`xronos.run.rebalance`)
      measured  = the median of the last WINDOW steps, as they ran (compute, waits, wire)
      fitted    = the profiles fitted to those steps' compute (the re-plan's own fit)
      candidate = the best plan over each proper subset of the devices (the exact planner;
                  one device: its whole model, no transfer)
    candidate ≤ (1 − RELEASE_GAIN) × measured, and the saving over the steps left is more
    than twice a move's cost  ─► narrow: checkpoint, the kept devices load it, the rest leave

**Measured against predicted, on purpose.** The run's own step is the truth about the
current plan (it holds every wait and every transfer the model may miss); the candidate
can only be predicted. Its compute comes from the same steps, timed while every device
computed at once, which on a shared host errs slow: a device alone would run faster. So
the comparison leans towards keeping the collaboration; :data:`RELEASE_GAIN` keeps a few
per cent of the steps' noise from releasing a device that pays. A release is for the rest
of the run (a released device is not taken back).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.planner import plan_tp
from xronos.planner.calibrate import Round, fit, typical
from xronos.planner.memory import fits_alone
from xronos.planner.plan import Plan, segment_units
from xronos.planner.profile import DeviceProfile
from xronos.planner.solve import predict

RELEASE_GAIN = 0.05
"""Least predicted saving, as a fraction of the measured step, for which devices are
released: the median of a window of steps on a shared host carries a few per cent of
noise, and a release is not undone."""


@dataclass(frozen=True)
class Fewer:
    """The best plan over a proper subset of a run's devices."""

    keep: tuple[int, ...]
    """The devices kept, as ranks of the run's group."""
    plan: Plan
    predicted_s: float


def fewer_devices(
    cfg: ModelConfig,
    profiles: Sequence[DeviceProfile],
    chunks: tuple[int, int],
    keep_first: bool = False,
) -> Fewer | None:
    """The fastest predicted plan over a proper subset of the devices of ``profiles`` (in
    group-rank order) that fits their memory; ``keep_first``: only subsets with rank 0 (the
    coordinator of a multi-host run). None with one device."""
    totals = segment_units(cfg, *chunks)
    best: Fewer | None = None
    for k in range(1, len(profiles)):
        for ranks in combinations(range(len(profiles)), k):
            if keep_first and 0 not in ranks:
                continue
            found = _plan_on(cfg, [profiles[r] for r in ranks], chunks, totals)
            if found is not None and (best is None or found[1] < best.predicted_s):
                best = Fewer(ranks, *found)
    return best


def _plan_on(
    cfg: ModelConfig,
    members: list[DeviceProfile],
    chunks: tuple[int, int],
    totals: dict[str, int],
) -> tuple[Plan, float] | None:
    """The plan over ``members`` and its predicted step, or None where it does not fit."""
    if len(members) == 1:
        p = members[0]
        if not fits_alone(p, totals):
            return None
        alone = Plan.from_shares(cfg, [1.0], [p.name], "single", *chunks)
        return alone, p.step_time(totals)
    try:
        plan = plan_tp(cfg, members, mlp_chunk=chunks[0], vocab_chunk=chunks[1])
    except UserError:  # the members cannot hold the model between them (memory caps)
        return None
    return plan, float(predict(plan, members)["step_time_s"])


def release_pays(measured_s: float, fewer: Fewer, steps_left: int, move_s: float) -> bool:
    """Whether going on with ``fewer`` saves at least :data:`RELEASE_GAIN` of the measured
    step, and more than twice the move's cost over the steps left."""
    saving = measured_s - fewer.predicted_s
    return saving >= RELEASE_GAIN * measured_s and saving * steps_left > 2.0 * move_s


def release_to(
    cfg: ModelConfig,
    profiles: Sequence[DeviceProfile],
    rounds: Sequence[Round],
    durations: Sequence[float],
    chunks: tuple[int, int],
    *,
    keep_first: bool,
    steps_left: int,
    move_s: float,
    replan: tuple[float, float] | None = None,
) -> tuple[Fewer, float] | None:
    """The release that the steps ``rounds`` (each device's compute per segment) and
    ``durations`` (their wall times) call for, where it pays, and the measured step (the
    median of ``durations``); None where the run should keep its devices. ``replan``: the
    predicted step now and after the re-plan over every device that the same check found,
    which a release must beat on the same footing (scaled to the measured step)."""
    if not rounds or not durations:
        return None
    measured = statistics.median(durations)
    fitted = fit(list(profiles), typical(rounds))
    found = fewer_devices(cfg, fitted, chunks, keep_first)
    if found is None or not release_pays(measured, found, steps_left, move_s):
        return None
    if replan is not None and found.predicted_s >= replan[1] * measured / replan[0]:
        return None
    return found, measured
