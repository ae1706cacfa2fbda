"""The training loop each device's worker runs (single device and tensor-parallel alike)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.engine.job import BatchSource, ModelSource, TrainJob
from xronos.engine.trainer import Batch, Trainer
from xronos.errors import UserError
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.metrics.records import StepRecord, pack_records, unpack_records
from xronos.model.llama import LlamaForCausalLM
from xronos.parallel.gather import gather_state
from xronos.parallel.shard import build_model
from xronos.planner.plan import Plan

MAX_EVENTS = 512  # collectives per step that a packed record can carry


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    records: list[list[StepRecord]] = field(default_factory=list)
    state: dict[str, torch.Tensor] | None = None
    wall_s: float = 0.0


def build_for(source: ModelSource, plan: Plan, group: TPGroup) -> LlamaForCausalLM:
    return build_model(
        source.cfg, plan, group, model_dir=source.model_dir, seed=source.seed, lora=source.lora
    )


def gather_records(
    rec: StepRecord | None, group: TPGroup, max_events: int = MAX_EVENTS
) -> list[StepRecord]:
    """Every rank's record of the same step, on every rank (outside the timed step; gloo
    needs equal sizes, so each record is packed to ``max_events``)."""
    if rec is None:
        return []
    if group.size == 1:
        return [rec]
    parts = group.all_gather(pack_records([rec], max_events), "records")
    return [r for p in parts for r in unpack_records(p)]


def run_steps(
    ctx: WorkerContext,
    step_fn: Callable[[list[Batch]], tuple[float, float]],
    data: BatchSource,
    steps: int,
    record: bool,
    result: TrainResult,
    max_events: int = MAX_EVENTS,
) -> list[Batch]:
    """``steps`` optimizer steps of ``step_fn`` (a Trainer's or a pipeline runner's), each
    recorded and reported to the parent; returns the last step's micro-batches."""
    recorder = SpanRecorder(ctx.rank, ctx.device, enabled=record and ctx.group.size > 1)
    start = time.perf_counter()
    batches = data.steps(0)
    micro: list[Batch] = []
    for step in range(steps):
        micro = next(batches)
        recorder.start_step(step)
        with use_recorder(recorder):
            loss, norm = step_fn(micro)
        records = gather_records(recorder.end_step(), ctx.group, max_events)
        if not math.isfinite(loss):
            raise UserError(f"loss became {loss} at step {step}; lower --lr or check the data")
        result.losses.append(loss)
        result.grad_norms.append(norm)
        if records and ctx.rank == 0:
            result.records.append(records)
        if ctx.rank == 0:
            tokens = sum(int(ids.numel()) for ids, _ in micro)
            ctx.emit({"step": step, "loss": loss, "grad_norm": norm, "tokens": tokens})
    result.wall_s = time.perf_counter() - start
    return micro


def train_worker(ctx: WorkerContext, job: TrainJob) -> TrainResult:
    """Build this rank's shard, run ``job.steps`` optimizer steps, report progress."""
    torch.manual_seed(job.model.seed)
    model = build_for(job.model, job.plan, ctx.group)
    trainer = Trainer(model, job.model.cfg, job.plan, ctx.group, job.optim)
    result = TrainResult()
    run_steps(ctx, trainer.step, job.data, job.steps, job.record, result)
    if job.return_state:
        result.state = gather_state(model, job.model.cfg, job.plan, ctx.group)
    return result


def run_local(job: TrainJob) -> TrainResult:
    """The same loop in this process, on one device (the oracle of every test)."""
    ctx = WorkerContext(0, 1, "local", TPGroup(), 0.0, ("local",))
    return train_worker(ctx, job)
