"""Trainer details that multi-process tests do not isolate."""

from __future__ import annotations

import copy
import math

import torch

from xronos.comm.mappings import TPGroup
from xronos.config import tiny
from xronos.parallel.shard import build_model
from xronos.planner.plan import Plan
from xronos.train.optim import OptimConfig
from xronos.train.trainer import Trainer


def _trainer(**opt: object) -> Trainer:
    cfg = tiny()
    plan = Plan.single(cfg)
    model = build_model(cfg, plan, TPGroup(), seed=0)
    return Trainer(model, cfg, plan, TPGroup(), OptimConfig(**opt))  # type: ignore[arg-type]


def test_fully_masked_step_gives_zero_loss_not_nan() -> None:
    trainer = _trainer()
    ids = torch.randint(0, 100, (2, 8))
    before = [p.detach().clone() for p in trainer.params]
    loss, norm = trainer.step([(ids, torch.full_like(ids, -100))])
    assert loss == 0.0 and norm == 0.0
    # no gradient, no update (AdamW with zero gradients and no weight decay moves nothing)
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.params, strict=True))


def test_loss_is_summed_over_micro_batches_then_divided_by_their_label_count() -> None:
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    short = ids.clone()
    short[:, :5] = -100  # fewer label tokens in the second micro-batch
    one = _trainer()
    with torch.no_grad():
        total = float(one.model.loss_sum(ids, ids)) + float(one.model.loss_sum(ids, short))
    want = total / (int((ids[:, 1:] != -100).sum()) + int((short[:, 1:] != -100).sum()))
    loss, _ = _trainer().step([(ids, ids), (ids, short)])
    assert math.isclose(loss, want, rel_tol=1e-6)  # fp32 sums in a different order


def test_clipping_bounds_the_update_norm() -> None:
    trainer = _trainer(max_grad_norm=1e-3)
    ids = torch.randint(0, 100, (2, 8))
    _, norm = trainer.step([(ids, ids)])
    assert norm > 1e-3  # the raw norm is reported; the gradients were scaled down before
    grads_after = [p.grad for p in trainer.params]
    assert all(g is None for g in grads_after)  # zeroed for the next step


def test_bf16_autocast_trains() -> None:
    trainer = _trainer(bf16=True, lr=1e-2)
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = [trainer.step([(ids, ids)])[0] for _ in range(8)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in trainer.params)  # weights stay fp32


def test_reported_norm_is_the_norm_of_the_accumulated_gradients() -> None:
    # The trainer takes each norm inside the last micro-batch's backward (hooks); the
    # reference takes them all after a plain backward. The tied embedding/head weight
    # must count once, with both of its uses, and earlier micro-batches must count too.
    gen = torch.Generator().manual_seed(2)
    micro = [(ids, ids) for ids in (torch.randint(0, 100, (2, 8), generator=gen) for _ in "ab")]
    trainer = _trainer(max_grad_norm=0.0)
    assert tiny().tie_word_embeddings
    reference = copy.deepcopy(trainer.model).train()
    denom = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
    for ids, labels in micro:
        (reference.loss_sum(ids, labels) / denom).backward()
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    want = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))  # fp64 reference
    _, norm = trainer.step(micro)
    assert math.isclose(norm, want, rel_tol=1e-5)  # the trainer's per-tensor norms are fp32
    _, again = trainer.step(micro)
    assert again != norm  # the hooks' norms do not leak from one step into the next
