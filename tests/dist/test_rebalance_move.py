"""A live move to another plan (:func:`xronos.run.moves.move`) continues the same
training: the losses after it equal those of the run that kept its plan, and those of one
device training alone (the oracle)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.dist.test_checkpoint import CFG  # a tied model whose KV groups plans cut
from tests.dist.world import WorkerContext, run_world
from xronos.comm.mappings import TPGroup
from xronos.model.lora import LoRAConfig
from xronos.planner.plan import Plan
from xronos.run.moves import move, move_prefix, narrow
from xronos.train.batches import RandomBatches
from xronos.train.optim import OptimConfig
from xronos.train.session import Strategy
from xronos.train.source import ModelSource
from xronos.train.tp import TPSession

# from 6 : 2 query heads to 3 : 5 (the second device got faster), MLP and vocab likewise
BEFORE_PLAN = dataclasses.replace(
    Plan.from_shares(CFG, [3.0, 1.0], mlp_chunk=8, vocab_chunk=8), attn=(6, 2)
)
AFTER_PLAN = dataclasses.replace(
    Plan.from_shares(CFG, [1.0, 1.6], mlp_chunk=8, vocab_chunk=8), attn=(3, 5)
)
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, warmup_steps=4, max_grad_norm=1.0)
# The move changes only how the all-reduces associate their partial sums (fp32); a lost
# piece of state (AdamW moments, step count, dropout RNG) moves the loss by ≥ 1e-3; the
# move's losses agree to 1.1e-7 relative (measured).
LOSS_RTOL = 1e-5


def _losses(session: TPSession, data: RandomBatches, steps: int) -> list[float]:
    return [session.step(data.next_step()).loss for _ in range(steps)]


def _world(ctx: WorkerContext, lora: LoRAConfig | None) -> dict[str, Any]:
    source = ModelSource(cfg=CFG, seed=5, lora=lora)
    out: dict[str, Any] = {}
    for moved in (False, True):
        torch.manual_seed(7)
        session = TPSession(source, BEFORE_PLAN, ctx.group, OPTIM, Strategy.XRONOS)
        data = RandomBatches(CFG.vocab_size, batch_size=2, seq_len=16, seed=1)
        losses = _losses(session, data, 3)
        if moved:
            session, seconds = move(session, AFTER_PLAN, move_prefix(12345))
            out["plan"] = session.plan.split("attn")
            out["seconds"] = seconds
        losses += _losses(session, data, 3)
        out["moved" if moved else "kept"] = losses
        out[f"steps_{moved}"] = session.steps_done
    return out


def _single(lora: LoRAConfig | None) -> list[float]:
    """The same 6 steps on one device, in this process."""
    torch.manual_seed(7)
    source = ModelSource(cfg=CFG, seed=5, lora=lora)
    session = TPSession(source, Plan.single(CFG, "local"), TPGroup(), OPTIM, Strategy.SINGLE)
    return _losses(session, RandomBatches(CFG.vocab_size, batch_size=2, seq_len=16, seed=1), 6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "lora", [None, LoRAConfig(r=4, alpha=8.0, dropout=0.1)], ids=["full", "lora-dropout"]
)
def test_a_move_to_another_plan_continues_the_same_training(lora: LoRAConfig | None) -> None:
    oracle = _single(lora)
    for rank, r in enumerate(run_world(_world, 2, lora)):
        assert r["plan"] == (3, 5), rank
        assert r["steps_True"] == r["steps_False"] == 6
        assert r["moved"][:3] == r["kept"][:3]
        assert r["moved"][3:] == pytest.approx(r["kept"][3:], rel=LOSS_RTOL)
        assert r["moved"] == pytest.approx(oracle, rel=LOSS_RTOL)


# -- a release: the run goes on with fewer devices (xronos.run.moves.narrow) --------------
THREE = Plan.from_shares(CFG, [2.0, 1.0, 1.0], mlp_chunk=8, vocab_chunk=8)


def _released(ctx: WorkerContext, arg: tuple[tuple[int, ...], int]) -> dict[str, Any]:
    keep, world = arg
    source = ModelSource(cfg=CFG, seed=5, lora=None)
    torch.manual_seed(7)
    start = BEFORE_PLAN if world == 2 else THREE
    session = TPSession(source, start, ctx.group, OPTIM, Strategy.XRONOS)
    data = RandomBatches(CFG.vocab_size, batch_size=2, seq_len=16, seed=1)
    losses = _losses(session, data, 3)
    names = [f"rank{r}" for r in keep]
    after = Plan.from_shares(CFG, [1.0] * len(keep), names, mlp_chunk=8, vocab_chunk=8)
    fresh, _ = narrow(session, keep, after, move_prefix(4242), timeout_s=60.0)
    if fresh is None:
        return {"kept": False}
    losses += _losses(fresh, data, 3)
    return {
        "kept": True,
        "losses": losses,
        "size": fresh.group.size,
        "members": fresh.group.world_ranks(),
        "strategy": fresh.strategy,
        "steps": fresh.steps_done,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("keep", "world"), [((0,), 2), ((1,), 2), ((0, 2), 3)], ids=["first", "second", "two-of-three"]
)
def test_a_release_continues_the_same_training_on_the_devices_kept(
    keep: tuple[int, ...], world: int
) -> None:
    oracle = _single(None)
    results = run_world(_released, world, (keep, world))
    assert [r["kept"] for r in results] == [rank in keep for rank in range(world)]
    for rank in keep:
        r = results[rank]
        assert r["size"] == len(keep) and r["members"] == keep
        # one device left: it trains alone, as `single` (its checkpoints say so)
        assert r["strategy"] is (Strategy.SINGLE if len(keep) == 1 else Strategy.XRONOS)
        assert r["steps"] == 6
        # the same tolerance as a move: only the all-reduces' association differs
        assert r["losses"] == pytest.approx(oracle, rel=LOSS_RTOL)
