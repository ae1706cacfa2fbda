"""Live re-balancing: when a device's speed changes for good, re-plan and move the units
between two steps, without restarting the workers.

    every step's records ─► SpeedWatch: each device's compute, baseline vs recent window
    a persistent change  ─► fit the profiles to the recent steps ─► plan_tp
    pays for itself?     ─► move: checkpoint in memory, the new shard, load ─► go on

**Persistent, relative, with hysteresis.** The baseline is each device's median compute
over :data:`WINDOW` steps after the plan (the first steps, still warming up, left out);
the recent value is the median over the last :data:`WINDOW` steps, so a spike of a few
steps moves nothing. Only a change of one device *relative to the others* counts (its
factor, now over baseline, against the median factor of the other devices) — a host that
slows every device alike leaves the best split as it is — and only by more than
:data:`THRESHOLD`. After a move the baseline starts again, and the next move waits at
least :data:`COOLDOWN` steps.

**A plan that starts out of balance.** The first plan comes from a few calibration passes
on a host whose speed strays; once its baseline is in, it is checked once against those
steps (the same refit and planner): a plan predicted to be at least :data:`BALANCE_GAIN`
faster moves the run too, if it pays for itself. A plan made from real steps (after a
move) is not checked again.

**Pays for itself.** The profiles are refitted to the recent steps (their medians, per
device and segment) with calibration's own fit (:func:`xronos.planner.calibrate.fit`), the
exact planner plans again, and the move goes ahead only when the predicted saving per
step, over the steps left, exceeds twice what a move costs (measured at the last move;
before any, :data:`FIRST_MOVE_STEPS` steps).

**Judged by its steps.** A balance move rests on a prediction from eight steps; where the
eight after it (past their warm-up) step slower than the eight before by more than
:data:`UNDO_MARGIN`, the run moves back to the plan before, if that pays for itself, and
stays there (a change of a device's speed may still move it).

**The move** (:mod:`xronos.run.moves`) checkpoints the training state in memory and
loads it under the new plan on the same ranks; where even that would pass a device's
memory cap (:func:`~xronos.run.moves.move_peaks`), the run keeps its plan and says so (a
move would get the device killed). In ``auto``'s runs the same check may also release
devices that no longer pay for their part (:mod:`xronos.run.release`).
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xronos.config import ModelConfig
from xronos.metrics.records import StepRecord
from xronos.planner import plan_tp
from xronos.planner.calibrate import Round, fit, segment_times, typical
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.profile import DeviceProfile
from xronos.planner.solve import predict
from xronos.run.moves import capped, move, move_held, move_prefix, narrow
from xronos.run.release import release_to
from xronos.train.loop import LEAVE, Leave
from xronos.train.tp import TPSession

WINDOW = 8
"""Steps in the baseline and in the recent window."""
WARMUP = 2
"""Steps after a plan that the baseline leaves out."""
THRESHOLD = 0.25
"""How far one device's compute, relative to the others', must move."""
COOLDOWN = 3 * WINDOW
"""Fewest steps between two moves."""
CHECK_EVERY = 4
"""Steps between two agreements on whether to move (one small collective)."""
BALANCE_GAIN = 0.05
"""Least predicted saving, as a fraction of the step, for which the balance check moves a
plan whose devices' speeds did not change: the first plan's own calibration varies by a
few per cent from run to run (one unit more or less on the slow device), and chasing that
would cost more than it saves."""
UNDO_MARGIN = 0.03
"""How much slower than before a balance move (the median of a window of steps after its
warm-up, against that of the window that called for it) a run may step before it moves
back: eight-step medians of one plan on a shared host stray 1–3 % from one window to the
next."""
FIRST_MOVE_STEPS = 5.0
"""A move's cost in step times, before one has been measured (``small`` on ``ci-2dev``:
2.2 s at 0.5 s a step, about 4)."""


@dataclass
class SpeedWatch:
    """Each device's compute per step since the plan, and whether it changed for good."""

    window: int = WINDOW
    threshold: float = THRESHOLD
    cooldown: int = COOLDOWN
    steps: int = 0
    """Steps observed since the plan."""
    baseline: list[float] | None = None
    recent: deque[list[float]] = field(default_factory=deque)
    rounds: deque[Round] = field(default_factory=deque)
    balance_due: bool = True
    """The first plan's balance is still to be checked against its baseline."""

    def observe(self, plan: Plan | None, times: list[dict[str, float]]) -> None:
        """One step: every device's compute seconds per segment (rank order) under
        ``plan`` (None: not a tensor-parallel plan, kept for no refit)."""
        self.steps += 1
        if self.steps <= WARMUP:
            return
        self.recent.append([sum(t.values()) for t in times])
        if plan is not None:
            self.rounds.append(Round(plan, times))
        while len(self.recent) > self.window:
            self.recent.popleft()
        while len(self.rounds) > self.window:
            self.rounds.popleft()
        if self.baseline is None and len(self.recent) == self.window:
            self.baseline = _medians(self.recent)

    def factors(self, last: int | None = None) -> list[float] | None:
        """Each device's compute now (the median of the recent window, or of its ``last``
        steps) over its baseline; None until both are in."""
        if self.baseline is None or len(self.recent) < self.window:
            return None
        now = _medians(list(self.recent)[-(last or self.window) :])
        return [n / b if b > 0 else 1.0 for n, b in zip(now, self.baseline, strict=True)]

    def changed(self) -> list[float] | None:
        """Each device's factor (:meth:`factors`) relative to the median factor of the other
        devices, when some device has moved by more than the threshold; else None."""
        factors = self.factors()
        if factors is None or self.steps < self.cooldown:
            return None
        relative = [
            f / statistics.median(factors[:i] + factors[i + 1 :]) for i, f in enumerate(factors)
        ]
        return relative if max(abs(r - 1.0) for r in relative) > self.threshold else None

    def balance_check(self) -> list[float] | None:
        """Once, when the first plan's baseline is in: each device's compute over the
        busiest device's (the balance to check); else None."""
        if not self.balance_due or self.baseline is None:
            return None
        self.balance_due = False
        top = max(self.baseline)
        return [b / top if top > 0 else 1.0 for b in self.baseline]

    def restart(self) -> None:
        """A new plan (made from real steps): a new baseline, and no balance check."""
        self.steps, self.baseline, self.balance_due = 0, None, False
        self.recent.clear()
        self.rounds.clear()


