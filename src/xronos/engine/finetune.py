"""The fine-tuning run each device's worker executes (``xronos finetune``).

Rank 0 reports to the parent through events; the parent owns the console, the run
directory's logs and the evaluation metric (it holds the tokenizer).

    profile + plan (xronos) ─► build shard ─► [resume] ─► eval ─► steps … ─► save ─► eval
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.data import Batcher, TokenizedDataset
from xronos.engine.calibrate import plan_with_calibration
from xronos.engine.generate import greedy_many
from xronos.engine.job import ModelSource
from xronos.engine.trainer import Batch, OptimConfig, Trainer
from xronos.engine.worker import build_for, gather_records
from xronos.errors import UserError
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.model.llama import LlamaForCausalLM
from xronos.planner.plan import Plan
from xronos.profiler.measure import Shape
from xronos.planner.profile import DeviceProfile
from xronos.profiler.run import profile_self, share_profiles


@dataclass(frozen=True, kw_only=True)
class FinetuneJob:
    source: ModelSource
    strategy: str
    plan: Plan | None
    """Given (tp-even, single, --plan) or None: profile and plan on the devices."""
    shape: Shape
    profile_keys: tuple[str, ...] = ()
    profiles: tuple[DeviceProfile, ...] | None = None
    memory_caps: tuple[int | None, ...] = ()
    optim: OptimConfig
    train: TokenizedDataset
    eval: TokenizedDataset | None
    eval_prompts: tuple[tuple[int, ...], ...] = ()
    max_new_tokens: int = 32
    eos_ids: tuple[int, ...] = ()
    batch_size: int
    grad_accum: int = 1
    steps: int
    seed: int = 0
    pad_id: int = 0
    eval_every: int = 0
    save_every: int = 0
    run_dir: str
    resume: str | None = None
    """A checkpoint directory to continue from."""


@dataclass
class FinetuneState:
    step: int = 0
    stop: bool = False
    last_checkpoint: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


_STOP = {"requested": False}


def _request_stop(signum: int, frame: Any) -> None:
    _STOP["requested"] = True


def _agree_stop(group: TPGroup) -> bool:
    """True on every rank once any rank was asked to stop (Ctrl-C in the parent)."""
    flag = torch.tensor([1.0 if _STOP["requested"] else 0.0])
    if group.size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.pg)
    return bool(flag.item() > 0)


def make_plan(
    ctx: WorkerContext, job: FinetuneJob, first: list[Batch]
) -> tuple[Plan, LlamaForCausalLM]:
    """The given plan, or profile + plan + calibrate on the devices (``xronos``)."""
    t0 = time.perf_counter()
    if job.plan is not None:
        plan, model = job.plan, build_for(job.source, job.plan, ctx.group)
        profiles: list[DeviceProfile] = []
    else:
        plan, profiles, model = plan_with_calibration(
            job.source,
            device_profiles(ctx, job),
            ctx.group,
            first,
            mlp_chunk=job.shape.mlp_chunk,
            vocab_chunk=job.shape.vocab_chunk,
        )
    if ctx.rank == 0:
        ctx.emit(
            {
                "kind": "plan",
                "plan": plan.to_dict(),
                "seconds": time.perf_counter() - t0,
                "profiles": [p.to_dict() for p in profiles],
                "cached": bool(job.profiles),
                "given": job.plan is not None,
            }
        )
    return plan, model


def device_profiles(ctx: WorkerContext, job: FinetuneJob) -> list[DeviceProfile]:
    """The cached profiles, or every device's own measurement, shared."""
    if job.profiles:
        return list(job.profiles)
    mine = profile_self(
        ctx.device, job.shape, ctx.group, job.memory_caps[ctx.rank], job.profile_keys[ctx.rank]
    )
    return share_profiles(mine, ctx.group)


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, job: FinetuneJob) -> tuple[float, list[list[int]]]:
    """(eval loss per label token, generated ids of each eval prompt)."""
    loss = float("nan")
    if job.eval is not None and len(job.eval):
        batcher = Batcher(
            job.eval,
            min(job.batch_size, len(job.eval)),
            seed=0,
            pad_id=job.pad_id,
            shuffle=False,
            drop_last=False,
        )
        total, count = 0.0, 0
        model.eval()
        for ids, labels in batcher:
            total += float(model.loss_sum(ids, labels))
            count += int((labels[:, 1:] != -100).sum())
        loss = total / max(count, 1)
    prompts = [list(p) for p in job.eval_prompts]
    generated = greedy_many(model, prompts, job.max_new_tokens, job.eos_ids) if prompts else []
    return loss, generated


