"""A pipeline whose device changed speed for good, or whose first plan its first steps show
out of balance, starts again with a new plan, when the planner says that pays.

::

    every step's records ─► SpeedWatch: each device's compute, baseline vs recent window
    a persistent change  ─► forecast: the profiles slowed by the observed factors, the
                            running plan priced and the best candidate planned
    pays for itself?     ─► every rank stops after the step and writes a checkpoint; the
                            launcher starts the job again on the same devices (profiles,
                            plan, resume)

Live re-balancing (:mod:`xronos.run.rebalance`) moves a tensor-parallel run's units between
two steps. A pipeline's units are whole layers on stages whose order, memory and
micro-batches come from a search over the devices; rather than move layers between live
stages, the run takes the path of a returning device (:func:`xronos.run.elastic.rejoined`):
every device profiled anew, the run's strategy planned anew over them (a pipeline may give
the slowed device fewer layers or another place; ``auto`` may pick another strategy), the
checkpoint resumed (every strategy reads every other's). Only under the local launcher
(``xronos finetune``, which starts the job again); a run under torchrun keeps its plan, as
does a hybrid (its tensor-parallel stage is not priced here).

**When.** The same watch as live re-balancing: each device's compute per step, a baseline
over :data:`~xronos.run.rebalance.WINDOW` steps after the start, a recent window of as
many; only a change of one device against the others by more than the threshold counts.
The forecast scales each device by the median of the newer half of its window over its
baseline (the window's median moves once half of it holds the new speed).

**A plan that starts out of balance.** A pipeline's plan comes from its profile, with no
real pass to calibrate it, and profiles of one model vary from run to run (measured: one
priced a 12-layer pipeline at 1.59 s a step that then ran at 2.85 s; another, an hour
later, at 2.65). So once, when a first start's baseline is in, each
device's compute is set against what the plan predicted it (:meth:`~xronos.planner.
replan.Replanner.compute_s`), and those factors go to the same forecast; a plan predicted
at least :data:`~xronos.run.rebalance.BALANCE_GAIN` faster that pays for itself starts the
run again — from those profiles scaled by the factors (what the forecast planned from), not
profiled again, so its cost is the restart's without the profiling. A start after a
restart (a resumed one) does not check again.

**Pays for itself.** The planner prices the running pipeline and plans the best candidate
with every device's profile scaled by its observed factor (:meth:`xronos.planner.replan.
Replanner.forecast`). The saving is the measured step times the fraction the forecast
saves; the run starts again when the saving over the steps left exceeds twice a restart's
cost: this start's profiling and planning plus :data:`~xronos.run.rebalance.
FIRST_MOVE_STEPS` steps (the checkpoint, the workers' start). A change that does not pay
becomes the new baseline, and a ``restage_kept`` event says why the offer was not taken.
A pipeline of four layers whose slow device holds one already has no better split to go
to, and stays as it is.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from xronos.comm.mappings import TPGroup
from xronos.metrics.records import StepRecord
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.profile import DeviceProfile, on_the_wire
from xronos.planner.replan import Forecast, Replanner
from xronos.run.opening import SessionSpec, wire_bytes
from xronos.run.rebalance import BALANCE_GAIN, CHECK_EVERY, FIRST_MOVE_STEPS, WARMUP, SpeedWatch
from xronos.train.session import Strategy


class Planner(Protocol):
    """The planner's view of the running pipeline (:class:`~xronos.planner.replan.Replanner`)."""

    def forecast(self, factors: Mapping[str, float]) -> Forecast: ...

    def compute_s(self) -> dict[str, float]: ...


def replanner(
    spec: SessionSpec, profiles: Sequence[DeviceProfile], running: PipelinePlan
) -> Replanner:
    """The planner's view of the run of ``spec``, planned from ``profiles`` (every device's,
    rank order, as measured), now running ``running``: among every strategy for an ``auto``
    run, among pipelines for a pipeline run."""
    shape = spec.shape
    return Replanner(
        cfg=shape.cfg,
        profiles=on_the_wire(profiles, wire_bytes(spec.comm_dtype)),
        running=running,
        batch_size=shape.batch_size,
        seq_len=shape.seq_len,
        grad_accum=spec.grad_accum,
        mlp_chunk=shape.mlp_chunk,
        vocab_chunk=shape.vocab_chunk,
        only=None if spec.strategy is Strategy.AUTO else "pp-1f1b",
    )


