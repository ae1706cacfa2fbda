"""Carrying on when a device leaves (``xronos finetune`` on the local launcher).

A device is lost when its worker dies (killed by a signal: the owner ended it, the memory
cap was hit) or stops answering (the others' collectives time out, ``--timeout``). The
launcher then stops the other workers and the run goes on without that device::

    launch ─► DeviceLost ─► device_lost ─► the survivors' job:
                                             same workload and settings,
                                             a new plan over the survivors (their
                                             profiles from the run's start: no profiling),
                                             the newest checkpoint (none: step 0)
                              resumed ◄──────┘ (logged when the new plan is made)
            ◄── launch again ──┘

The strategy stays what it was, planned anew over the survivors (``auto`` may now pick
``single``; a hybrid left with two devices becomes ``auto``); one survivor runs
``single`` (``auto`` when it has a memory cap, so that a model it cannot hold stops with
one line). Checkpoints reshard across strategies, so a pipeline's survivors may go on as
tensor parallelism and the other way round. Each loss takes one device away, so this
ends.

A lost device that asks to come back (``xronos join RUN_DIR DEVICE``) is taken back at
the end of the step in flight: the workers stop with a checkpoint, and the job starts
again on its devices plus the returning ones — all profiled anew (the returning device
may have changed), planned anew with the run's first strategy, from that checkpoint
(``device_joined``, then ``resumed`` with no step to do again).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from xronos.checkpoint import latest_checkpoint, read_checkpoint_meta
from xronos.emulation import ClusterSpec
from xronos.errors import DeviceLost, UserError
from xronos.planner.plan import Plan
from xronos.planner.profile import DeviceProfile, slowed
from xronos.run.membership import JoinWatch
from xronos.run.monitor import RunMonitor
from xronos.run.opening import SessionSpec
from xronos.run.prepare import Prepared, launch_job
from xronos.run.worker import lead_result
from xronos.train.session import Strategy


def launch_elastic(prep: Prepared, monitor: RunMonitor) -> tuple[list[Any], Prepared]:
    """:func:`~xronos.run.prepare.launch_job`, carrying on without each device that is
    lost (unless ``--no-elastic``) and taking back each lost device that asks to join
    (:mod:`xronos.run.membership`); returns the workers' results and the job that ran last.

    Raises:
        DeviceLost: with ``--no-elastic``, or when no device is left.
        UserError: the survivors cannot run the job (memory), or a mistake in the input.
    """
    first = prep
    joins = JoinWatch(prep.run_dir, monitor.say)
    while True:
        joins.asked = False

        def stop_when(began: int = monitor.last_step) -> bool:
            # once a step is done every worker handles the stop signal
            return monitor.last_step > began and joins.ask()

        try:
            results = launch_job(prep, monitor.on_event, stop_when, lost=joins.lost)
        except DeviceLost as e:
            if not prep.cfg.elastic:
                raise
            step = monitor.lost(e.device, e.rank, e.reason)
            if prep.cluster.world_size == 1:
                why = f"{e.reason}; no device is left"
                raise DeviceLost(e.device, e.rank, why, e.details) from None
            joins.lost.append(e.device)
            prep, start = survivors(prep, e.rank, known_profiles(prep, monitor))
            monitor.resuming(start, step)
            continue
        except UserError as e:
            if not joins.lost:
                raise
            raise UserError(
                f"after losing {', '.join(repr(d) for d in joins.lost)}, the remaining devices "
                f"cannot carry on: {e}"
            ) from None
        lead = lead_result(results)
        if lead.restage is not None:  # a pipeline's plan no longer fits its devices
            prep, start = rejoined(first, prep, [], restage_profiles(prep, monitor, lead.restage))
            monitor.resuming(start, monitor.last_step)
            continue
        if not (joins.asked and lead.stopped):
            return results, prep
        back = joins.take()
        prep, start = rejoined(first, prep, back)
        monitor.joined(back, start)


def known_profiles(prep: Prepared, monitor: RunMonitor) -> dict[str, DeviceProfile]:
    """The profiles this run already has, by device name: read from the cache at the
    start, or measured by the workers (reported with the plan)."""
    known = {p.name: p for p in prep.job.profiles.cached or ()}
    for d in monitor.measured:
        p = DeviceProfile.from_dict(d)
        known.setdefault(p.name, p)
    return known


def survivors(
    prep: Prepared, lost_rank: int, known: dict[str, DeviceProfile]
) -> tuple[Prepared, int]:
    """The job of ``prep`` on every device but ``lost_rank``, from the newest checkpoint
    it can resume, and that checkpoint's step (0: none, start over)."""
    keep = [r for r in range(prep.cluster.world_size) if r != lost_rank]
    return on_devices(prep, prep, keep, _every_one(known, prep.cluster, keep))