class TPSession:
    """This rank's shard, its optimizer and its plan (tensor-parallel strategies)."""

    def __init__(self, ctx: WorkerContext, job: FinetuneJob, first: list[Batch]) -> None:
        self.ctx, self.job = ctx, job
        self.plan, self.model = make_plan(ctx, job, first)
        self.trainer = Trainer(self.model, job.source.cfg, self.plan, ctx.group, job.optim)

    def step(self, micro: list[Batch]) -> tuple[float, float]:
        return self.trainer.step(micro)

    def lr(self) -> float:
        return self.trainer.lr_now()

    def save(self, batcher: Batcher, step: int) -> str:
        return _save(self.ctx, self.job, self.model, self.trainer, self.plan, batcher, step)

    def resume(self, batcher: Batcher) -> int:
        return _resume(self.job, self.model, self.trainer, self.plan, self.ctx.group, batcher)

    def evaluate(self, step: int, when: str) -> None:
        _emit_eval(self.ctx, self.model, self.job, step, when)

    def describe(self) -> dict[str, Any]:
        return self.plan.to_dict()


def finetune_worker(ctx: WorkerContext, job: FinetuneJob) -> dict[str, Any]:
    signal.signal(signal.SIGUSR1, _request_stop)
    torch.manual_seed(job.seed)
    group = ctx.group
    batcher = Batcher(job.train, job.batch_size, seed=job.seed, pad_id=job.pad_id)
    first = [batcher.collate(batcher.order(0)[: job.batch_size])]
    session: Any
    if job.strategy.startswith("pp-"):
        from xronos.engine.finetune_pp import PipelineSession

        session = PipelineSession(ctx, job)
    else:
        session = TPSession(ctx, job, first)
    state = FinetuneState()
    if job.resume:
        state.step = session.resume(batcher)
    if state.step == 0 and (job.eval is not None or job.eval_prompts):
        session.evaluate(0, "before")
    recorder = SpanRecorder(ctx.rank, ctx.device, enabled=group.size > 1)
    while state.step < job.steps and not state.stop:
        micro = [batcher.next_batch() for _ in range(job.grad_accum)]
        recorder.start_step(state.step)
        with use_recorder(recorder):
            loss, norm = session.step(micro)
        records = gather_records(recorder.end_step(), group)
        if not math.isfinite(loss):
            where = state.last_checkpoint or "none was written yet"
            raise UserError(
                f"loss is {loss} at step {state.step}; stopped; the last good "
                f"checkpoint is {where}; lower --lr or check the data"
            )
        state.step += 1
        if ctx.rank == 0:
            ctx.emit(
                {
                    "kind": "step",
                    "step": state.step,
                    "loss": loss,
                    "grad_norm": norm,
                    "tokens": sum(int((lb != -100).sum()) for _, lb in micro),
                    "lr": session.lr(),
                    "records": [r.to_dict() for r in records],
                }
            )
        state.stop = _agree_stop(group)
        if job.save_every and state.step % job.save_every == 0 and state.step < job.steps:
            state.last_checkpoint = session.save(batcher, state.step)
        if job.eval_every and state.step % job.eval_every == 0 and state.step < job.steps:
            session.evaluate(state.step, "during")
    state.last_checkpoint = session.save(batcher, state.step)
    if not state.stop:
        session.evaluate(state.step, "after")
    return {
        "step": state.step,
        "stopped": state.stop,
        "checkpoint": state.last_checkpoint,
        "plan": session.describe(),
    }


def _emit_eval(
    ctx: WorkerContext, model: LlamaForCausalLM, job: FinetuneJob, step: int, when: str
) -> None:
    t0 = time.perf_counter()
    loss, generated = evaluate(model, job)
    if ctx.rank == 0:
        ctx.emit(
            {
                "kind": "eval",
                "step": step,
                "when": when,
                "eval_loss": loss,
                "generated": generated,
                "seconds": time.perf_counter() - t0,
            }
        )


def checkpoint_extra(job: FinetuneJob, batcher: Batcher, step: int) -> dict[str, Any]:
    from dataclasses import asdict

    return {
        "step": step,
        "data": batcher.state_dict(),
        "model": {
            "preset": None if job.source.model_dir else job.source.name,
            "dir": job.source.model_dir,
            "seed": job.source.seed,
            "config": job.source.cfg.to_hf_dict(),
        },
        "lora": asdict(job.source.lora) if job.source.lora else None,
        "strategy": job.strategy,
    }


def _save(
    ctx: WorkerContext,
    job: FinetuneJob,
    model: LlamaForCausalLM,
    trainer: Trainer,
    plan: Plan,
    batcher: Batcher,
    step: int,
) -> str:
    from xronos.checkpoint import save_checkpoint

    path = Path(job.run_dir) / "checkpoints" / f"step-{step:08d}"
    save_checkpoint(
        path,
        model=model,
        trainer=trainer,
        cfg=job.source.cfg,
        plan=plan,
        group=ctx.group,
        extra=checkpoint_extra(job, batcher, step),
    )
    if ctx.rank == 0:
        ctx.emit({"kind": "checkpoint", "step": step, "path": str(path)})
    return str(path)


def _resume(
    job: FinetuneJob,
    model: LlamaForCausalLM,
    trainer: Trainer,
    plan: Plan,
    group: TPGroup,
    batcher: Batcher,
) -> int:
    from xronos.checkpoint import load_checkpoint

    assert job.resume is not None
    extra = load_checkpoint(
        job.resume, model=model, trainer=trainer, cfg=job.source.cfg, plan=plan, group=group
    )
    batcher.load_state_dict(extra["data"])
    return int(extra["step"])
