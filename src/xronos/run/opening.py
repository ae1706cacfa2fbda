"""What every rank needs to open a session, and opening one strategy's session on its
devices: the pieces :mod:`xronos.run.sessions` (one strategy) and :mod:`xronos.run.trials`
(``auto``'s candidates) share."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from xronos.comm.groups import new_group
from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.errors import UserError
from xronos.pipeline.session import HybridStages, PipelineSession
from xronos.planner import PipelinePlan, plan_tp
from xronos.planner.auto import AutoChoice, Candidate
from xronos.planner.calibrate import left_out
from xronos.planner.hybrid import HybridPlan
from xronos.planner.plan import Plan
from xronos.planner.profile import DeviceProfile
from xronos.profiler.calibrate import plan_with_calibration
from xronos.profiler.measure import Shape
from xronos.train.batches import Batch
from xronos.train.optim import OptimConfig
from xronos.train.session import Session, Strategy
from xronos.train.source import ModelSource
from xronos.train.tp import TPSession

TRIAL_STEPS = 4
"""Timed steps (after one untimed) that ``auto`` runs of each shortlisted candidate; their
median decides. Two were too few on a noisy host: candidates 10 % apart swapped places."""


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
    hybrid: HybridPlan | None = None
    """A given hybrid plan (its groups are ranks of the session's group); None: planned."""
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
    trial_steps: dict[str, list[float]] = field(default_factory=dict)
    """For ``auto``: each shortlisted candidate's timed trial steps, in the order taken
    (where a refined plan raced, the steps of that second race)."""
    against_alone: dict[str, Any] | None = None
    """For ``auto``: its fastest collaboration tried against the fastest device alone
    (:meth:`xronos.run.trials.AgainstAlone.to_dict`); None where not both were tried."""
    refined: list[dict[str, Any]] = field(default_factory=list)
    """For ``auto``: heterogeneous tensor-parallel plans re-planned from their own trial
    steps and tried too (:meth:`xronos.run.refine.Refinement.to_dict`)."""

    @property
    def trials(self) -> dict[str, float]:
        """For ``auto``: measured seconds per step of each shortlisted candidate (the median
        of its timed trial steps)."""
        return {key: statistics.median(ts) for key, ts in self.trial_steps.items()}


def calibrated_tp(
    spec: SessionSpec, group: TPGroup, profiles: list[DeviceProfile], first: list[Batch]
) -> tuple[TPSession, list[DeviceProfile]]:
    """Heterogeneous TP over ``group``: plan from the members' ``profiles``, calibrate."""
    cfg, shape = spec.source.cfg, spec.shape

    def plan_of(ps: list[DeviceProfile], least: dict[str, int]) -> Plan:
        return plan_tp(
            cfg, ps, mlp_chunk=shape.mlp_chunk, vocab_chunk=shape.vocab_chunk, min_units=least
        )

    plan, calibrated, model, rounds = plan_with_calibration(
        lambda p: spec.source.build(p, group), plan_of, profiles, group, first[:1]
    )
    strays = left_out(profiles, rounds)
    rounds_made = [r.to_dict() | {"left_out": o} for r, o in zip(rounds, strays, strict=True)]
    session = TPSession(
        spec.source, plan, group, spec.optim, Strategy.XRONOS, model=model, calibration=rounds_made
    )
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


def open_candidate(
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
        if isinstance(best.plan, PipelinePlan | HybridPlan) and len(members) > 1:
            # the stages make a point-to-point group of their own: every rank takes part
            new_group(members, ctx.timeout_s)
        return None, []
    own = with_payload(own, spec.comm_dtype)
    if spec.overlap and not isinstance(best.plan, PipelinePlan | HybridPlan):
        own = own.with_lanes(ctx.timeout_s)
    if best.strategy == "single":
        single = Plan.single(cfg, ctx.device)
        return TPSession(spec.source, single, own, spec.optim, Strategy.SINGLE), []
    if best.strategy == "xronos" and plan is not None:
        return TPSession(spec.source, plan, own, spec.optim, Strategy.XRONOS), []
    if best.strategy == "xronos":
        chosen = replace(spec, strategy=Strategy.XRONOS)
        return calibrated_tp(chosen, own, [measured[r] for r in members], first)
    if best.strategy == "tp-even":
        assert isinstance(best.plan, Plan)
        return TPSession(spec.source, best.plan, own, spec.optim, Strategy.TP_EVEN), []
    if isinstance(best.plan, HybridPlan):
        local = tuple(tuple(members.index(r) for r in g) for g in best.plan.groups)
        return hybrid_session(spec, ctx, own, HybridStages(best.plan, local)), []
    assert isinstance(best.plan, PipelinePlan)
    order = [members.index(r) for r in best.plan.stage_ranks]
    plain = (Strategy.PP_GPIPE, Strategy.PP_1F1B)
    schedule = spec.strategy if spec.strategy in plain else Strategy(best.strategy)
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


def hybrid_session(
    spec: SessionSpec, ctx: WorkerContext, group: TPGroup, stages: HybridStages
) -> PipelineSession:
    """A hybrid's session on ``group`` (every rank of it calls this)."""
    return PipelineSession(
        spec.source,
        stages.plan.pipeline,
        group,
        spec.optim,
        Strategy.HYBRID,
        timeout_s=ctx.timeout_s,
        anchored=spec.anchor is not None,
        hybrid=stages,
    )


def given_candidate(spec: SessionSpec) -> Candidate:
    """The given pipeline or hybrid of ``spec`` as the candidate that runs it."""
    if spec.hybrid is not None:
        h = spec.hybrid
        ranks = tuple(r for g in h.groups for r in g)
        return Candidate("hybrid", ranks, h.pipeline.predicted_step_s, h, True, "given")
    assert spec.pipeline is not None
    p = spec.pipeline
    return Candidate("pp-1f1b", p.stage_ranks, p.predicted_step_s, p, True, "given")
