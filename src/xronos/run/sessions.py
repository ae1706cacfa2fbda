"""Opening a session: turn a strategy name and the devices' profiles into the session the
loop runs (the one place that knows every strategy).

    single   ─► Plan.single                       ─► TPSession on one device
    tp-even  ─► Plan.even                         ─► TPSession
    xronos   ─► profiles ─► plan_tp + calibration ─► TPSession
    pp-*     ─► profiles ─► stage costs ─► plan_pipeline (DP) ─► PipelineSession
    hybrid   ─► profiles ─► TP group as a stage ─► search      ─► PipelineSession
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.metrics.rss import release, resident_bytes
from xronos.parallel.shard import build_meta
from xronos.planner.memory import within_caps
from xronos.planner.plan import Plan
from xronos.planner.profile import DeviceProfile
from xronos.profiler.measure import Shape
from xronos.profiler.run import profile_self, share_profiles
from xronos.run.opening import (
    Opened,
    SessionSpec,
    calibrated_tp,
    given_candidate,
    open_candidate,
    with_payload,
)
from xronos.run.trials import open_auto
from xronos.train.batches import Batch
from xronos.train.session import Strategy
from xronos.train.tp import TPSession


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
                release()  # the profiler's models and optimizers: kept memory is not theirs
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
    if s is Strategy.HYBRID and spec.hybrid is None:
        return open_auto(spec, ctx, group, profiles, first, only="hybrid")
    if s.is_pipeline and spec.pipeline is None and spec.hybrid is None:
        return open_auto(spec, ctx, group, profiles, first, only="pp-1f1b")
    if s.is_pipeline:  # a given pipeline or hybrid, on the devices it names
        session, _ = open_candidate(spec, ctx, given_candidate(spec), [], first, None)
        return Opened(session, time.perf_counter() - t0, given=True)
    if spec.plan is not None or s is not Strategy.XRONOS:
        plan = spec.plan or (
            Plan.single(cfg, ctx.device) if s is Strategy.SINGLE else Plan.even(cfg, ctx.devices)
        )
        session = TPSession(spec.source, plan, group, spec.optim, s)
        return Opened(session, time.perf_counter() - t0, given=True)
    session, calibrated = calibrated_tp(spec, group, profiles(), first)
    return Opened(session, time.perf_counter() - t0, given=False, calibrated=calibrated)
