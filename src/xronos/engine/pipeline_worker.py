"""The training loop of a pipeline-parallel run: the PP counterpart of ``engine.worker``.

Every rank runs :func:`pipeline_worker` with the same :class:`PipelineJob`::

    runner = PipelineRunner(...)                     # this rank's stage
    for step in range(steps):
        recorder.start_step(step)
        with use_recorder(recorder):
            loss, norm = runner.step(micro)          # spans: fwd/bwd, recv:/send:, grads.norm
        records = gather(recorder.end_step())        # rank 0 gets every stage's record
    for _ in range(isolated_runs):                   # after the last step, all stages at once
        isolated += runner.isolated_compute(micro)   # the same compute, no communication

and rank 0's :class:`PipelineResult` carries the losses, the per-step records (for
``analyze_pipeline_step``) and every stage's isolated spans (for ``stall_ratio``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from xronos.comm.launch import WorkerContext
from xronos.engine.job import ModelSource, TrainJob
from xronos.engine.pipeline import PipelineRunner
from xronos.engine.trainer import OptimConfig
from xronos.engine.worker import TrainResult, gather_records, run_steps
from xronos.metrics.analysis import stall_ratio
from xronos.metrics.records import Span, StepRecord
from xronos.planner.pipeline import PipelinePlan


@dataclass(frozen=True, kw_only=True)
class PipelineJob:
    """A pipeline-parallel fine-tuning run as every rank sees it."""

    model: ModelSource
    pipeline: PipelinePlan
    """Layer ranges per stage (stage ``j`` = rank ``j``) and micro-batches per step."""
    strategy: str
    """``pp-gpipe`` or ``pp-1f1b``."""
    optim: OptimConfig
    data: Any
    """A BatchSource (the same on every rank)."""
    steps: int
    """Optimizer steps to run."""
    return_state: bool = False
    """Return the gathered final parameters (tests, export)."""
    record: bool = True
    """Record spans for the idle/transfer analysis."""
    isolated_runs: int = 1
    """After the last step, re-run its compute this many times with no communication in
    flight, for the computation-stall ratio (0 = skip)."""

    @classmethod
    def from_train_job(
        cls, job: TrainJob, pipeline: PipelinePlan, strategy: str, isolated_runs: int = 1
    ) -> PipelineJob:
        """The same workload as a tensor-parallel job, run as a pipeline."""
        return cls(
            model=job.model,
            pipeline=pipeline,
            strategy=strategy,
            optim=job.optim,
            data=job.data,
            steps=job.steps,
            return_state=job.return_state,
            record=job.record,
            isolated_runs=isolated_runs,
        )


@dataclass
class PipelineResult(TrainResult):
    """:class:`TrainResult` plus each stage's isolated compute spans (rank 0 only)."""

    isolated: list[list[Span]] = field(default_factory=list)


def pipeline_worker(ctx: WorkerContext, job: PipelineJob) -> PipelineResult:
    """Build this rank's stage, run ``job.steps`` steps, then measure isolated compute."""
    torch.manual_seed(job.model.seed)
    group = ctx.group
    runner = PipelineRunner(
        job.model, job.pipeline, group, job.optim, strategy=job.strategy, timeout_s=ctx.timeout_s
    )
    m = job.pipeline.num_microbatches
    max_events = 6 * m + 8  # ≤ 2 computes + 4 p2p spans per micro-batch, tied, drain, norm
    result = PipelineResult()
    micro = run_steps(ctx, runner.step, job.data, job.steps, job.record, result, max_events)
    if job.record and group.size > 1 and job.isolated_runs > 0 and micro:
        spans = [s for _ in range(job.isolated_runs) for s in runner.isolated_compute(micro)]
        iso = StepRecord(
            ctx.rank, ctx.device, job.steps, spans[0].start, spans[-1].end, (), tuple(spans)
        )
        gathered = gather_records(iso, group, 2 * m * job.isolated_runs)
        if ctx.rank == 0:
            result.isolated = [list(r.computes) for r in sorted(gathered, key=lambda r: r.rank)]
    if job.return_state:
        result.state = runner.gather_state()
    runner.close()
    return result


def stall_ratios(result: PipelineResult, skip_warmup: int = 0) -> list[float]:
    """Computation-stall ratio per stage (DESIGN §6): the compute spans of the counted steps
    against the same spans measured in isolation."""
    if not result.isolated:
        raise ValueError("the run measured no isolated compute (isolated_runs=0 or one stage)")
    counted = result.records[skip_warmup:]
    out = []
    for rank, isolated in enumerate(result.isolated):
        observed = [s for step in counted for r in step if r.rank == rank for s in r.computes]
        out.append(stall_ratio(observed, isolated))
    return out
