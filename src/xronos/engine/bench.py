"""``xronos bench`` inside the workers: every strategy on the same processes, interleaved.

All strategies live in the same device processes (so in the same emulated limits) and
take turns step by step, the order rotating each round, so that drift of the machine
hits all of them alike. Each step of each strategy starts after a barrier that is not
timed. ``single`` runs the whole model on the fastest device while the others wait.

A multi-device step ends with one more, timed collective (``step.end``): in a real run
the next step's first collective is where a device that finished its optimizer update
early waits for the others; here the untimed barrier between strategies would hide that
wait, so ``step.end`` puts it back, as idle, in the step it belongs to.
"""

from __future__ import annotations

import copy
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.engine.calibrate import plan_with_calibration
from xronos.engine.job import ModelSource, RandomBatches
from xronos.engine.trainer import Batch, OptimConfig, Trainer
from xronos.engine.worker import build_for
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.metrics.records import Span, StepRecord
from xronos.planner import StageCosts, plan_pipeline
from xronos.planner.plan import Plan
from xronos.profiler.measure import Shape
from xronos.planner.profile import DeviceProfile
from xronos.profiler.run import profile_self, share_profiles

TP_STRATEGIES = ("xronos", "tp-even", "single")
ISOLATED_REPEATS = 3
"""Isolated re-runs of the last step per strategy; the stall ratio compares the mean
isolated span with the mean of the same span over every counted step."""
PP_STRATEGIES = ("pp-gpipe", "pp-1f1b")
STEP_END = "step.end"


class Runner(Protocol):
    def step(self, micro_batches: list[Batch]) -> tuple[float, float]: ...


@dataclass(frozen=True, kw_only=True)
class BenchJob:
    source: ModelSource
    shape: Shape
    strategies: tuple[str, ...]
    steps: int
    warmup: int
    optim: OptimConfig
    memory_caps: tuple[int | None, ...]
    profile_keys: tuple[str, ...]
    profiles: tuple[DeviceProfile, ...] | None = None
    """Cached profiles; None = measure them now."""
    microbatches: int | None = None
    """PP micro-batches per step (None = the PP planner's default)."""
    seed: int = 0