def rejoined(
    first: Prepared,
    prep: Prepared,
    back: list[str],
    known: dict[str, DeviceProfile] | None = None,
) -> tuple[Prepared, int]:
    """The job of ``prep`` with the devices ``back`` (lost earlier, asking to join) taken
    back — in ``first``'s cluster order, with ``first``'s strategy, every device profiled
    anew (one that comes back may not be the one that left) unless ``known`` has every
    one's profile — from the checkpoint the workers just wrote; and that checkpoint's
    step."""
    names = {d.name for d in prep.cluster.devices} | set(back)
    keep = [r for r, d in enumerate(first.cluster.devices) if d.name in names]
    return on_devices(first, prep, keep, _every_one(known or {}, first.cluster, keep))


def _every_one(
    known: dict[str, DeviceProfile], cluster: ClusterSpec, keep: list[int]
) -> tuple[DeviceProfile, ...] | None:
    """The profiles of ``cluster``'s devices ``keep`` from ``known``; None (profile them)
    unless it has every one's."""
    cached = [known.get(cluster.devices[r].name) for r in keep]
    return tuple(p for p in cached if p is not None) if all(cached) else None


def restage_profiles(
    prep: Prepared, monitor: RunMonitor, offer: dict[str, Any]
) -> dict[str, DeviceProfile] | None:
    """For a pipeline that starts again because its first plan was out of balance with
    its first steps: the profiles it was planned with, each device's compute scaled by the
    factor those steps showed (what the forecast planned from), so the restart plans the
    same way without profiling again. None (profile anew) after a change of speed."""
    if offer.get("why") != "balance":
        return None
    known = known_profiles(prep, monitor)
    return {n: slowed(p, float(offer["relative"].get(n, 1.0))) for n, p in known.items()}


def on_devices(
    base: Prepared, prep: Prepared, keep: list[int], cached: tuple[DeviceProfile, ...] | None
) -> tuple[Prepared, int]:
    """``prep``'s job on ``base``'s devices ``keep`` (their ranks in ``base``), ``base``'s
    strategy planned anew over them, from the newest checkpoint it can resume; and that
    checkpoint's step (0: none, start over). ``cached``: their profiles, None to measure."""
    cluster = ClusterSpec(base.cluster.name, tuple(base.cluster.devices[r] for r in keep))
    spec = survivor_spec(base.job.session, cluster)
    ckpt = resumable(prep.run_dir)
    profiles = replace(
        base.job.profiles,
        memory_caps=tuple(base.job.profiles.memory_caps[r] for r in keep),
        keys=tuple(base.job.profiles.keys[r] for r in keep),
        cached=cached,
    )
    job = replace(
        prep.job,
        session=spec,
        profiles=profiles,
        resume=str(ckpt) if ckpt is not None else None,
    )
    step = int(read_checkpoint_meta(ckpt)["step"]) if ckpt is not None else 0
    return replace(prep, cluster=cluster, job=job), step


def survivor_spec(spec: SessionSpec, cluster: ClusterSpec) -> SessionSpec:
    """``spec``'s strategy over ``cluster`` (the survivors), planned anew."""
    if cluster.world_size == 1:
        alone = Strategy.AUTO if cluster.devices[0].memory_bytes else Strategy.SINGLE
        return replace(spec, strategy=alone, plan=None, pipeline=None, hybrid=None)
    if spec.strategy is Strategy.TP_EVEN:
        names = [d.name for d in cluster.devices]
        return replace(spec, plan=Plan.even(spec.source.cfg, names), pipeline=None, hybrid=None)
    if spec.strategy is Strategy.HYBRID and cluster.world_size < 3:  # no hybrid is left
        return replace(spec, strategy=Strategy.AUTO, plan=None, pipeline=None, hybrid=None)
    return replace(spec, plan=None, pipeline=None, hybrid=None)


def resumable(run_dir: Path) -> Path | None:
    """The newest checkpoint of ``run_dir`` if training can continue from it, or None:
    not one written by an older Xronos's pipeline run (weights, no optimizer state)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None
    meta = read_checkpoint_meta(ckpt)
    strategy = meta.get("extra", {}).get("strategy")
    older = strategy in (s.value for s in Strategy if s.is_pipeline)
    return ckpt if meta.get("optimizer", not older) else None
