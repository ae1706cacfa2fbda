"""The fine-tuning run each device's worker executes (``xronos finetune``, ``xronos worker``
and the exactness tests alike).

Rank 0 reports to the parent through events; the parent owns the console, the run
directory's logs and the evaluation metric (it holds the tokenizer).

    open session (profile + plan) ─► [resume] ─► eval ─► train_loop … ─► save ─► eval
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from xronos.checkpoint import checkpoint_path, prune_checkpoints
from xronos.comm.iothreads import restored
from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.comm.stop import requested as stop_requested
from xronos.errors import UserError
from xronos.metrics.recorder import SpanRecorder
from xronos.metrics.records import StepRecord
from xronos.pipeline.session import PipelineSession
from xronos.run.opening import Opened, SessionSpec
from xronos.run.rebalance import Rebalancer
from xronos.run.restage import Restager, replanner
from xronos.run.sessions import Profiles, ProfileSource, open_session
from xronos.run.spacing import KEEP, CheckpointSpacing
from xronos.train.batches import StepSource
from xronos.train.loop import Leave, LossNotFinite, StepOutcome, train_loop
from xronos.train.session import EvalSpec, Session, Strategy
from xronos.train.tp import TPSession


@dataclass(frozen=True, kw_only=True)
class FinetuneJob:
    """A fine-tuning run as every rank sees it (plain picklable data)."""

    session: SessionSpec
    data: StepSource
    """The training batches (each rank holds its own copy and position)."""
    steps: int
    """Train until this many optimizer steps are done."""
    profiles: ProfileSource
    eval: EvalSpec = field(default_factory=EvalSpec)
    seed: int = 0
    eval_every: int = 0
    save_every: int | None = 0
    """Checkpoint every N steps (0: only at the end; None: spaced by
    :class:`~xronos.run.spacing.CheckpointSpacing`)."""
    keep: int | None = None
    """Checkpoints kept (the newest; older ones deleted as new ones land); None: all with
    ``save_every``, :data:`~xronos.run.spacing.KEEP` with automatic spacing."""
    run_dir: str | None = None
    """Where checkpoints go; None: no checkpoints (tests)."""
    resume: str | None = None
    """A checkpoint directory to continue from."""
    record: bool = True
    """Record collective spans for the idle/transfer analysis."""
    return_state: bool = False
    """Return the gathered final parameters (tests)."""
    rebalance: bool = True
    """Move a heterogeneous tensor-parallel run to a new plan when a device's speed
    changes for good (:mod:`xronos.run.rebalance`)."""
    keep_records: bool = False
    """Return every step's records too (tests; a run streams them to the parent)."""


@dataclass
class WorkerResult:
    """What every rank returns at the end of a run."""

    step: int
    stopped: bool
    checkpoint: str | None
    plan: dict[str, Any]
    losses: list[float]
    grad_norms: list[float]
    state: dict[str, torch.Tensor] | None = None
    records: list[list[StepRecord]] = field(default_factory=list)
    members: tuple[int, ...] = ()
    """The ranks that trained (``auto`` may leave devices out); empty on those left out."""
    restage: dict[str, Any] | None = None
    """Stopped to start again, planned anew: the agreed offer (:mod:`xronos.run.restage`:
    ``why``, and per device name its compute factor in ``relative``)."""


def lead_result(results: list[WorkerResult]) -> WorkerResult:
    """The result that speaks for the run: the first of a rank that trained to the end (not
    one that ``auto`` left out or released)."""
    return next((r for r in results if r.members), results[0])


def _agree_stop(group: TPGroup) -> bool:
    """True on every rank once any rank was asked to stop (Ctrl-C in the parent)."""
    flag = torch.tensor([1.0 if stop_requested() else 0.0])
    if group.size > 1:
        import torch.distributed as dist

        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.pg)
    return bool(flag.item() > 0)


def _lead(session: Session) -> bool:
    """Whether this rank reports for the session (its group's first rank)."""
    return session.group.rank == 0


