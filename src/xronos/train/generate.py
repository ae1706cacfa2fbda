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
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
    batch_size: int = 32,
) -> list[list[int]]:
    """``greedy`` for many prompts, ``batch_size`` at a time, padded on the left and
    masked (:class:`KVCache` ``valid``): the same scores as one-by-one decoding up to
    rounding, in one decoding loop per batch."""
    out: list[list[int]] = [[] for _ in prompts]
    model.eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # little padding
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        pad = [width - len(prompts[i]) for i in idx]
        ids = torch.tensor([[0] * n + prompts[i] for n, i in zip(pad, idx, strict=True)])
        valid = torch.tensor([[False] * n + [True] * (width - n) for n in pad])
        cache = KVCache(valid if any(pad) else None)
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
