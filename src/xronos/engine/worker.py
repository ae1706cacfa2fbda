"""The training loop each device's worker runs (single device and tensor-parallel alike)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.engine.job import ModelSource, TrainJob
from xronos.engine.trainer import Trainer
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


def gather_records(rec: StepRecord | None, group: TPGroup, world: int) -> list[StepRecord]:
    """Every rank's record of the same step, on every rank (outside the timed step)."""
    if rec is None:
        return []
    if group.size == 1:
        return [rec]
    packed = pack_records([rec], MAX_EVENTS)
    parts = group.all_gather(packed, "records")
    return [r for p in parts for r in unpack_records(p)]


def train_worker(ctx: WorkerContext, job: TrainJob) -> TrainResult:
    """Build this rank's shard, run ``job.steps`` optimizer steps, report progress."""
    torch.manual_seed(job.model.seed)
    group = ctx.group
    model = build_for(job.model, job.plan, group)
    trainer = Trainer(model, job.model.cfg, job.plan, group, job.optim)
    recorder = SpanRecorder(ctx.rank, ctx.device, enabled=job.record and group.size > 1)
    result = TrainResult()
    start = time.perf_counter()
    batches = job.data.steps(0)
    for step in range(job.steps):
        micro = next(batches)
        recorder.start_step(step)
        with use_recorder(recorder):
            loss, norm = trainer.step(micro)
        records = gather_records(recorder.end_step(), group, ctx.world_size)
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
    if job.return_state:
        result.state = gather_state(model, job.model.cfg, job.plan, group)
    return result


def run_local(job: TrainJob) -> TrainResult:
    """The same loop in this process, on one device (the oracle of every test)."""
    ctx = WorkerContext(0, 1, "local", TPGroup(), 0.0, ("local",))
    return train_worker(ctx, job)
