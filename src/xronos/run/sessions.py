"""Opening a session: turn a strategy name and the devices' profiles into the session the
loop runs (the one place that knows every strategy).

    single   ─► Plan.single                       ─► TPSession on one device
    tp-even  ─► Plan.even                         ─► TPSession
    xronos   ─► profiles ─► plan_tp + calibration ─► TPSession
    pp-*     ─► profiles ─► stage costs ─► plan_pipeline (DP) ─► PipelineSession
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from xronos.comm.groups import new_group
from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.errors import UserError
from xronos.metrics.rss import release, resident_bytes
from xronos.parallel.shard import build_meta
from xronos.pipeline.session import PipelineSession
from xronos.planner import PipelinePlan, plan_tp
from xronos.planner.auto import AutoChoice, Candidate, plan_auto
from xronos.planner.memory import within_caps
from xronos.planner.plan import Plan
from xronos.planner.profile import DeviceProfile, on_the_wire
from xronos.profiler.calibrate import plan_with_calibration
from xronos.profiler.measure import Shape
from xronos.profiler.run import profile_self, share_profiles
from xronos.train.batches import Batch
from xronos.train.optim import OptimConfig
from xronos.train.session import Session, Strategy
from xronos.train.source import ModelSource
from xronos.train.tp import TPSession

TRIAL_STEPS = 4
"""Timed steps (after one untimed) that ``auto`` runs of each shortlisted candidate; their
median decides. Two were too few on a noisy host: candidates 10 % apart swapped places."""
SHORTLIST = 3
"""How many of the best-predicted candidates ``auto`` measures before it chooses."""


@dataclass(frozen=True, kw_only=True)
class SessionSpec:
    """What every rank needs to open the same strategy's session."""

    source: ModelSource
    strategy: Strategy
    optim: OptimConfig
    shape: Shape
    """The step's batch shape and the planner's unit sizes."""
    grad_accum: int = 1
    plan: Plan | None = None
    """A given tensor-parallel plan (``--plan``); None: the strategy makes its own."""
    microbatches: int | None = None
    """Pipeline micro-batches per step (None: the pipeline planner's default)."""
    pipeline: PipelinePlan | None = None
    """A given pipeline plan (stages, layer ranges, micro-batches); None: planned."""
    comm_dtype: str = "fp32"
    """Dtype of the tensor-parallel activation all-reduces on the wire (``bf16`` halves
    the bytes; ``fp32`` is exact)."""
    overlap: bool = False
    """Tensor parallelism runs each micro-batch as two halves in two lanes, one computing
    while the other's all-reduce is in flight (:mod:`xronos.train.trainer`)."""
    trial_steps: int = TRIAL_STEPS
    """``auto``: timed steps of each shortlisted candidate before choosing (0: trust the
    predictions alone)."""
    anchor: int | None = None
    """A device that every session must include: the coordinator, which alone holds the
    files and writes the run (``xronos worker``); None: any subset may run."""
    resuming: bool = False
    """The run continues from a checkpoint: ``auto`` leaves out what cannot resume
    (pipelines, whose checkpoints hold no optimizer state)."""


@dataclass(frozen=True, kw_only=True)
class ProfileSource:
    """Where each device's profile comes from: the cache, or measured on the devices."""

    memory_caps: tuple[int | None, ...]
    keys: tuple[str, ...]
    cached: tuple[DeviceProfile, ...] | None = None


