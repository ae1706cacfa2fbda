"""Fine-tuning with a pipeline-parallel baseline (``--strategy pp-gpipe|pp-1f1b``).

The same loop as tensor parallelism (``xronos.engine.finetune``) drives a
``PipelineRunner``. Evaluation and the final checkpoint use the whole model gathered on
rank 0, so a pipeline run exports exactly like a tensor-parallel one. Its checkpoints hold
the weights but not the optimizer state: a pipeline run cannot be resumed.
"""

from __future__ import annotations

from typing import Any

import torch

from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.data import Batcher
from xronos.engine.bench import pipeline_microbatches, stage_costs
from xronos.engine.finetune import FinetuneJob, _emit_eval, checkpoint_extra, device_profiles
from xronos.engine.pipeline import PipelineRunner
from xronos.engine.trainer import Batch, Trainer
from xronos.engine.worker import build_for
from xronos.errors import UserError
from xronos.model.llama import LlamaForCausalLM
from xronos.planner import plan_pipeline
from xronos.planner.plan import Plan


class PipelineSession:
    def __init__(self, ctx: WorkerContext, job: FinetuneJob) -> None:
        self.ctx, self.job = ctx, job
        cfg = job.source.cfg
        profiles = device_profiles(ctx, job)
        m = pipeline_microbatches(job.batch_size * job.grad_accum, ctx.world_size, None)
        m -= m % job.grad_accum  # the runner splits each micro-batch evenly
        self.pplan = plan_pipeline(cfg.num_layers, stage_costs(profiles, cfg, m), max(m, 1))
        if ctx.rank == 0:
            ctx.emit({"kind": "pipeline", "plan": self.pplan.to_dict()})
        self.runner = PipelineRunner(
            job.source,
            self.pplan,
            ctx.group,
            job.optim,
            strategy=job.strategy,
            timeout_s=ctx.timeout_s,
        )

    def step(self, micro: list[Batch]) -> tuple[float, float]:
        return self.runner.step(micro)

    def lr(self) -> float:
        return float(self.runner.optimizer.param_groups[0]["lr"])

    def _whole(self) -> LlamaForCausalLM | None:
        """The full model with the trained weights, on rank 0 only (collective)."""
        state = self.runner.gather_state()
        if self.ctx.rank != 0:
            return None
        cfg = self.job.source.cfg
        model = build_for(self.job.source, Plan.single(cfg), TPGroup())
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                if name in params:
                    params[name].copy_(value)
        return model

    def evaluate(self, step: int, when: str) -> None:
        model = self._whole()
        if model is not None:
            solo = WorkerContext(
                0, 1, self.ctx.device, TPGroup(), self.ctx.timeout_s, channel=self.ctx.channel
            )
            _emit_eval(solo, model, self.job, step, when)
        self.ctx.group.barrier()

    def save(self, batcher: Batcher, step: int) -> str:
        from pathlib import Path

        from xronos.checkpoint import save_checkpoint

        path = Path(self.job.run_dir) / "checkpoints" / f"step-{step:08d}"
        model = self._whole()
        if model is not None:
            cfg, plan = self.job.source.cfg, Plan.single(self.job.source.cfg)
            trainer = Trainer(model, cfg, plan, TPGroup(), self.job.optim)
            save_checkpoint(
                path,
                model=model,
                trainer=trainer,
                cfg=cfg,
                plan=plan,
                group=TPGroup(),
                extra=checkpoint_extra(self.job, batcher, step),
            )
            self.ctx.emit({"kind": "checkpoint", "step": step, "path": str(path)})
        self.ctx.group.barrier()
        return str(path)

    def resume(self, batcher: Batcher) -> int:
        raise UserError(
            "pipeline runs cannot be resumed (their checkpoints hold no optimizer "
            "state); resume with --strategy xronos or tp-even"
        )

    def describe(self) -> dict[str, Any]:
        return self.pplan.to_dict()
