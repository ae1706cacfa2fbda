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

**The move** is a checkpoint written by rank 0 (the other ranks send it their shards),
read back under the new plan by every rank — the resharding checkpoint format, so the
continuation is the same training (parameters, AdamW moments, LoRA adapters, data
position, RNG). It goes to a memory filesystem (``/dev/shm``) where the host has one and no
device has a memory cap (there, to disk); a device that holds no files reads its slices
through the coordinator's relay. The old shard is freed once the checkpoint holds it, before
the new one is built; where even that would pass a device's memory cap
(:func:`move_peaks`), the run keeps its plan and says so (a move would get the device
killed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xronos.config import ModelConfig
from xronos.metrics.records import StepRecord
from xronos.planner import plan_tp
from xronos.planner.calibrate import Round, fit, segment_times, typical
from xronos.planner.memory import tp_need
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.profile import DeviceProfile
from xronos.planner.solve import predict
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
MIB = 1024**2
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

    def observe(self, plan: Plan, times: list[dict[str, float]]) -> None:
        """One step: every device's compute seconds per segment (rank order)."""
        self.steps += 1
        if self.steps <= WARMUP:
            return
        self.recent.append([sum(t.values()) for t in times])
        self.rounds.append(Round(plan, times))
        while len(self.recent) > self.window:
            self.recent.popleft()
            self.rounds.popleft()
        if self.baseline is None and len(self.recent) == self.window:
            self.baseline = _medians(self.recent)

    def changed(self) -> list[float] | None:
        """Each device's factor (compute now over its baseline) relative to the median factor
        of the other devices, when some device has moved by more than the threshold; else
        None."""
        if self.baseline is None or self.steps < self.cooldown or len(self.recent) < self.window:
            return None
        now = _medians(self.recent)
        factors = [n / b if b > 0 else 1.0 for n, b in zip(now, self.baseline, strict=True)]
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


def _medians(rows: deque[list[float]]) -> list[float]:
    return [statistics.median(col) for col in zip(*rows, strict=True)]


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
    (``relative``: each device's compute over the busiest's)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_dict(),
            "relative": self.relative,
            "now_s": self.now_s,
            "then_s": self.then_s,
            "why": self.why,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Proposal:
        return cls(
            Plan.from_dict(d["plan"]),
            list(d["relative"]),
            d["now_s"],
            d["then_s"],
            d.get("why", "change"),
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


def capped(profiles: Sequence[DeviceProfile]) -> bool:
    """Whether some device has a memory cap."""
    return any(p.memory_bytes > 0 for p in profiles)


def memory_dir(on_disk: bool = False) -> Path:
    """Where moves write their checkpoint: a memory filesystem where there is one, unless
    ``on_disk`` (some device has a memory cap: a file in memory would count against the
    writer's cap, a file on disk only until the kernel writes it out)."""
    shm = Path("/dev/shm")
    if not on_disk and shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def in_memory_fs(path: Path) -> bool:
    """Whether ``path`` lies on a filesystem kept in memory (tmpfs, ramfs)."""
    best, kind = "", ""
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 2 and len(fields[1]) > len(best) and path.is_relative_to(fields[1]):
                best, kind = fields[1], fields[2]
    return kind in ("tmpfs", "ramfs")


def move_prefix(coordinator_pid: int, on_disk: bool = False) -> str:
    """The path prefix of every move's checkpoint in a run whose rank 0 has this pid."""
    return str(memory_dir(on_disk) / f"xronos-move-{coordinator_pid}-")


def move_peaks(
    profiles: Sequence[DeviceProfile], before: Plan, after: Plan, checkpoint_in_memory: bool
) -> list[int]:
    """Per device, the model's bytes at the height of a move from ``before`` to ``after``
    (the planner's memory model, :func:`~xronos.planner.memory.tp_need`): the larger of the
    old shard and the new one (the old one's tensors are freed once the checkpoint holds
    them, before the new one is built; the checkpoint is written one tensor at a time), and
    on the device that writes the checkpoint (rank 0) the whole of it where it goes to a
    memory filesystem, whose pages the kernel charges to the writer's memory limit. Errs
    high: the checkpoint holds weights and moments, not gradients and activations."""

    def need(p: DeviceProfile, plan: Plan, i: int) -> int:
        return tp_need(p, {s: plan.split(s)[i] for s in SEGMENTS})

    old = [need(p, before, i) for i, p in enumerate(profiles)]
    new = [need(p, after, i) for i, p in enumerate(profiles)]
    peaks = [max(o, n) for o, n in zip(old, new, strict=True)]
    if checkpoint_in_memory:
        peaks[0] += sum(old)
    return peaks


def move_held(
    profiles: Sequence[DeviceProfile], before: Plan, after: Plan, where: Path
) -> str | None:
    """Why a move from ``before`` to ``after``, its checkpoint written under ``where``,
    would not fit some device's memory cap (``memory_bytes``: what the cap leaves the model;
    0 for no cap), or None when it fits."""
    in_memory = in_memory_fs(where)
    for p, peak in zip(profiles, move_peaks(profiles, before, after, in_memory), strict=True):
        if 0 < p.memory_bytes < peak:
            return (
                f"moving would take about {peak / MIB:.0f} MiB for the model on {p.name!r} "
                f"(the larger of its shards{', and the checkpoint' if in_memory else ''}), "
                f"where its memory cap leaves {p.memory_bytes / MIB:.0f} MiB"
            )
    return None


def move(session: TPSession, plan: Plan, prefix: str) -> tuple[TPSession, float]:
    """``session``'s training state under ``plan``, on the same ranks (collective); and
    the seconds the move took."""
    t0 = time.perf_counter()
    where = Path(f"{prefix}{session.steps_done}")
    session.save(where, {"move": True})
    session.release()  # the checkpoint holds it now: room for the new shard
    fresh = TPSession(session.source, plan, session.group, session.optim, session.strategy)
    fresh.load(str(where))
    session.close()
    session.group.barrier()
    if session.group.rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    return fresh, time.perf_counter() - t0


class Rebalancer:
    """Watches a heterogeneous tensor-parallel run and moves it to a new plan when a
    device's speed changes for good (every rank holds one; they agree every
    :data:`CHECK_EVERY` steps on rank 0's proposal)."""

    def __init__(
        self,
        session: TPSession,
        profiles: list[DeviceProfile],
        chunks: tuple[int, int],
        steps: int,
        emit: Callable[[dict[str, Any]], None],
    ) -> None:
        self.profiles, self.chunks, self.steps, self.emit = profiles, chunks, steps, emit
        self.watch = SpeedWatch()
        self.move_s: float | None = None
        # rank 0's pid names the moves' checkpoints (the coordinator's relay serves them)
        pid = int(session.group.gather_object(os.getpid())[0])
        self.prefix = move_prefix(pid, on_disk=capped(profiles))

    def after(self, session: TPSession, records: list[StepRecord]) -> TPSession | None:
        """Observe one step; the session to go on with when the run moved, else None
        (collective every :data:`CHECK_EVERY` steps)."""
        if not records:
            return None
        self.watch.observe(session.plan, step_times(records))
        step = session.steps_done
        if step % CHECK_EVERY or step >= self.steps:
            return None
        cost = self.move_s
        if cost is None:
            cost = FIRST_MOVE_STEPS * max(r.duration for r in records)
        mine = propose(
            self.watch,
            self.profiles,
            session.plan,
            session.source.cfg,
            self.chunks,
            self.steps - step,
            cost,
        )
        where = Path(self.prefix).parent
        held = move_held(self.profiles, session.plan, mine.plan, where) if mine else None
        offer = mine.to_dict() | {"held": held} if mine else None
        agreed = session.group.gather_object(offer)[0]  # rank 0's proposal stands
        if agreed is None:
            return None
        if agreed["held"]:  # the run keeps its plan, with this speed as the new baseline
            self.watch.restart()
            if session.group.rank == 0:
                self.emit({"kind": "rebalance_held", "step": step, "reason": agreed["held"]})
            return None
        chosen = Proposal.from_dict(agreed)
        fresh, self.move_s = move(session, chosen.plan, self.prefix)
        self.watch.restart()
        if session.group.rank == 0:
            self.emit(
                {
                    "kind": "rebalance",
                    "step": step,
                    "seconds": self.move_s,
                    "before": session.plan.to_dict(),
                    "steps_left": self.steps - step,
                }
                | chosen.to_dict()
            )
        return fresh
