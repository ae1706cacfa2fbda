"""``xronos bench`` inside the workers: every strategy on the same processes, interleaved.

All strategies live in the same device processes (so in the same emulated limits) and
take turns step by step, the order rotating each round, so that drift of the machine
hits all of them alike. Each strategy's step is the loop's own :func:`run_step` on the
strategy's session; it starts after a barrier that is not timed. ``single`` runs the
whole model on the fastest device while the others wait.

A multi-device step ends with one more, timed collective (``step.end``): in a real run
the next step's first collective is where a device that finished its optimizer update
early waits for the others; here the untimed barrier between strategies would hide that
wait, so ``step.end`` puts it back, as idle, in the step it belongs to.

Every device also runs the whole model alone, inside its own limits, once per round
(``solo``): its median counted step is ``T_i^solo`` of DESIGN §6, measured, not
extrapolated (the fastest device's is the ``single`` strategy's when that runs).

After the timed rounds each session replays its last step's compute with no
communication in flight (:meth:`~xronos.train.session.Session.isolated_compute`), for
the computation-stall ratio.
"""

from __future__ import annotations

import resource
import statistics
from dataclasses import dataclass, field, replace

from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.metrics.recorder import SpanRecorder
from xronos.metrics.records import Span, StepRecord
from xronos.planner.auto import plan_auto
from xronos.planner.plan import Plan
from xronos.planner.profile import DeviceProfile
from xronos.planner.solve import predict
from xronos.run.sessions import Opened, Profiles, ProfileSource, SessionSpec, open_session
from xronos.train.batches import Batch, RandomBatches, label_count
from xronos.train.loop import STEP_END, run_step
from xronos.train.session import Session, Strategy
from xronos.train.tp import compute_gaps

ISOLATED_REPEATS = 3
"""Isolated re-runs of the last step per strategy; the stall ratio compares the mean
isolated span with the mean of the same span over every counted step."""


@dataclass(frozen=True, kw_only=True)
class BenchJob:
    spec: SessionSpec
    """The workload (its ``strategy`` is replaced by each of ``strategies``)."""
    strategies: tuple[Strategy, ...]
    steps: int
    """Counted steps per strategy."""
    warmup: int
    """Uncounted steps per strategy before them."""
    profiles: ProfileSource
    fastest: int
    """The rank that runs ``single``."""
    solo: bool = True
    """Measure every device running the whole model alone (for the ideal step time)."""
    seed: int = 0


@dataclass
class StrategyLog:
    """What rank 0 keeps of one strategy's steps."""

    records: list[list[StepRecord]] = field(default_factory=list)
    """Every rank's record, per step."""
    losses: list[float] = field(default_factory=list)
    observed: list[Span] = field(default_factory=list)
    """Compute spans of the counted steps, every rank's."""
    isolated: list[Span] = field(default_factory=list)
    """The same spans with no communication in flight, every rank's."""
    plan: dict[str, object] = field(default_factory=dict)
    """What the session describes (a Plan or a PipelinePlan as a dict)."""
    tokens: int = 0
    """Label tokens per step (:func:`~xronos.train.batches.label_count`)."""


@dataclass
class BenchOutput:
    """Rank 0's result of a bench run."""

    logs: dict[Strategy, StrategyLog]
    measured: list[DeviceProfile]
    """Profiles as measured (or read from the cache): what the cache keeps."""
    calibrated: list[DeviceProfile]
    """Profiles after the xronos plan's calibration (the measured ones without it)."""
    planning_s: float
    """Profiling + planning + calibration of the xronos strategy."""
    profile_s: float
    peak_rss_mb: list[float]
    solo_step_time_s: list[float | None]
    """Per device: median counted step running the whole model alone (None: not run)."""
    predicted_step_time_s: dict[Strategy, float | None] = field(default_factory=dict)
    """What the planner's model (communication included) predicted for each strategy."""
    auto: dict[str, object] | None = None
    """``auto``'s candidates, its pick (``chosen``) and what ran."""


def _observed(session: Session, rec: StepRecord, rank: int) -> list[Span]:
    """This rank's compute spans of one step, named to match its isolated replay."""
    if session.strategy.is_pipeline:
        return _ranked(rec.computes, rank)
    c = rec.collectives
    if c and c[-1].name == STEP_END:  # the replay has no step.end: end the step there
        rec = replace(rec, collectives=c[:-1], end=c[-1].arrive)
    return compute_gaps(rec)