def device_compute(records: Sequence[StepRecord], devices: Sequence[str]) -> list[float]:
    """Each of ``devices``' compute seconds in one step (their records' compute spans)."""
    by_name = {r.device: sum(c.end - c.start for c in r.computes) for r in records}
    return [by_name.get(d, 0.0) for d in devices]


class Restager:
    """Whether a pipeline run should start again (see the module docstring)."""

    def __init__(
        self,
        devices: Sequence[str],
        planner: Planner,
        steps: int,
        opened_s: float,
        emit: Callable[[dict[str, Any]], None],
        *,
        balance: bool = True,
        profiled_s: float = 0.0,
    ) -> None:
        """``devices``: the pipeline's, in its group's rank order; ``planner``: the
        planner's view of the run (:func:`replanner`); ``steps``: the run's total;
        ``opened_s``: what this start's profiling and planning took; ``emit``: the worker's
        event channel (rank 0 speaks); ``balance``: check the first plan against its first
        steps (a run's first start; a start after a restart does not check again);
        ``profiled_s``: of ``opened_s``, the profiling, which a balance restart skips."""
        self.devices, self.planner = list(devices), planner
        self.steps, self.opened_s, self.emit = steps, opened_s, emit
        self.profiled_s = profiled_s
        self.agreed: dict[str, Any] | None = None
        """The offer the ranks agreed to start again on (None until then)."""
        self.watch = SpeedWatch(balance_due=balance)
        self.durations: list[float] = []

    def after(self, step: int, group: TPGroup, records: Sequence[StepRecord]) -> bool:
        """Observe step ``step`` (steps done); True, on every rank of ``group`` alike, when
        the run should stop with a checkpoint and start again (collective every
        :data:`~xronos.run.rebalance.CHECK_EVERY` steps)."""
        if not records:
            return False
        compute = device_compute(records, self.devices)
        self.watch.observe(None, [{"compute": c} for c in compute])
        if self.watch.steps > WARMUP:
            self.durations.append(max(r.duration for r in records))
        if step % CHECK_EVERY or step >= self.steps:
            return False
        offer = self._offer(step) if group.rank == 0 else None
        agreed = group.gather_object(offer)[0]  # rank 0's decision stands
        if agreed is None:
            return False
        if not agreed["pays"]:  # the new speeds are the baseline now
            self.watch.restart()
            if group.rank == 0:
                self.emit({"kind": "restage_kept", **agreed})
            return False
        if group.rank == 0:
            self.emit({"kind": "restage", **agreed})
        self.agreed = agreed
        return True

    def _offer(self, step: int) -> dict[str, Any] | None:
        relative = self.watch.changed()
        # the change shows in the window's median once it holds half the window; the
        # newer half's median is the speed the devices run at now
        factors = self.watch.factors(last=self.watch.window // 2)
        why, least = "change", 0.0
        if relative is None and self.watch.balance_check() is not None:
            # the first plan against its own first steps: compute measured over predicted
            predicted = self.planner.compute_s()
            baseline = self.watch.baseline or []
            factors = [
                b / predicted[d] if predicted.get(d) else 1.0
                for d, b in zip(self.devices, baseline, strict=True)
            ]
            relative, why, least = factors, "balance", BALANCE_GAIN
        if relative is None or factors is None:
            return None
        seen = self.planner.forecast(dict(zip(self.devices, factors, strict=True)))
        step_s = statistics.median(self.durations[-len(self.watch.recent) :])
        saving = step_s * seen.gain
        # a balance restart plans from these profiles scaled by the factors: no profiling
        opened = self.opened_s - (self.profiled_s if why == "balance" else 0.0)
        restart = max(opened, 0.0) + FIRST_MOVE_STEPS * step_s
        left = self.steps - step
        held = None
        if why == "balance" and seen.gain < least:
            held = f"{seen.gain:.0%} faster, under the {least:.0%} a first plan's restart needs"
        elif saving * left <= 2.0 * restart:
            held = (
                f"{saving * left:.1f} s saved over the {left} steps left, not twice the "
                f"{restart:.1f} s to start again"
            )
        return {
            "step": step,
            "why": why,
            "relative": dict(zip(self.devices, relative, strict=True)),
            "now_s": seen.now_s,
            "best_s": seen.best_s,
            "best": seen.best,
            "saving_s": saving,
            "restart_s": restart,
            "left": left,
            "pays": held is None,
            "held": held,
        }