@dataclass
class Profiles:
    """The devices' profiles, measured (or read from the cache) once, on first use."""

    ctx: WorkerContext
    shape: Shape
    source: ProfileSource
    measured: list[DeviceProfile] | None = None
    seconds: float = 0.0
    runtime: list[int] | None = None
    """Per device: the bytes its process holds before any model (measured once)."""

    def get(self) -> list[DeviceProfile]:
        """Every device's profile, in rank order (collective on first call)."""
        if self.measured is None:
            t0 = time.perf_counter()
            if self.source.cached:
                self.measured = list(self.source.cached)
            else:
                r = self.ctx.rank
                mine = profile_self(
                    self.ctx.device,
                    self.shape,
                    self.ctx.group,
                    self.source.memory_caps[r],
                    self.source.keys[r],
                )
                self.measured = share_profiles(mine, self.ctx.group)
            self.seconds = time.perf_counter() - t0
        return self.measured

    def usable(self) -> list[DeviceProfile]:
        """:meth:`get`, with each capped device's usable memory its cap less the bytes its
        process holds before any model (interpreter, torch, the collectives' library),
        measured once on every rank (collective on first call). A device with no cap keeps
        its profile; so does every device when none is capped."""
        measured = self.get()
        caps = self.source.memory_caps
        if not caps or all(c is None for c in caps):
            return measured
        return within_caps(measured, caps, self.process_runtime())

    def process_runtime(self) -> list[int]:
        """Per device, the bytes its process holds before any model (measured once, with
        what building a model loads already loaded; collective on first call)."""
        if self.runtime is None:
            build_meta(self.shape.cfg)
            release()
            self.runtime = [int(b) for b in self.ctx.group.gather_object(resident_bytes())]
        return self.runtime


@dataclass
class Opened:
    """A session and how its plan came about."""

    session: Session | None
    """None on a device that has no part in the chosen strategy (``auto``)."""
    seconds: float
    """Profiling + planning (+ calibration) time."""
    given: bool
    """The plan was given, not made from profiles."""
    calibrated: list[DeviceProfile] = field(default_factory=list)
    choice: AutoChoice | None = None
    """For ``auto``: every candidate's prediction and the winner."""
    ran: Candidate | None = None
    """For ``auto``: the candidate that runs (the fastest measured of the shortlist)."""
    trials: dict[str, float] = field(default_factory=dict)
    """For ``auto``: measured seconds per step of each shortlisted candidate."""


def open_session(
    spec: SessionSpec,
    ctx: WorkerContext,
    group: TPGroup,
    profiles: Callable[[], list[DeviceProfile]],
    first: list[Batch],
) -> Opened:
    """Open ``spec.strategy``'s session on ``group`` (every rank of it calls this).

    Args:
        spec: the strategy and the workload.
        ctx: this worker (device names, timeout).
        group: the ranks that run the session (one rank for ``single``).
        profiles: every device's profile, measured on first call (collective).
        first: a step's micro-batches, for calibration's real passes.
    """
    t0 = time.perf_counter()
    cfg, s = spec.source.cfg, spec.strategy
    group = with_payload(group, spec.comm_dtype)
    if s is Strategy.AUTO:
        return open_auto(spec, ctx, group, profiles, first)
    if spec.overlap and not s.is_pipeline:
        group = group.with_lanes(ctx.timeout_s)
    if s.is_pipeline and spec.pipeline is None:
        return open_auto(spec, ctx, group, profiles, first, only="pp-1f1b")
    if s.is_pipeline:
        assert spec.pipeline is not None
        session: Session = PipelineSession(
            spec.source,
            spec.pipeline,
            group,
            spec.optim,
            s,
            timeout_s=ctx.timeout_s,
            stage_ranks=spec.pipeline.stage_ranks,
            anchored=spec.anchor is not None,
        )
        return Opened(session, time.perf_counter() - t0, given=True)
    if spec.plan is not None or s is not Strategy.XRONOS:
        plan = spec.plan or (
            Plan.single(cfg, ctx.device) if s is Strategy.SINGLE else Plan.even(cfg, ctx.devices)
        )
        session = TPSession(spec.source, plan, group, spec.optim, s)
        return Opened(session, time.perf_counter() - t0, given=True)
    session, calibrated = _calibrated_tp(spec, group, profiles(), first)
    return Opened(session, time.perf_counter() - t0, given=False, calibrated=calibrated)