def _ranked(spans: tuple[Span, ...] | list[Span], rank: int) -> list[Span]:
    """Span names made unique across ranks (stall ratios match spans by name)."""
    return [Span(f"{rank}/{s.name}", s.start, s.end, s.kind) for s in spans]


def _open(
    job: BenchJob, s: Strategy, ctx: WorkerContext, profiles: Profiles, first: list[Batch]
) -> Opened | None:
    """Open strategy ``s``'s session (None on a rank that has no part in it)."""
    spec = replace(job.spec, strategy=s)
    if s is not Strategy.SINGLE:
        return open_session(spec, ctx, ctx.group, profiles.get, first)
    if ctx.rank != job.fastest:
        return None
    solo = WorkerContext(0, 1, ctx.device, TPGroup(), ctx.timeout_s, (ctx.device,))
    return open_session(spec, solo, TPGroup(), profiles.get, first)


def bench_worker(ctx: WorkerContext, job: BenchJob) -> BenchOutput | None:
    cfg, shape = job.spec.source.cfg, job.spec.shape
    profiles = Profiles(ctx, shape, job.profiles)
    data = RandomBatches(cfg.vocab_size, shape.batch_size, shape.seq_len, seed=job.seed)
    first = data.peek()
    sessions: dict[Strategy, Session | None] = {}
    planning_s, calibrated, auto = 0.0, None, None
    for s in job.strategies:
        opened = _open(job, s, ctx, profiles, first)
        sessions[s] = opened.session if opened else None
        if s is Strategy.XRONOS and opened is not None:
            planning_s, calibrated = opened.seconds, opened.calibrated
        if s is Strategy.AUTO and opened is not None and opened.choice and opened.ran:
            auto = {
                **opened.choice.to_dict(),
                "ran": opened.ran.to_dict(),
                "chosen_strategy": opened.ran.strategy,
                "predicted_best": opened.choice.chosen.strategy,
                "trials": opened.trials,
                "seconds": opened.seconds,
            }
    logs = {s: StrategyLog() for s in job.strategies}
    solo = _solo_session(job, ctx, profiles, first, Strategy.SINGLE in job.strategies)
    solo_times: list[list[float]] = [[] for _ in range(ctx.world_size)]
    micro: list[Batch] = []
    n = len(job.strategies)
    for step in range(job.warmup + job.steps):
        micro = data.next_step()
        k = step % n
        for s in job.strategies[k:] + job.strategies[:k]:
            _step(sessions[s], micro, ctx, logs[s], counted=step >= job.warmup)
        if job.solo:
            for r, t in enumerate(_solo_step(solo, micro, ctx)):
                if t is not None and step >= job.warmup:
                    solo_times[r].append(t)
    if solo is not None:
        solo.close()
    for s in job.strategies:
        _isolated(sessions[s], micro, ctx, logs[s])
        session = sessions[s]
        described = ctx.group.gather_object(session.describe() if session else None)
        logs[s].plan = next(d for d in described if d is not None)
        if session is not None:
            session.close()
    rss = ctx.group.gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if ctx.rank != 0:
        return None
    measured = profiles.measured or []
    return BenchOutput(
        logs=logs,
        measured=measured,
        calibrated=calibrated or measured,
        planning_s=planning_s,
        profile_s=profiles.seconds,
        peak_rss_mb=rss,
        solo_step_time_s=_solo_medians(solo_times, logs, job),
        predicted_step_time_s=predictions(job, measured, calibrated, logs, auto),
        auto=auto,
    )


