"""The bench's steps: opening a strategy's session, one timed step of it on every rank,
its isolated replay, the solo steps, and the two schedules that order them (see
:mod:`xronos.bench.worker`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from xronos.bench import solo as solo_steps
from xronos.bench.progress import Progress
from xronos.bench.solo import SoloTimes
from xronos.comm.iothreads import restored
from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.metrics.recorder import SpanRecorder
from xronos.metrics.records import Span, StepRecord
from xronos.metrics.rss import PeakRSS, release, resident_bytes
from xronos.planner.profile import DeviceProfile
from xronos.run.opening import Opened, SessionSpec
from xronos.run.rebalance import Rebalancer
from xronos.run.rounds import round_order
from xronos.run.sessions import ProfileSource, open_session
from xronos.train.batches import Batch, RandomBatches, label_count
from xronos.train.loop import STEP_END, Leave, run_step
from xronos.train.session import Session, Strategy
from xronos.train.tp import TPSession, compute_gaps

ISOLATED_REPEATS = 4
"""Pairs per strategy after its counted steps: one more step and its isolated re-run, half
with half (re-runs timed after all steps read the host's drift as stall). The first pair
builds the twins and is not kept (the step after it ran 1.1 s against 0.5); TP's pairs
alternate which half goes first (always second, the twin ran fast: ``single`` 0-28.9 %)."""
SETTLE = 2
"""Warm-up steps after a move in the warm-up (a fresh shard's first steps run slow)."""
MORE_WARMUP = 24
"""The most steps that warm-up moves add to a bench's warm-up (a balance move at step 12
is judged by step 20; its undo settles by step 22)."""
BALANCE_HORIZON = 1000
"""Steps of the fine-tune whose first-plan balance check the bench applies in its warm-up
(:mod:`xronos.run.rebalance`): a move must pay for itself over that many, as in a long
run."""


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
    together: bool = True
    """Also time every device's solo step at the same moment (all of them computing at
    once, as in any collaboration), where every device can hold the whole model: devices
    emulated on one host share its caches and memory, and this shows what that costs."""
    seed: int = 0
    rebalance: bool = True
    """Let a calibrated heterogeneous tensor-parallel session move to a better-balanced
    plan during the warm-up, as ``xronos finetune``'s live re-balancing would (strategies
    that interleave only; the counted steps keep the plan they start with)."""


def times_together(job: BenchJob, solo_ok: list[bool]) -> bool:
    """Whether the solo steps are also timed together: every device holds the model."""
    return job.solo and job.together and len(solo_ok) > 1 and all(solo_ok)


@dataclass
class StrategyLog:
    """What rank 0 keeps of one strategy's steps."""

    records: list[list[StepRecord]] = field(default_factory=list)
    """Every rank's record, per step."""
    losses: list[float] = field(default_factory=list)
    observed: list[Span] = field(default_factory=list)
    """Compute spans of the paired steps (:data:`ISOLATED_REPEATS`), every rank's."""
    isolated: list[Span] = field(default_factory=list)
    """The same spans re-run with no communication in flight, every rank's."""
    plan: dict[str, object] = field(default_factory=dict)
    """What the session describes (a Plan or a PipelinePlan as a dict)."""
    tokens: int = 0
    """Label tokens per step (:func:`~xronos.train.batches.label_count`)."""
    moves: list[dict[str, Any]] = field(default_factory=list)
    """The warm-up's re-balancing moves (the ``Rebalancer``'s events), oldest first."""
    warmup: int = 0
    """Uncounted steps before the counted ones (:attr:`Run.warmup`)."""


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
    job: BenchJob,
    s: Strategy,
    ctx: WorkerContext,
    profiles: Callable[[], list[DeviceProfile]],
    first: list[Batch],
) -> Opened | None:
    """Open strategy ``s``'s session (None on a rank that has no part in it)."""
    spec = replace(job.spec, strategy=s)
    if s is not Strategy.SINGLE:
        return open_session(spec, ctx, ctx.group, profiles, first)
    if ctx.rank != job.fastest:
        return None
    solo = WorkerContext(0, 1, ctx.device, TPGroup(), ctx.timeout_s, (ctx.device,))
    return open_session(spec, solo, TPGroup(), profiles, first)


class Run:
    """The strategies' sessions and steps on this rank."""

    def __init__(
        self,
        job: BenchJob,
        ctx: WorkerContext,
        profiles: Callable[[], list[DeviceProfile]],
        peak: PeakRSS,
        logs: dict[Strategy, StrategyLog],
        progress: Progress,
    ) -> None:
        self.job, self.ctx, self.profiles, self.peak = job, ctx, profiles, peak
        self.logs, self.progress = logs, progress
        self.peaks: dict[Strategy, int] = {}
        """Per strategy: this process's peak resident bytes during its steps (its turn)."""
        self.starts: dict[Strategy, int] = {}
        """Per strategy: resident bytes when its first step (its turn) began."""
        self.planning_s = 0.0
        self.calibrated: list[DeviceProfile] | None = None
        self.auto: dict[str, object] | None = None
        self.io_restored: str | None = None
        """When this process's gloo I/O threads went back to the normal class
        (:mod:`xronos.comm.iothreads`): after which strategy's step, or None."""
        self.first = self._data().peek()
        self.movers: dict[Strategy, Rebalancer] = {}
        self.warmup = job.warmup
        """Uncounted steps: the job's, longer where a warm-up move lets its new plan settle
        (:data:`SETTLE` steps) and, for a balance move, until its steps have judged it
        (undone or kept, as ``xronos finetune`` would)."""

    def _data(self) -> RandomBatches:
        cfg, shape = self.job.spec.source.cfg, self.job.spec.shape
        return RandomBatches(cfg.vocab_size, shape.batch_size, shape.seq_len, seed=self.job.seed)

    def open(self, s: Strategy, watch: bool = False) -> Session | None:
        """Open ``s``'s session; ``watch``: with the warm-up's balance check (:meth:`_watch`)."""
        opened = _open(self.job, s, self.ctx, self.profiles, self.first)
        if watch:
            self._watch(s, opened)
        if s is Strategy.XRONOS and opened is not None:
            self.planning_s, self.calibrated = opened.seconds, opened.calibrated
        if s is Strategy.AUTO and opened is not None and opened.choice and opened.ran:
            self.auto = {
                **opened.choice.to_dict(),
                "ran": opened.ran.to_dict(),
                "chosen_strategy": opened.ran.strategy,
                "predicted_best": opened.choice.chosen.strategy,
                "trials": opened.trials,
                "trial_steps": opened.trial_steps,
                "against_alone": opened.against_alone,
                "refined": opened.refined,
                "seconds": opened.seconds,
            }
        runs = f", runs {self.auto['chosen_strategy']}" if s is Strategy.AUTO and self.auto else ""
        self.progress.say(f"{s.value} ready{runs}")
        return opened.session if opened else None

    def _watch(self, s: Strategy, opened: Opened | None) -> None:
        """The fine-tune's re-balancer for a calibrated heterogeneous TP session (collective)."""
        session = opened.session if opened else None
        if not (
            self.job.rebalance
            and opened is not None
            and isinstance(session, TPSession)
            and session.strategy is Strategy.XRONOS
            and session.group.size > 1
            and len(opened.calibrated) == session.group.size
        ):
            return
        shape = self.job.spec.shape
        chunks = (shape.mlp_chunk, shape.vocab_chunk)
        self.movers[s] = Rebalancer(
            session,
            list(opened.calibrated),
            chunks,
            BALANCE_HORIZON,
            self.logs[s].moves.append,
            timeout_s=self.ctx.timeout_s,
            release=s is Strategy.AUTO,
        )

    def _step(
        self, s: Strategy, session: Session | None, micro: list[Batch], step: int
    ) -> Session | None:
        """One step of ``s``; the session to go on with (a new one where the warm-up's
        balance check moved it to another plan)."""
        counted = step >= self.warmup
        records = _step(session, micro, self.ctx, self.logs[s])
        if self.io_restored is None and restored():
            self.io_restored = f"step {step} of {s.value}"
        mover = self.movers.get(s)
        if mover is None or counted or not isinstance(session, TPSession):
            return session
        fresh = mover.after(session, records)
        # moved: the new plan's first steps are not the run's
        longer = step + 1 + SETTLE if fresh is not None else self.warmup
        if mover.undo is not None:  # a balance move waits for its steps' verdict
            longer = max(longer, step + 2)
        self.warmup = max(self.warmup, min(longer, self.job.warmup + MORE_WARMUP))
        return None if isinstance(fresh, Leave) else fresh or session

    def _finish(self, s: Strategy, session: Session | None, iso: bool) -> None:
        if iso:
            log = self.logs[s]
            both = self.ctx.group.gather_object((log.observed, log.isolated))
            log.observed, log.isolated = ([x for part in both for x in part[k]] for k in (0, 1))
        described = self.ctx.group.gather_object(session.describe() if session else None)
        self.logs[s].plan = next(d for d in described if d is not None)
        moved = self.ctx.group.gather_object(self.logs[s].moves)
        self.logs[s].moves = max(moved, key=len)  # the session's first rank emits them
        if session is not None:
            session.close()

    def _solo_ranks(self, runs: tuple[Strategy, ...], solo_ok: list[bool]) -> list[bool]:
        """Per device: whether it runs the whole model alone for its solo time (not where
        it cannot hold it, nor on the fastest device when ``single`` measures it)."""
        single = Strategy.SINGLE in runs
        return [
            self.job.solo and ok and not (single and r == self.job.fastest)
            for r, ok in enumerate(solo_ok)
        ]

    def _solo(self, runs: tuple[Strategy, ...], solo_ok: list[bool]) -> Session | None:
        """This device's whole model alone, where it runs solo steps in turn or together
        (the fastest one, whose in-turn time is ``single``'s, only for the latter)."""
        mine = self._solo_ranks(runs, solo_ok)[self.ctx.rank]
        if not (mine or times_together(self.job, solo_ok)):
            return None
        spec, ctx = replace(self.job.spec, strategy=Strategy.SINGLE), self.ctx
        alone = WorkerContext(0, 1, ctx.device, TPGroup(), ctx.timeout_s, (ctx.device,))
        return open_session(spec, alone, TPGroup(), self.profiles, self.first).session

    def _solo_round(
        self,
        solo: Session | None,
        micro: list[Batch],
        counted: bool,
        ok: tuple[list[bool], list[bool]],
        times: SoloTimes,
    ) -> None:
        """One solo step of every device in turn; then, on counted steps, one together.
        ``ok``: per device, whether it steps in turn, and whether it can hold the model."""
        in_turn, solo_ok = ok
        mine = solo if in_turn[self.ctx.rank] else None
        this_round = solo_steps.in_turn(mine, micro, self.ctx)
        for r, t in enumerate(this_round):
            if t is not None and counted:
                times.alone[r].append(t)
        if counted and times_together(self.job, solo_ok):
            cover_s = times.cover_s(this_round)
            for r, t in enumerate(solo_steps.together(solo, micro, self.ctx, cover_s)):
                if t is not None:
                    times.together[r].append(t)

    def interleaved(self, runs: tuple[Strategy, ...], solo_ok: list[bool]) -> SoloTimes:
        """Every strategy's session open at once, taking turns step by step."""
        job, ctx = self.job, self.ctx
        sessions = {s: self.open(s, watch=True) for s in runs}
        solo = self._solo(runs, solo_ok)
        solo_times = SoloTimes.empty(ctx.world_size)
        ok = (self._solo_ranks(runs, solo_ok), solo_ok)
        data, micro = self._data(), []
        step = 0
        while step < self.warmup + job.steps:  # a warm-up move may lengthen the warm-up
            micro = data.next_step()
            for s in (runs[i] for i in round_order(len(runs), step)):
                self.starts.setdefault(s, resident_bytes())
                self.peak.reset()
                sessions[s] = self._step(s, sessions[s], micro, step)
                self.peaks[s] = max(self.peaks.get(s, 0), self.peak.peak_bytes())
            if job.solo:
                self._solo_round(solo, micro, step >= self.warmup, ok, solo_times)
            if step < self.warmup:  # a move on some devices lengthens every device's
                self.warmup = max(self.ctx.group.gather_object(self.warmup))
            step += 1
            self.progress.step(step, self.warmup + job.steps, self.warmup)
        if solo is not None:
            solo.close()
        for r in range(ISOLATED_REPEATS + 1):
            micro = data.next_step()
            for s in (runs[i] for i in round_order(len(runs), r)):
                _paired(s, sessions[s], micro, self, r)
        for s in runs:
            self.logs[s].warmup = self.warmup
            self._finish(s, sessions[s], iso=True)
        return solo_times

    def in_turn(self, runs: tuple[Strategy, ...], solo_ok: list[bool]) -> SoloTimes:
        """One strategy at a time, alone in memory; then the solo steps."""
        job, ctx = self.job, self.ctx
        for s in runs:
            release()
            self.starts[s] = resident_bytes()
            self.peak.reset()
            session = self.open(s)
            data, micro = self._data(), []
            self.logs[s].warmup = job.warmup  # no warm-up moves when strategies run alone
            for step in range(job.warmup + job.steps):
                micro = data.next_step()
                session = self._step(s, session, micro, step)
                self.progress.step(step + 1, job.warmup + job.steps, job.warmup, f"{s.value}: ")
            for r in range(ISOLATED_REPEATS + 1 if s.is_pipeline else 0):
                _paired(s, session, data.next_step(), self, r)
            self._finish(s, session, iso=s.is_pipeline)
            self.peaks[s] = self.peak.peak_bytes()
            del session
            release()
        solo_times = SoloTimes.empty(ctx.world_size)
        solo = self._solo(runs, solo_ok)
        ok = (self._solo_ranks(runs, solo_ok), solo_ok)
        if any(ok[0]) or times_together(self.job, solo_ok):
            data = self._data()
            for step in range(job.warmup + job.steps):
                self._solo_round(solo, data.next_step(), step >= job.warmup, ok, solo_times)
                self.progress.step(step + 1, job.warmup + job.steps, job.warmup, "solo: ")
        if solo is not None:
            solo.close()
        return solo_times


def _step(
    session: Session | None,
    micro: list[Batch],
    ctx: WorkerContext,
    log: StrategyLog,
    paired: bool = False,
) -> list[StepRecord]:
    """One step of one strategy on every rank (those without a part in it wait); the
    session's records of it, every rank of its group's (none where it has no part).
    ``paired``: a step for the stall ratio (:func:`_paired`), kept apart from the others."""
    group = ctx.group
    group.barrier()
    rec = SpanRecorder(ctx.rank, ctx.device, enabled=session is not None)
    mine: StepRecord | None = None
    loss = float("nan")
    records: list[StepRecord] = []
    own_records: list[StepRecord] = []
    if session is not None:
        own = session.group
        outcome = run_step(session, micro, own, rec, end_collective=own.size > 1)
        loss, records = outcome.result.loss, outcome.records
        own_records = records
        mine = next((r for r in records if r.rank == ctx.rank), None)
        if mine is not None and paired:
            log.observed += _observed(session, mine, ctx.rank)
    if session is None or session.group.size < group.size:  # some ranks had no part
        records = [r for r in group.gather_object(mine) if r is not None]
        loss = next(x for x in group.gather_object(loss) if x == x)
    if ctx.rank == 0 and not paired:
        log.records.append(records)
        log.losses.append(loss)
        log.tokens = label_count(micro)
    return own_records


def _paired(s: Strategy, session: Session | None, micro: list[Batch], run: Run, r: int) -> None:
    """Pair ``r`` of ``s`` (:data:`ISOLATED_REPEATS`): one more step, not counted, and its
    re-run on the same batch after it, for TP on odd ``r`` before it (on every rank: a
    pipeline, ``auto``'s too, replays what its step received); kept unless ``r`` is 0."""
    ctx, log = run.ctx, run.logs[s]
    n, m = len(log.observed), len(log.isolated)
    pipeline = ctx.group.gather_object(session is not None and session.strategy.is_pipeline)
    for half in ("twin", "step") if r % 2 and not any(pipeline) else ("step", "twin"):
        if half == "step":
            _step(session, micro, ctx, log, paired=True)
        elif session is not None:
            got = session.isolated_compute(micro)
            log.isolated += got if not session.strategy.is_pipeline else _ranked(got, ctx.rank)
        ctx.group.barrier()
    if r == 0:
        del log.observed[n:], log.isolated[m:]