def _emit_plan(ctx: WorkerContext, opened: Opened, profiles: Profiles) -> None:
    s = opened.session
    if s is None or not _lead(s):
        return
    if opened.choice is not None and opened.ran is not None:
        ctx.emit(
            {
                "kind": "auto",
                "choice": opened.choice.to_dict(),
                "ran": opened.ran.to_dict(),
                "trials": opened.trials,
                "against_alone": opened.against_alone,
                "refined": opened.refined,
            }
        )
    kind = "pipeline" if s.strategy.is_pipeline else "plan"
    ctx.emit(
        {
            "kind": kind,
            "strategy": s.strategy.value,
            "plan": s.describe(),
            "seconds": opened.seconds,
            "measured": [p.to_dict() for p in profiles.measured or []],
            "profiles": [p.to_dict() for p in opened.calibrated],
            "cached": bool(profiles.source.cached),
            "given": opened.given,
        }
    )


def _evaluate(ctx: WorkerContext, session: Session, spec: EvalSpec, when: str) -> None:
    import time

    t0 = time.perf_counter()
    result = session.evaluate(spec)
    if _lead(session) and result is not None:
        ctx.emit(
            {
                "kind": "eval",
                "step": session.steps_done,
                "when": when,
                "eval_loss": result.loss,
                "generated": result.generated,
                "seconds": time.perf_counter() - t0,
            }
        )


def _save(ctx: WorkerContext, session: Session, job: FinetuneJob, automatic: bool) -> str:
    """Checkpoint ``session``, then keep only the newest ``job.keep`` (``automatic``
    spacing and no limit given: :data:`KEEP`)."""
    assert job.run_dir is not None
    path = checkpoint_path(job.run_dir, session.steps_done)
    session.save(path, checkpoint_extra(job, session))
    if _lead(session):
        keep = job.keep if job.keep is not None else KEEP if automatic else None
        if keep is not None:
            prune_checkpoints(job.run_dir, keep)
        ctx.emit({"kind": "checkpoint", "step": session.steps_done, "path": str(path)})
    return str(path)


def _agree_max(group: TPGroup) -> Callable[[float], float]:
    """The largest of every rank's value, on every rank of ``group``."""
    return lambda mine: float(max(group.gather_object(mine)))


def checkpoint_extra(job: FinetuneJob, session: Session) -> dict[str, Any]:
    src = job.session.source
    return {
        "step": session.steps_done,
        "data": job.data.state_dict(),
        "model": {
            "preset": None if src.model_dir else src.name,
            "dir": src.model_dir,
            "seed": src.seed,
            "config": src.cfg.to_hf_dict(),
        },
        "lora": asdict(src.lora) if src.lora else None,
        "strategy": session.strategy.value,
    }


def _rebalancer(
    ctx: WorkerContext, job: FinetuneJob, opened: Opened, session: Session
) -> Rebalancer | None:
    """Live re-balancing for a calibrated heterogeneous tensor-parallel run (collective
    over its group when enabled)."""
    on = (
        job.rebalance
        and job.record
        and isinstance(session, TPSession)
        and session.strategy is Strategy.XRONOS
        and session.group.size > 1
        and len(opened.calibrated) == session.group.size
    )
    if not on:
        return None
    shape = job.session.shape
    return Rebalancer(
        session,  # type: ignore[arg-type]
        list(opened.calibrated),
        (shape.mlp_chunk, shape.vocab_chunk),
        job.steps,
        ctx.emit,
        timeout_s=ctx.timeout_s,
        release=job.session.strategy is Strategy.AUTO,
        keep_first=job.session.anchor is not None,
    )


def _restager(
    ctx: WorkerContext, job: FinetuneJob, opened: Opened, session: Session, profiles: Profiles
) -> Restager | None:
    """Starting a pipeline again when a device's speed changes for good and the planner
    says a new plan pays: a pipeline planned from profiles (not given, not a hybrid) on the
    local launcher alone (it starts the job again), with a run directory for the
    checkpoint."""
    spec = job.session
    if not isinstance(session, PipelineSession) or session.group.size == 1:
        return None
    if session.hybrid is not None or opened.given or profiles.measured is None:
        return None
    if not (job.rebalance and job.record and job.run_dir) or spec.anchor is not None:
        return None
    planner = replanner(spec, profiles.usable(), session.pplan)
    first = session.steps_done == 0  # not resumed: check the first plan's balance too
    return Restager(
        session.runner.names,
        planner,
        job.steps,
        opened.seconds,
        ctx.emit,
        balance=first,
        profiled_s=profiles.seconds,
    )