def predictions(
    job: BenchJob,
    measured: list[DeviceProfile],
    calibrated: list[DeviceProfile] | None,
    logs: dict[Strategy, StrategyLog],
    auto: dict[str, object] | None,
) -> dict[Strategy, float | None]:
    """Each strategy's predicted step from the profiles (communication included): the
    planner's own candidates for single, tp-even and the pipelines; the calibrated plan
    for xronos; what ran for auto."""
    if not measured:
        return {}
    shape = job.spec.shape
    choice = plan_auto(
        job.spec.source.cfg,
        measured,
        batch_size=shape.batch_size,
        seq_len=shape.seq_len,
        grad_accum=job.spec.grad_accum,
        mlp_chunk=shape.mlp_chunk,
        vocab_chunk=shape.vocab_chunk,
    )

    def candidate(name: str, devices: tuple[int, ...] | None = None) -> float | None:
        for c in choice.candidates:
            if c.strategy == name and c.feasible and (devices is None or c.devices == devices):
                return c.predicted_step_s
        return None

    out: dict[Strategy, float | None] = {}
    for s in job.strategies:
        if s is Strategy.SINGLE:
            out[s] = candidate("single", (job.fastest,))
        elif s is Strategy.TP_EVEN:
            out[s] = candidate("tp-even")
        elif s.is_pipeline:
            out[s] = candidate("pp-1f1b")
        elif s is Strategy.XRONOS:
            plan = Plan.from_dict(dict(logs[s].plan))
            out[s] = float(predict(plan, calibrated or measured)["step_time_s"])
        elif s is Strategy.AUTO and auto is not None:
            ran = auto["ran"]
            out[s] = ran.get("predicted_step_s") if isinstance(ran, dict) else None
    return out


def _solo_session(
    job: BenchJob, ctx: WorkerContext, profiles: Profiles, first: list[Batch], have_single: bool
) -> Session | None:
    """This device's whole model, alone (None where ``single`` already measures it)."""
    if not job.solo or (have_single and ctx.rank == job.fastest):
        return None
    spec = replace(job.spec, strategy=Strategy.SINGLE)
    solo = WorkerContext(0, 1, ctx.device, TPGroup(), ctx.timeout_s, (ctx.device,))
    return open_session(spec, solo, TPGroup(), profiles.get, first).session


def _solo_step(
    session: Session | None, micro: list[Batch], ctx: WorkerContext
) -> list[float | None]:
    """Each device in turn runs one step of its whole model while the others wait; every
    device's step time (None where it has no solo session), on every rank."""
    out: list[float | None] = []
    for r in range(ctx.world_size):
        ctx.group.barrier()
        t: float | None = None
        if r == ctx.rank and session is not None:
            rec = SpanRecorder(ctx.rank, ctx.device)
            outcome = run_step(session, micro, TPGroup(), rec)
            t = outcome.records[0].duration if outcome.records else None
        out.append(ctx.group.gather_object(t)[r])
    return out


def _solo_medians(
    times: list[list[float]], logs: dict[Strategy, StrategyLog], job: BenchJob
) -> list[float | None]:
    out: list[float | None] = [statistics.median(t) if t else None for t in times]
    single = logs.get(Strategy.SINGLE)
    if single is not None and single.records:
        counted = [r[0].duration for r in single.records[job.warmup :] if r]
        out[job.fastest] = statistics.median(counted) if counted else None
    return out


def _step(
    session: Session | None, micro: list[Batch], ctx: WorkerContext, log: StrategyLog, counted: bool
) -> None:
    """One step of one strategy on every rank (those without a part in it wait)."""
    group = ctx.group
    group.barrier()
    rec = SpanRecorder(ctx.rank, ctx.device, enabled=session is not None)
    mine: StepRecord | None = None
    loss = float("nan")
    records: list[StepRecord] = []
    if session is not None:
        own = session.group
        outcome = run_step(session, micro, own, rec, end_collective=own.size > 1)
        loss, records = outcome.result.loss, outcome.records
        mine = next((r for r in records if r.rank == ctx.rank), None)
        if mine is not None and counted:
            log.observed += _observed(session, mine, ctx.rank)
    if session is None or session.group.size < group.size:  # some ranks had no part
        records = [r for r in group.gather_object(mine) if r is not None]
        loss = next(x for x in group.gather_object(loss) if x == x)
    if ctx.rank == 0:
        log.records.append(records)
        log.losses.append(loss)
        log.tokens = label_count(micro)


def _isolated(
    session: Session | None, micro: list[Batch], ctx: WorkerContext, log: StrategyLog
) -> None:
    spans: list[Span] = []
    for _ in range(ISOLATED_REPEATS):
        ctx.group.barrier()
        if session is not None:
            got = session.isolated_compute(micro)
            spans += got if not session.strategy.is_pipeline else _ranked(got, ctx.rank)
    both = ctx.group.gather_object((log.observed, spans))
    if ctx.rank == 0:
        log.observed = [s for o, _ in both for s in o]
        log.isolated = [s for _, i in both for s in i]
