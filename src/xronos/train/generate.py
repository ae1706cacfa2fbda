"""Greedy decoding and evaluation, on one process or tensor-parallel across processes.

Every rank runs the same loop on the same token ids; the vocab-parallel head's ``greedy``
returns the same argmax on every rank (ties go to the lowest id, as ``torch.argmax``).
"""

from __future__ import annotations

import torch

from xronos.data import Batcher
from xronos.model.llama import KVCache, LlamaForCausalLM
from xronos.train.batches import label_count
from xronos.train.session import EvalResult, EvalSpec


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


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, spec: EvalSpec) -> EvalResult:
    """The eval loss per label token over ``spec.dataset`` and the greedy continuation of
    each prompt (collective on a tensor-parallel shard: every rank calls it)."""
    loss = float("nan")
    if spec.dataset is not None and len(spec.dataset):
        batcher = Batcher(
            spec.dataset,
            min(spec.batch_size, len(spec.dataset)),
            seed=0,
            pad_id=spec.pad_id,
            shuffle=False,
            drop_last=False,
        )
        total, count = 0.0, 0
        model.eval()
        for ids, labels in batcher:
            total += float(model.loss_sum(ids, labels))
            count += label_count([(ids, labels)])
        loss = total / max(count, 1)
    prompts = [list(p) for p in spec.prompts]
    generated = greedy_many(model, prompts, spec.max_new_tokens, spec.eos_ids) if prompts else []
    return EvalResult(loss, generated)