def _medians(rows: Iterable[list[float]]) -> list[float]:
    return [statistics.median(col) for col in zip(*rows, strict=True)]


@dataclass(frozen=True)
class Undo:
    """What a balance move left behind, to move back to if the steps after it are slower:
    the plan before it and that plan's median step (wall time, the slowest rank's)."""

    plan: Plan
    step_s: float

    def due(self, durations: Sequence[float], steps_left: int, move_s: float) -> Proposal | None:
        """The move back, when the steps since the move (``durations``) are slower than
        those before it by more than :data:`UNDO_MARGIN` and moving back pays for itself."""
        now = statistics.median(durations)
        slower = now > self.step_s * (1.0 + UNDO_MARGIN)
        if not slower or (now - self.step_s) * steps_left <= 2.0 * move_s:
            return None
        return Proposal(self.plan, [], now, self.step_s, "undo")


@dataclass(frozen=True)
class Proposal:
    """A new plan, why, and what it should save."""

    plan: Plan
    relative: list[float]
    now_s: float
    """Predicted step time of the current plan at the devices' current speeds."""
    then_s: float
    """Predicted step time of the new plan."""
    why: str = "change"
    """``change``: a device's speed changed against the others' (``relative``: its factor
    against theirs); ``balance``: the first plan was out of balance from its start
    (``relative``: each device's compute over the busiest's); ``release``: fewer devices
    are predicted faster than the steps measured (``now_s``: that measured step);
    ``undo``: back to the plan before a balance move, whose steps came out slower
    (``now_s``, ``then_s``: the median step measured after and before it)."""
    keep: tuple[int, ...] = ()
    """For ``release``: the devices kept (ranks of the run's group); empty: all."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_dict(),
            "relative": self.relative,
            "now_s": self.now_s,
            "then_s": self.then_s,
            "why": self.why,
            "keep": list(self.keep),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Proposal:
        return cls(
            Plan.from_dict(d["plan"]),
            list(d["relative"]),
            d["now_s"],
            d["then_s"],
            d.get("why", "change"),
            tuple(d.get("keep", ())),
        )


def propose(
    watch: SpeedWatch,
    profiles: list[DeviceProfile],
    plan: Plan,
    cfg: ModelConfig,
    chunks: tuple[int, int],
    steps_left: int,
    move_s: float,
) -> Proposal | None:
    """The plan to move to, if a device's speed changed for good (or the first plan was
    out of balance by at least :data:`BALANCE_GAIN`) and moving pays."""
    why, relative = "change", watch.changed()
    if relative is None:
        why, relative = "balance", watch.balance_check()
    if relative is None:
        return None
    found = replan(profiles, list(watch.rounds), plan, cfg, chunks)
    if found is None:
        return None
    new, now_s, then_s = found
    if (now_s - then_s) * steps_left <= 2.0 * move_s:
        return None
    if why == "balance" and now_s - then_s < BALANCE_GAIN * now_s:
        return None
    return Proposal(new, relative, now_s, then_s, why)


def replan(
    profiles: Sequence[DeviceProfile],
    rounds: Sequence[Round],
    plan: Plan,
    cfg: ModelConfig,
    chunks: tuple[int, int],
) -> tuple[Plan, float, float] | None:
    """The plan that ``rounds`` (real steps of ``plan``) call for, with the predicted step
    of ``plan`` and of it at the speeds those steps show (``profiles`` fitted to their
    medians, :func:`~xronos.planner.calibrate.typical`); None when it is ``plan``."""
    fitted = fit(list(profiles), typical(rounds))
    new = plan_tp(cfg, fitted, mlp_chunk=chunks[0], vocab_chunk=chunks[1])
    if all(new.split(s) == plan.split(s) for s in SEGMENTS):
        return None
    now_s, then_s = (float(predict(p, fitted)["step_time_s"]) for p in (plan, new))
    return new, now_s, then_s


def step_times(records: list[StepRecord]) -> list[dict[str, float]]:
    """Every device's compute seconds per segment in one recorded step (rank order)."""
    return [segment_times(r) for r in sorted(records, key=lambda r: r.rank)]