@dataclass
class StrategyLog:
    records: list[list[StepRecord]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    observed: list[Span] = field(default_factory=list)
    isolated: list[Span] = field(default_factory=list)


def fastest_rank(profiles: list[DeviceProfile], plan: Plan) -> int:
    totals = {s: sum(plan.split(s)) for s in ("attn", "mlp", "vocab")}
    return min(range(len(profiles)), key=lambda i: profiles[i].step_time(totals))


def compute_gaps(rec: StepRecord) -> list[Span]:
    """The compute spans of a TP step: from the step's start to the first collective and
    between consecutive collectives, named by the collective that ends them."""
    out, t = [], rec.start
    for i, c in enumerate(rec.collectives):
        out.append(Span(f"{rec.rank}/{i}:{c.name}", t, c.arrive, "compute"))
        t = c.leave
    out.append(Span(f"{rec.rank}/end", t, rec.end, "compute"))
    return out


def _isolated_tp(trainer: Trainer, group: TPGroup, micro: list[Batch], rank: int) -> list[Span]:
    """The same training step with every collective skipped (``group.dry``), timed the
    same way; parameters and optimizer state are restored afterwards."""
    params = [p.detach().clone() for p in trainer.params]
    opt_state = copy.deepcopy(trainer.optimizer.state_dict())
    rec = SpanRecorder(rank, enabled=True)
    group.dry = True
    try:
        rec.start_step(-1)
        with use_recorder(rec):
            trainer.step(micro)
            group.all_reduce(torch.zeros(1), STEP_END)  # as in the timed steps (dry: no wait)
        record = rec.end_step()
    finally:
        group.dry = False
        with torch.no_grad():
            for p, saved in zip(trainer.params, params, strict=True):
                p.copy_(saved)
        trainer.optimizer.load_state_dict(opt_state)
        trainer.steps_done -= 1
    return compute_gaps(record) if record is not None else []


def bench_worker(ctx: WorkerContext, job: BenchJob) -> dict[str, Any] | None:
    group, cfg = ctx.group, job.source.cfg
    t0 = time.perf_counter()
    profiles = (
        list(job.profiles)
        if job.profiles
        else share_profiles(
            profile_self(
                ctx.device, job.shape, group, job.memory_caps[ctx.rank], job.profile_keys[ctx.rank]
            ),
            group,
        )
    )
    profile_s = time.perf_counter() - t0
    data = RandomBatches(cfg.vocab_size, job.shape.batch_size, job.shape.seq_len, seed=job.seed)
    first = next(data.steps(0))
    plan_x, profiles, model_x = plan_with_calibration(
        job.source,
        profiles,
        group,
        first,
        mlp_chunk=job.shape.mlp_chunk,
        vocab_chunk=job.shape.vocab_chunk,
    )
    planning_s = time.perf_counter() - t0
    plans = {"xronos": plan_x, "tp-even": Plan.even(cfg, ctx.devices), "single": Plan.single(cfg)}
    fast = fastest_rank(profiles, plans["single"])
    runners: dict[str, Runner | None] = {}
    for name in job.strategies:
        if name in ("xronos", "tp-even"):
            model = model_x if name == "xronos" else build_for(job.source, plans[name], group)
            runners[name] = Trainer(model, cfg, plans[name], group, job.optim)
        elif name == "single":
            if ctx.rank == fast:
                model = build_for(job.source, plans[name], TPGroup())
                runners[name] = Trainer(model, cfg, plans[name], TPGroup(), job.optim)
            else:
                runners[name] = None
        else:
            runners[name] = _pipeline_runner(name, job, ctx, profiles)
    logs = {name: StrategyLog() for name in job.strategies}
    batches = data.steps(0)
    micro: list[Batch] = []
    for step in range(job.warmup + job.steps):
        micro = next(batches)
        k = step % len(job.strategies)
        for name in job.strategies[k:] + job.strategies[:k]:
            _run_step(name, runners[name], micro, step, ctx, logs[name], step >= job.warmup)
    for name in job.strategies:
        _isolated(name, runners[name], micro, ctx, logs[name])
    pp_plans = {n: r.pplan.to_dict() for n, r in runners.items() if hasattr(r, "pplan")}  # type: ignore[union-attr]
    for r in runners.values():
        if hasattr(r, "close"):
            r.close()  # type: ignore[union-attr]
    rss = group.gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if ctx.rank != 0:
        return None
    return {
        "logs": logs,
        "profiles": [p.to_dict() for p in profiles],
        "plan": plan_x.to_dict(),
        "planning_s": planning_s,
        "profile_s": profile_s,
        "peak_rss_mb": rss,
        "fastest": fast,
        "pp_plans": pp_plans,
    }


def _run_step(
    name: str,
    runner: Runner | None,
    micro: list[Batch],
    step: int,
    ctx: WorkerContext,
    log: StrategyLog,
    counted: bool,
) -> None:
    group = ctx.group
    group.barrier()
    rec = SpanRecorder(ctx.rank, ctx.device, enabled=runner is not None)
    loss = float("nan")
    if runner is not None:
        rec.start_step(step)
        with use_recorder(rec):
            loss, _ = runner.step(micro)
            if name != "single":
                group.all_reduce(torch.zeros(1), STEP_END)
    record = rec.end_step()
    if name == "single":
        gathered = [r for r in group.gather_object(record) if r is not None]
        losses = [x for x in group.gather_object(loss) if x == x]
    else:
        gathered = group.gather_object(record)
        losses = [loss]
    if ctx.rank == 0:
        log.records.append(gathered)
        log.losses.append(losses[0])
    if record is not None and counted:
        log.observed += (
            compute_gaps(record) if name in TP_STRATEGIES else _ranked(record.computes, ctx.rank)
        )


def _isolated(
    name: str,
    runner: Runner | None,
    micro: list[Batch],
    ctx: WorkerContext,
    log: StrategyLog,
) -> None:
    spans: list[Span] = []
    for _ in range(ISOLATED_REPEATS):
        ctx.group.barrier()
        if name in TP_STRATEGIES:
            trainer = runner if isinstance(runner, Trainer) else None
            spans += _isolated_tp(trainer, trainer.group, micro, ctx.rank) if trainer else []
        else:
            spans += _ranked(runner.isolated_compute(micro), ctx.rank)  # type: ignore[union-attr]
    both = ctx.group.gather_object((log.observed, spans))
    if ctx.rank == 0:
        log.observed = [s for o, _ in both for s in o]
        log.isolated = [s for _, i in both for s in i]


def _ranked(spans: Any, rank: int) -> list[Span]:
    """Span names made unique across ranks (stall ratios match spans by name)."""
    return [Span(f"{rank}/{s.name}", s.start, s.end, s.kind) for s in spans]


def stage_costs(profiles: list[DeviceProfile], cfg: Any, microbatches: int) -> list[StageCosts]:
    """Per-micro-batch stage costs from the TP profiles (costs scale with tokens)."""
    plan = Plan.single(cfg)
    units = {s: sum(plan.split(s)) for s in ("attn", "mlp", "vocab")}
    layers, m = cfg.num_layers, microbatches
    out = []
    for p in profiles:
        per_layer = (p.segments["attn"](units["attn"]) + p.segments["mlp"](units["mlp"])) / layers
        ub = p.unit_bytes or {}
        out.append(
            StageCosts(
                name=p.name,
                layer_s=(per_layer + p.replicated_s / layers) / m,
                head_s=p.segments["vocab"](units["vocab"]) / m,
                send_s=p.allreduce_s / m,
                layer_bytes=(ub.get("attn", 0) * units["attn"] + ub.get("mlp", 0) * units["mlp"])
                // layers,
                head_bytes=ub.get("vocab", 0) * units["vocab"],
                memory_bytes=max(0, p.memory_bytes - p.base_bytes) if p.memory_bytes else 0,
            )
        )
    return out


def pipeline_microbatches(batch_size: int, stages: int, requested: int | None) -> int:
    """2 × stages (enough to fill the pipeline), at most one sequence per micro-batch."""
    return requested or max(1, min(2 * stages, batch_size))


def _pipeline_runner(
    name: str, job: BenchJob, ctx: WorkerContext, profiles: list[DeviceProfile]
) -> Runner:
    from xronos.engine.pipeline import PipelineRunner

    cfg = job.source.cfg
    m = pipeline_microbatches(job.shape.batch_size, ctx.world_size, job.microbatches)
    pplan = plan_pipeline(cfg.num_layers, stage_costs(profiles, cfg, m), m)
    return PipelineRunner(
        job.source, pplan, ctx.group, job.optim, strategy=name, timeout_s=ctx.timeout_s
    )
