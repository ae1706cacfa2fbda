"""Pipeline and hybrid checkpoints resume, on the same stages and across strategies; a
pipeline evaluates as one device with the same weights does.

The product's own sessions train, save and load. One 3-rank world runs every case: a
pipeline (or hybrid) trains a few steps, saves, trains on (the uninterrupted run); a fresh
one resumes from the checkpoint on the same stages; tensor parallelism resumes from it on
the same ranks; and the pipeline resumes from a tensor-parallel run's checkpoint. A single
process then resumes from each pipeline checkpoint, and evaluates with its weights as
the pipeline did when it wrote it (gathered on one stage). The tied embedding trains on the last
stage (the first stage's copy is not saved); LoRA runs with dropout, so the dropout
generators must come back.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tests.dist import product
from tests.dist.world import WorkerContext, run_world
from xronos.checkpoint import read_checkpoint_meta
from xronos.comm.mappings import TPGroup
from xronos.data.dataset import TokenizedDataset
from xronos.errors import UserError
from xronos.model.lora import LoRAConfig
from xronos.pipeline.session import HybridStages, PipelineSession
from xronos.planner.hybrid import HybridPlan
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.plan import Plan
from xronos.train.batches import RandomBatches
from xronos.train.optim import OptimConfig
from xronos.train.session import EvalResult, EvalSpec, Session, Strategy
from xronos.train.source import ModelSource
from xronos.train.tp import TPSession

# Resuming on other ranks or another strategy changes only how partial sums associate
# (per stage, per shard, per micro-batch), so the continued losses agree with the
# uninterrupted run to fp32 reassociation (at most 1.1e-7 relative measured;
# docs/architecture.md, Exactness).
# A lost piece of state (AdamW moments, step count, warm-up position, dropout RNG) moves
# the loss by ≥ 1e-3.
LOSS_RTOL = 1e-5
CFG = product.four_layers(tied=True)
# warm-up longer than the saved steps: the resumed lr schedule depends on steps_done
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, warmup_steps=4, max_grad_norm=1.0)
BEFORE, AFTER = 3, 3
TP_PLAN = Plan.from_shares(CFG, [3.0, 1.5, 1.0], mlp_chunk=8, vocab_chunk=8)
# Evaluating the same weights on one process in both cases: only the thread count of the
# matrix products may differ (a world's ranks vs the test process), ~1e-7 relative; a
# stale tied matrix or a stage's adapters left out move the loss by ≥ 1e-3.
EVAL_RTOL = 1e-5
_ids = torch.randint(0, CFG.vocab_size, (3, 16), generator=torch.Generator().manual_seed(3))
EVAL = EvalSpec(
    dataset=TokenizedDataset(_ids.tolist(), _ids.tolist(), seq_len=16),
    prompts=(tuple(_ids[0, :5].tolist()), tuple(_ids[1, :3].tolist())),
    max_new_tokens=4,
)
HYBRID_TP = Plan.from_shares(CFG, [2.0, 1.0], mlp_chunk=8, vocab_chunk=8, devices=["r1", "r2"])


@dataclass(frozen=True)
class Case:
    name: str
    lora: LoRAConfig | None
    hybrid: bool
    ckpt: str

    @property
    def tp_ckpt(self) -> str:
        return self.ckpt + "-tp"


def _source(case: Case) -> ModelSource:
    return ModelSource(cfg=CFG, seed=5, lora=case.lora)


def _pipeline(case: Case, group: TPGroup) -> PipelineSession:
    """3 stages with layers [2, 1, 1]; the hybrid runs its last stage (3 layers, the head
    and the tied matrix) as TP on ranks 1 and 2."""
    if not case.hybrid:
        pplan = PipelinePlan(("r0", "r1", "r2"), ((0, 2), (2, 3), (3, 4)), (), 2)
        return PipelineSession(_source(case), pplan, group, OPTIM, Strategy.PP_1F1B)
    pplan = PipelinePlan(("r0", "r1+r2"), ((0, 1), (1, 4)), (), 2)
    hplan = HybridPlan(((0,), (1, 2)), pplan, HYBRID_TP)
    stages = HybridStages(hplan, hplan.groups)
    return PipelineSession(_source(case), pplan, group, OPTIM, Strategy.HYBRID, hybrid=stages)


def _tp(case: Case, group: TPGroup) -> TPSession:
    plan = TP_PLAN if group.size == 3 else Plan.single(CFG)
    return TPSession(_source(case), plan, group, OPTIM, Strategy.XRONOS)


def _run(session: Session, start: int, steps: int) -> list[float]:
    data = RandomBatches(
        CFG.vocab_size, batch_size=2, seq_len=16, grad_accum=2, seed=1, position=start
    )
    return [session.step(data.next_step()).loss for _ in range(steps)]


def _extra(session: Session) -> dict[str, Any]:
    return {"model": {"preset": None, "seed": 5}, "data": {"step": session.steps_done}}


def _world(ctx: WorkerContext, cases: list[Case]) -> list[dict[str, Any]]:
    out = []
    for case in cases:
        pp = _pipeline(case, ctx.group)
        _run(pp, 0, BEFORE)
        pp.save(Path(case.ckpt), _extra(pp))
        evaluated = pp.evaluate(EVAL)
        uninterrupted = _run(pp, BEFORE, AFTER)
        pp.close()
        fresh = _pipeline(case, ctx.group)
        extra = fresh.load(case.ckpt)
        resumed = _run(fresh, BEFORE, AFTER)
        fresh.close()
        control = _pipeline(case, ctx.group)  # the weights back, AdamW's moments lost
        control.load(case.ckpt)
        control.runner.optimizer.state.clear()
        forgetful = _run(control, BEFORE, AFTER)
        control.close()
        tp = _tp(case, ctx.group)
        tp.load(case.ckpt)
        tp_from_pp = _run(tp, BEFORE, AFTER)
        tp = _tp(case, ctx.group)  # and the other way round
        _run(tp, 0, BEFORE)
        tp.save(Path(case.tp_ckpt), _extra(tp))
        tp_uninterrupted = _run(tp, BEFORE, AFTER)
        pp = _pipeline(case, ctx.group)
        pp.load(case.tp_ckpt)
        pp_from_tp = _run(pp, BEFORE, AFTER)
        pp.close()
        out.append(
            {
                "extra": extra,
                "evaluated": evaluated,
                "uninterrupted": uninterrupted,
                "resumed": resumed,
                "forgetful": forgetful,
                "tp_from_pp": tp_from_pp,
                "tp_uninterrupted": tp_uninterrupted,
                "pp_from_tp": pp_from_tp,
            }
        )
    return out


def _single(cases: list[Case]) -> list[tuple[EvalResult | None, list[float]]]:
    out = []
    for case in cases:
        alone = _tp(case, TPGroup())
        step = int(alone.load(case.ckpt)["data"]["step"])
        out.append((alone.evaluate(EVAL), _run(alone, step, AFTER)))
    return out


def _check_files(case: Case) -> None:
    """Each stage's tensors lie in its own ranks' files; the tied matrix and its moments
    in the last stage's, not in the first stage's (its copy is not saved)."""
    ckpt = Path(case.ckpt)
    meta = read_checkpoint_meta(ckpt)
    assert meta["step"] == BEFORE and meta["world_size"] == 3 and meta["optimizer"] is True
    keys = []
    for rank in range(3):
        with safe_open(str(ckpt / f"rank{rank}.safetensors"), framework="pt") as f:
            keys.append(set(f.keys()))
    tied = "model.embed_tokens.weight"
    if case.lora is None:
        assert f"param/{tied}" not in keys[0] and f"optim/exp_avg/{tied}" not in keys[0]
        holder = 1 if case.hybrid else 2  # the hybrid splits it: both members hold rows
        assert f"param/{tied}" in keys[holder] and f"optim/exp_avg_sq/{tied}" in keys[holder]
    layer3 = [k for k in keys[2] if k.startswith("param/model.layers.3.")]
    assert layer3, "the last stage's layers are in its file"
    assert not any(k.startswith("param/model.layers.3.") for k in keys[0])
    assert all(f"rng/torch/{rank}" in keys[rank] for rank in range(3))


@pytest.mark.slow
def test_pipeline_checkpoints_resume_on_any_strategy(tmp_path: Path) -> None:
    dropout = LoRAConfig(r=4, alpha=8.0, dropout=0.1)
    cases = [
        Case("pp/full", None, False, str(tmp_path / "pp-full")),
        Case("pp/lora", dropout, False, str(tmp_path / "pp-lora")),
        Case("hybrid/full", None, True, str(tmp_path / "hybrid-full")),
        Case("hybrid/lora", dropout, True, str(tmp_path / "hybrid-lora")),
    ]
    by_rank = run_world(_world, 3, cases, timeout_s=240.0)
    alone = _single(cases)
    for i, case in enumerate(cases):
        _check_files(case)
        ref = by_rank[0][i]
        assert ref["extra"] == {"model": {"preset": None, "seed": 5}, "data": {"step": BEFORE}}
        for rank, res in enumerate(r[i] for r in by_rank):
            where = f"{case.name}, rank {rank}"
            # the same stages: the same arithmetic, so a bit-identical continuation
            assert res["resumed"] == ref["uninterrupted"], where
            assert res["tp_from_pp"] == pytest.approx(ref["uninterrupted"], rel=LOSS_RTOL), where
            assert res["pp_from_tp"] == pytest.approx(res["tp_uninterrupted"], rel=LOSS_RTOL), where
        evaluated, resumed = alone[i]
        assert resumed == pytest.approx(ref["uninterrupted"], rel=LOSS_RTOL), case.name
        assert evaluated is not None
        for rank, res in enumerate(r[i]["evaluated"] for r in by_rank):
            assert res.loss == pytest.approx(evaluated.loss, rel=EVAL_RTOL), (case.name, rank)
            assert res.generated == evaluated.generated, (case.name, rank)
        # the control: a resume that loses the moments leaves the run by ~1e-2 relative
        assert ref["forgetful"] != pytest.approx(ref["uninterrupted"], rel=10 * LOSS_RTOL)


def _no_optimizer(ckpt: Path) -> None:
    """Make ``ckpt`` look like an older pipeline run's: weights, no optimizer state."""
    index = json.loads((ckpt / "index.json").read_text())
    index["params"] = {name: [] for name in index["params"]}
    index["tensors"] = {k: v for k, v in index["tensors"].items() if not k.startswith("optim/")}
    (ckpt / "index.json").write_text(json.dumps(index))
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["optimizer"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    complete = json.loads((ckpt / "COMPLETE").read_text())
    complete["files"] = {n: (ckpt / n).stat().st_size for n in complete["files"]}
    (ckpt / "COMPLETE").write_text(json.dumps(complete))


def test_a_checkpoint_without_optimizer_state_is_refused_for_resuming(tmp_path: Path) -> None:
    case = Case("single", None, False, str(tmp_path / "ckpt"))
    session = _tp(case, TPGroup())
    _run(session, 0, 1)
    session.save(Path(case.ckpt), _extra(session))
    _no_optimizer(Path(case.ckpt))
    with pytest.raises(UserError, match="no optimizer state"):
        _tp(case, TPGroup()).load(case.ckpt)
    # export reads the weights alone
    from xronos.checkpoint import load_checkpoint

    fresh = _tp(case, TPGroup())
    plan = Plan.single(CFG)
    loaded = load_checkpoint(
        case.ckpt, model=fresh.model, optimizer=None, cfg=CFG, plan=plan, group=TPGroup()
    )
    assert loaded.step == 1
    assert dataclasses.asdict(loaded)["extra"]["data"] == {"step": 1}