def finetune_worker(ctx: WorkerContext, job: FinetuneJob) -> WorkerResult:
    """Open the strategy's session, train ``job.steps`` steps with the one loop, evaluate
    and checkpoint as asked; every rank returns the same result. A stop request
    (:mod:`xronos.comm.stop`: the launcher's stop signal, SIGTERM) ends it after a step."""
    torch.manual_seed(job.seed)
    profiles = Profiles(ctx, job.session.shape, job.profiles)
    opened = open_session(job.session, ctx, ctx.group, profiles.usable, job.data.peek())
    session = opened.session
    _emit_plan(ctx, opened, profiles)
    if session is None:  # auto left this device out: it has nothing to do
        return WorkerResult(0, False, None, {}, [], [])
    if job.resume:
        job.data.load_state_dict(session.load(job.resume)["data"])
    if session.steps_done == 0 and not job.eval.empty:
        _evaluate(ctx, session, job.eval, "before")
    last: list[str | None] = [None]
    kept: list[list[StepRecord]] = []
    spacing = CheckpointSpacing(job.save_every if job.run_dir else 0)

    current: list[Session] = [session]  # a move to a new plan replaces it
    restager = _restager(ctx, job, opened, session, profiles)
    restaged = [False]  # stopped to start again (a pipeline's plan no longer fits)
    told = [False]  # this device's I/O threads went back to the normal class

    def after_step(o: StepOutcome) -> bool:
        session = current[0]
        if job.keep_records and o.records:
            kept.append(o.records)
        if not told[0] and restored():
            told[0] = True
            ctx.emit({"kind": "io_restored", "step": o.step, "device": ctx.device})
        if _lead(session):
            ctx.emit(
                {
                    "kind": "step",
                    "step": o.step,
                    "loss": o.result.loss,
                    "grad_norm": o.result.grad_norm,
                    "tokens": o.result.tokens,
                    "lr": o.result.lr,
                    "records": [r.to_dict() for r in o.records],
                }
            )
        stop = _agree_stop(session.group)
        if restager is not None and isinstance(session, PipelineSession):
            # collective: every rank calls it
            again = restager.after(session.steps_done, session.group, o.records)
            restaged[0] = again and not stop  # a stop asked for (Ctrl-C, a join) wins
            stop = stop or again
        more = o.step < job.steps
        known = spacing.interval is not None
        due = spacing.due(o.step, _agree_max(session.group))
        if not known and spacing.interval and _lead(session):
            ctx.emit({"kind": "spacing", "every": spacing.interval, "step_s": spacing.step_s})
        if due and more:
            last[0] = _save(ctx, session, job, spacing.automatic)
        if job.eval_every and o.step % job.eval_every == 0 and more and not job.eval.empty:
            _evaluate(ctx, session, job.eval, "during")
        return stop

    group = session.group
    recorder = SpanRecorder(ctx.rank, ctx.device, enabled=job.record and group.size > 1)
    mover = _rebalancer(ctx, job, opened, session)

    def swap(old: Session, o: StepOutcome) -> Session | Leave | None:
        fresh = mover.after(old, o.records) if mover and isinstance(old, TPSession) else None
        if isinstance(fresh, TPSession):
            current[0] = fresh
        return fresh

    try:
        loop = train_loop(session, job.data, job.steps, group, recorder, after_step, swap)
    except LossNotFinite as e:
        raise UserError(
            f"loss is {e.loss} at step {e.step}; stopped; the last good checkpoint is "
            f"{last[0] or 'none was written yet'}; lower --lr or check the data"
        ) from None
    if loop.left:  # released: the run goes on without this device
        return WorkerResult(loop.steps, False, None, {}, loop.losses, loop.grad_norms)
    session = current[0]
    if job.run_dir:
        last[0] = _save(ctx, session, job, spacing.automatic)
    if not loop.stopped and not job.eval.empty:
        _evaluate(ctx, session, job.eval, "after")
    state = session.gather_state() if job.return_state else None
    session.close()
    return WorkerResult(
        step=session.steps_done,
        stopped=loop.stopped,
        checkpoint=last[0],
        plan=session.describe(),
        losses=loop.losses,
        grad_norms=loop.grad_norms,
        state=state,
        records=kept,
        members=session.group.world_ranks(),  # fewer where devices were released
        restage=restager.agreed if restager is not None and restaged[0] else None,
    )
