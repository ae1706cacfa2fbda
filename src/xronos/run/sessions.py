"""Opening a session: turn a strategy name and the devices' profiles into the session the
loop runs (the one place that knows every strategy).

    single   ─► Plan.single                       ─► TPSession on one device
    tp-even  ─► Plan.even                         ─► TPSession
    xronos   ─► profiles ─► plan_tp + calibration ─► TPSession
    pp-*     ─► profiles ─► stage costs ─► plan_pipeline (DP) ─► PipelineSession
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.pipeline.costs import pipeline_microbatches, stage_costs
from xronos.pipeline.session import PipelineSession
from xronos.planner import PipelinePlan, plan_pipeline, plan_tp
from xronos.planner.plan import Plan
from xronos.planner.profile import DeviceProfile
from xronos.profiler.calibrate import plan_with_calibration
from xronos.profiler.measure import Shape
from xronos.profiler.run import profile_self, share_profiles
from xronos.train.batches import Batch
from xronos.train.optim import OptimConfig
from xronos.train.session import Session, Strategy
from xronos.train.source import ModelSource
from xronos.train.tp import TPSession


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


@dataclass
class Opened:
    """A session and how its plan came about."""

    session: Session
    seconds: float
    """Profiling + planning (+ calibration) time."""
    given: bool
    """The plan was given, not made from profiles."""
    calibrated: list[DeviceProfile] = field(default_factory=list)


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
    if s.is_pipeline:
        pplan = spec.pipeline
        if pplan is None:
            m = pipeline_microbatches(spec.shape.batch_size * spec.grad_accum, group.size, None)
            m = spec.microbatches or max(m - m % spec.grad_accum, spec.grad_accum)
            pplan = plan_pipeline(cfg.num_layers, stage_costs(profiles(), cfg, m), m)
        session: Session = PipelineSession(
            spec.source, pplan, group, spec.optim, s, timeout_s=ctx.timeout_s
        )
        return Opened(session, time.perf_counter() - t0, given=spec.pipeline is not None)
    if spec.plan is not None or s is not Strategy.XRONOS:
        plan = spec.plan or (
            Plan.single(cfg, ctx.device) if s is Strategy.SINGLE else Plan.even(cfg, ctx.devices)
        )
        session = TPSession(spec.source, plan, group, spec.optim, s)
        return Opened(session, time.perf_counter() - t0, given=True)
    shape = spec.shape

    def plan_of(ps: list[DeviceProfile]) -> Plan:
        return plan_tp(cfg, ps, mlp_chunk=shape.mlp_chunk, vocab_chunk=shape.vocab_chunk)

    plan, calibrated, model = plan_with_calibration(
        lambda p: spec.source.build(p, group), plan_of, profiles(), group, first[:1]
    )
    session = TPSession(spec.source, plan, group, spec.optim, s, model=model)
    return Opened(session, time.perf_counter() - t0, given=False, calibrated=calibrated)
