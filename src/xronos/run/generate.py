"""``xronos generate`` on the devices: greedy decoding with each rank holding its shard."""

from __future__ import annotations

from dataclasses import dataclass

from xronos.checkpoint import load_checkpoint
from xronos.comm.launch import WorkerContext
from xronos.planner.plan import Plan
from xronos.train.generate import greedy
from xronos.train.source import ModelSource


@dataclass(frozen=True, kw_only=True)
class GenerateJob:
    model: ModelSource
    plan: Plan
    prompts: tuple[tuple[int, ...], ...]
    """Token ids of each prompt (special tokens included as the tokenizer adds them)."""
    max_new_tokens: int
    eos_ids: tuple[int, ...] = ()
    """Stop a prompt's continuation after emitting one of these (it is kept)."""
    checkpoint: str | None = None
    """A fine-tuning checkpoint whose weights replace the source's (resharded to ``plan``)."""


def generate_worker(ctx: WorkerContext, job: GenerateJob) -> list[list[int]]:
    model = job.model.build(job.plan, ctx.group)
    if job.checkpoint is not None:
        load_checkpoint(
            job.checkpoint,
            model=model,
            optimizer=None,
            cfg=job.model.cfg,
            plan=job.plan,
            group=ctx.group,
        )
    return [greedy(model, list(p), job.max_new_tokens, job.eos_ids) for p in job.prompts]