class Rebalancer:
    """Watches a heterogeneous tensor-parallel run and moves it to a new plan when a
    device's speed changes for good (every rank holds one; they agree every
    :data:`CHECK_EVERY` steps on rank 0's proposal). ``release``: ``auto``'s run, which may
    also go on with fewer devices (:mod:`xronos.run.release`); ``keep_first``: never
    without rank 0 (a multi-host run's coordinator)."""

    def __init__(
        self,
        session: TPSession,
        profiles: list[DeviceProfile],
        chunks: tuple[int, int],
        steps: int,
        emit: Callable[[dict[str, Any]], None],
        *,
        timeout_s: float,
        release: bool = False,
        keep_first: bool = False,
    ) -> None:
        self.profiles, self.chunks, self.steps, self.emit = profiles, chunks, steps, emit
        self.timeout_s, self.release, self.keep_first = timeout_s, release, keep_first
        self.watch = SpeedWatch()
        self.durations: deque[float] = deque(maxlen=WINDOW)
        """The last steps' wall time (the slowest rank's), after the plan's warm-up."""
        self.move_s: float | None = None
        self.undo: Undo | None = None
        """After a balance move, until the steps after it are judged: the plan before."""
        # rank 0's pid names the moves' checkpoints (the coordinator's relay serves them)
        pid = int(session.group.gather_object(os.getpid())[0])
        self.prefix = move_prefix(pid, on_disk=capped(profiles))

    def after(self, session: TPSession, records: list[StepRecord]) -> TPSession | Leave | None:
        """Observe one step; the session to go on with when the run moved (:data:`LEAVE`
        on a device it released), else None (collective every :data:`CHECK_EVERY` steps)."""
        if not records or session.group.size == 1:
            return None
        self.watch.observe(session.plan, step_times(records))
        if self.watch.steps > WARMUP:
            self.durations.append(max(r.duration for r in records))
        step = session.steps_done
        if step % CHECK_EVERY or step >= self.steps:
            return None
        cost = self.move_s
        if cost is None:
            cost = FIRST_MOVE_STEPS * max(r.duration for r in records)
        cfg, left = session.source.cfg, self.steps - step
        mine = propose(self.watch, self.profiles, session.plan, cfg, self.chunks, left, cost)
        if self.undo is not None and len(self.durations) == WINDOW:  # judged once
            mine, self.undo = self.undo.due(self.durations, left, cost) or mine, None
        if self.release and session.group.rank == 0 and len(self.durations) == WINDOW:
            mine = self._release(cfg, left, cost, mine) or mine
        where = Path(self.prefix).parent
        held = None
        if mine is not None:
            held = move_held(self.profiles, session.plan, mine.plan, where, mine.keep or None)
        offer = mine.to_dict() | {"held": held} if mine else None
        agreed = session.group.gather_object(offer)[0]  # rank 0's proposal stands
        if agreed is None:
            return None
        if agreed["held"]:  # the run keeps its plan, with this speed as the new baseline
            self.watch.restart()
            self.durations.clear()
            if session.group.rank == 0:
                self.emit({"kind": "rebalance_held", "step": step, "reason": agreed["held"]})
            return None
        chosen = Proposal.from_dict(agreed)
        fresh: TPSession | None
        if chosen.keep:
            fresh, self.move_s = narrow(
                session, chosen.keep, chosen.plan, self.prefix, self.timeout_s
            )
            self.profiles = [self.profiles[i] for i in chosen.keep]
        else:
            fresh, self.move_s = move(session, chosen.plan, self.prefix)
        if chosen.why == "balance" and self.durations:
            self.undo = Undo(session.plan, statistics.median(self.durations))
        self.watch.restart()
        self.durations.clear()
        if session.group.rank == 0:
            self.emit(
                {
                    "kind": "rebalance",
                    "step": step,
                    "seconds": self.move_s,
                    "before": session.plan.to_dict(),
                    "steps_left": left,
                }
                | chosen.to_dict()
            )
        return fresh if fresh is not None else LEAVE

    def _release(
        self, cfg: ModelConfig, left: int, cost: float, replan: Proposal | None
    ) -> Proposal | None:
        """Fewer devices, where the steps measured call for it (:mod:`xronos.run.release`)."""
        found = release_to(
            cfg,
            self.profiles,
            list(self.watch.rounds),
            list(self.durations),
            self.chunks,
            keep_first=self.keep_first,
            steps_left=left,
            move_s=cost,
            replan=(replan.now_s, replan.then_s) if replan else None,
        )
        if found is None:
            return None
        fewer, measured = found
        return Proposal(fewer.plan, [], measured, fewer.predicted_s, "release", fewer.keep)