def _calibrated_tp(
    spec: SessionSpec, group: TPGroup, profiles: list[DeviceProfile], first: list[Batch]
) -> tuple[TPSession, list[DeviceProfile]]:
    """Heterogeneous TP over ``group``: plan from the members' ``profiles``, calibrate."""
    cfg, shape = spec.source.cfg, spec.shape

    def plan_of(ps: list[DeviceProfile]) -> Plan:
        return plan_tp(cfg, ps, mlp_chunk=shape.mlp_chunk, vocab_chunk=shape.vocab_chunk)

    plan, calibrated, model = plan_with_calibration(
        lambda p: spec.source.build(p, group), plan_of, profiles, group, first[:1]
    )
    session = TPSession(spec.source, plan, group, spec.optim, Strategy.XRONOS, model=model)
    return session, calibrated


PAYLOADS = {"fp32": None, "bf16": torch.bfloat16}
"""``--comm-dtype`` -> the dtype activations travel in (None: their own)."""


def wire_bytes(comm_dtype: str) -> int:
    """Bytes per element of the activation all-reduces under ``--comm-dtype``."""
    payload = PAYLOADS.get(comm_dtype)
    return 4 if payload is None else torch.finfo(payload).bits // 8


def with_payload(group: TPGroup, comm_dtype: str) -> TPGroup:
    """``group`` sending its activation all-reduces in ``comm_dtype``."""
    if comm_dtype not in PAYLOADS:
        raise UserError(f"--comm-dtype {comm_dtype!r}: choose one of {', '.join(PAYLOADS)}")
    return replace(group, payload=PAYLOADS[comm_dtype])


def subgroup(ctx: WorkerContext, ranks: Sequence[int]) -> TPGroup | None:
    """The group of ``ranks`` (world ranks); None on a rank outside it. Collective: every
    rank of the world calls it with the same ``ranks``."""
    members = sorted(ranks)
    if len(members) == ctx.world_size:
        return ctx.group
    pg = None
    if len(members) > 1:
        pg = new_group(members, ctx.timeout_s)
    if ctx.rank not in members:
        return None
    if pg is None:
        return TPGroup()
    return replace(ctx.group, rank=members.index(ctx.rank), size=len(members), pg=pg)


def _key(c: Candidate) -> str:
    return f"{c.strategy}:{','.join(map(str, c.devices))}"


def open_auto(
    spec: SessionSpec,
    ctx: WorkerContext,
    group: TPGroup,
    profiles: Callable[[], list[DeviceProfile]],
    first: list[Batch],
    only: str | None = None,
) -> Opened:
    """Predict every candidate (:func:`~xronos.planner.auto.plan_auto`), then *measure*
    the best few — each opened fresh on its devices, one untimed and
    :data:`TRIAL_STEPS` timed steps on the first batch, then discarded — and open the
    fastest measured one; the devices it leaves out get no session. Predictions from a few
    seconds of profiling can be off by tens of percent; a real step cannot. A hybrid is
    predicted but not run yet. With ``only`` (``pp-1f1b``: the best pipeline, run with
    ``spec.strategy``'s schedule) the best-predicted candidate of that kind runs, untried."""
    t0 = time.perf_counter()
    cfg, shape, measured = spec.source.cfg, spec.shape, profiles()
    choice = plan_auto(
        cfg,
        on_the_wire(measured, wire_bytes(spec.comm_dtype)),
        batch_size=shape.batch_size,
        seq_len=shape.seq_len,
        grad_accum=spec.grad_accum,
        mlp_chunk=shape.mlp_chunk,
        vocab_chunk=shape.vocab_chunk,
    )
    runnable = [
        c
        for c in choice.candidates
        if c.feasible
        and c.strategy != "hybrid"
        and (only is None or c.strategy == only)
        and not (spec.resuming and only is None and isinstance(c.plan, PipelinePlan))
        and (spec.anchor is None or spec.anchor in c.devices)
    ]
    if not runnable:
        raise UserError("auto: no strategy fits the devices' memory; add memory or devices")
    ranked = sorted(runnable, key=lambda c: c.predicted_step_s)
    shortlist = ranked[:SHORTLIST] if only is None else ranked[:1]
    trials: dict[str, float] = {}
    tried: dict[str, tuple[Plan | None, list[DeviceProfile]]] = {}
    if len(shortlist) > 1 and spec.trial_steps > 0:
        for c in shortlist:
            session, calibrated = _open_candidate(spec, ctx, c, measured, first, None)
            trials[_key(c)] = _trial(session, first, ctx, spec.trial_steps)
            tried[_key(c)] = (getattr(session, "plan", None), calibrated)
            if session is not None:
                session.close()
            session = None  # a trial's memory is gone before the next one is built
    best = min(shortlist, key=lambda c: trials.get(_key(c), c.predicted_step_s))
    plan, calibrated = tried.get(_key(best), (None, []))
    session, fresh = _open_candidate(spec, ctx, best, measured, first, plan)
    return Opened(
        session,
        time.perf_counter() - t0,
        given=False,
        calibrated=calibrated or fresh,
        choice=choice,
        ran=best,
        trials=trials,
    )


