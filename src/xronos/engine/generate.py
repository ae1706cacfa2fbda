"""Greedy decoding, on one process or tensor-parallel across local processes.

Every rank runs the same loop on the same token ids; the vocab-parallel head's ``greedy``
returns the same argmax on every rank (ties go to the lowest id, as ``torch.argmax``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xronos.comm.launch import WorkerContext
from xronos.engine.job import ModelSource
from xronos.engine.worker import build_for
from xronos.model.llama import KVCache, LlamaForCausalLM
from xronos.planner.plan import Plan


@dataclass(frozen=True, kw_only=True)
class GenerateJob:
    model: ModelSource
    plan: Plan
    prompts: tuple[tuple[int, ...], ...]
    """Token ids of each prompt (BOS included if the tokenizer adds one)."""
    max_new_tokens: int
    eos_ids: tuple[int, ...] = ()
    """Stop a prompt's continuation after emitting one of these (it is kept)."""
    checkpoint: str | None = None
    """A fine-tuning checkpoint whose weights replace the source's (resharded to ``plan``)."""


@torch.no_grad()
def greedy(
    model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]
) -> list[int]:
    """Generated ids (without the prompt), stopping after an EOS id or max_new_tokens."""
    model.eval()
    cache = KVCache()
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(max_new_tokens):
        h = model.hidden_states(ids, cache)[:, -1]  # (1, H)
        nxt = int(model.head.greedy(h)[0])
        out.append(nxt)
        if nxt in eos_ids:
            break
        ids = torch.tensor([[nxt]])
    return out


def generate_worker(ctx: WorkerContext, job: GenerateJob) -> list[list[int]]:
    model = build_for(job.model, job.plan, ctx.group)
    if job.checkpoint is not None:
        from xronos.checkpoint import load_checkpoint

        load_checkpoint(
            job.checkpoint,
            model=model,
            trainer=None,
            cfg=job.model.cfg,
            plan=job.plan,
            group=ctx.group,
        )
    return [greedy(model, list(p), job.max_new_tokens, job.eos_ids) for p in job.prompts]


@torch.no_grad()
def greedy_many(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int, eos_ids: tuple[int, ...]
) -> list[list[int]]:
    """``greedy`` for many prompts, batching prompts of equal length (no padding needed,
    so the result is exactly what one-by-one decoding gives)."""
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]
    model.eval()
    for idx in by_len.values():
        cache = KVCache()
        ids = torch.tensor([prompts[i] for i in idx])
        done = [False] * len(idx)
        for _ in range(max_new_tokens):
            h = model.hidden_states(ids, cache)[:, -1]
            nxt = model.head.greedy(h).tolist()
            for j, t in enumerate(nxt):
                if not done[j]:
                    out[idx[j]].append(t)
                    done[j] = t in eos_ids
            if all(done):
                break
            ids = torch.tensor([[t] for t in nxt])
    return out