def _trial(session: Session | None, micro: list[Batch], ctx: WorkerContext, steps: int) -> float:
    """Median over ``steps`` steps (after one) of the slowest rank's step time; every rank
    of the world takes part (those without a session wait)."""
    times = []
    for k in range(1 + steps):
        ctx.group.barrier()
        start = time.perf_counter()
        if session is not None:
            session.step(micro)
        worst = max(ctx.group.gather_object(time.perf_counter() - start))
        if k:
            times.append(worst)
    return statistics.median(times)


def _open_candidate(
    spec: SessionSpec,
    ctx: WorkerContext,
    best: Candidate,
    measured: list[DeviceProfile],
    first: list[Batch],
    plan: Plan | None,
) -> tuple[Session | None, list[DeviceProfile]]:
    """``best``'s session on its devices (None elsewhere; collective over the world), and
    its calibrated profiles; ``plan``: an xronos plan already calibrated (a trial's)."""
    cfg = spec.source.cfg
    members = sorted(best.devices)
    own = subgroup(ctx, members)
    if own is None:
        if isinstance(best.plan, PipelinePlan) and len(members) > 1:
            # the stages make a point-to-point group of their own: every rank takes part
            new_group(members, ctx.timeout_s)
        return None, []
    own = with_payload(own, spec.comm_dtype)
    if spec.overlap and not isinstance(best.plan, PipelinePlan):
        own = own.with_lanes(ctx.timeout_s)
    if best.strategy == "single":
        single = Plan.single(cfg, ctx.device)
        return TPSession(spec.source, single, own, spec.optim, Strategy.SINGLE), []
    if best.strategy == "xronos" and plan is not None:
        return TPSession(spec.source, plan, own, spec.optim, Strategy.XRONOS), []
    if best.strategy == "xronos":
        chosen = replace(spec, strategy=Strategy.XRONOS)
        return _calibrated_tp(chosen, own, [measured[r] for r in members], first)
    if best.strategy == "tp-even":
        assert isinstance(best.plan, Plan)
        return TPSession(spec.source, best.plan, own, spec.optim, Strategy.TP_EVEN), []
    assert isinstance(best.plan, PipelinePlan)
    order = [members.index(r) for r in best.plan.stage_ranks]
    schedule = spec.strategy if spec.strategy.is_pipeline else Strategy(best.strategy)
    pipeline = PipelineSession(
        spec.source,
        best.plan,
        own,
        spec.optim,
        schedule,
        timeout_s=ctx.timeout_s,
        stage_ranks=order,
        anchored=spec.anchor is not None,
    )
    return pipeline, []
