"""Hybrid training (a tensor-parallel group as one pipeline stage) follows the
single-process run step by step.

One world of 3 ranks runs every case: ranks 0 and 1 run one stage as heterogeneous TP
(shares 2 : 1, which cuts a KV group, so shared K/V rows are exercised), rank 2 runs
the other stage, with the TP stage first (it holds the embedding) or last (the head and
the loss); full fine-tuning and LoRA, tied and untied embeddings. Each case runs the
product's own worker and is compared with the same worker on one device (``single``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.dist import product
from tests.dist.world import WorkerContext, run_world
from xronos.config import ModelConfig
from xronos.metrics.recorder import SpanRecorder
from xronos.model.lora import LoRAConfig
from xronos.pipeline.layout import StageLayout
from xronos.pipeline.session import HybridStages
from xronos.pipeline.tied import tied_pairs
from xronos.planner.hybrid import HybridPlan
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.plan import Plan
from xronos.run.opening import hybrid_session
from xronos.run.worker import FinetuneJob, WorkerResult, finetune_worker
from xronos.train.loop import run_step
from xronos.train.session import Strategy

# The tolerances of tests/dist/test_pipeline.py (the same single-device arithmetic, some
# sums in another order: per micro-batch, per stage, the TP stage's per-rank partial sums).
# A missing gradient exchange or a loss counted twice moves parameters by O(lr) per step.
# Measured: losses within 1e-7, gradient norms within 2.2e-6 relative.
LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4
PARAM_ATOL = 1e-4
PARAM_RTOL = 1e-4
STEPS = 4
CFG = product.four_layers(tied=True)


def _hybrid(cfg: ModelConfig, tp_first: bool) -> HybridPlan:
    tp = Plan.from_shares(cfg, [2.0, 1.0], mlp_chunk=8, vocab_chunk=8, devices=["rank0", "rank1"])
    groups = ((0, 1), (2,)) if tp_first else ((2,), (0, 1))
    names = tuple("rank0+rank1" if len(g) > 1 else "rank2" for g in groups)
    ranges = ((0, 3), (3, 4)) if tp_first else ((0, 1), (1, 4))
    return HybridPlan(groups, PipelinePlan(names, ranges, (), 4), tp)


def _job(tp_first: bool, *, tied: bool, lora: bool) -> FinetuneJob:
    cfg = product.four_layers(tied)
    return product.job(
        cfg,
        lora=LoRAConfig(r=4, alpha=8.0) if lora else None,
        steps=STEPS,
        hybrid=_hybrid(cfg, tp_first),
        strategy=Strategy.HYBRID,
        keep_records=True,
    )


CASES = {
    "tp-first/full/tied": (True, True, False),
    "tp-first/lora/untied": (True, False, True),
    "tp-last/full/tied": (False, True, False),
    "tp-last/lora/tied": (False, True, True),
    "tp-last/full/untied": (False, False, False),
}


def _interleaved(ctx: WorkerContext, job: FinetuneJob) -> dict[str, Any]:
    """The product's hybrid session stepped by hand, its compute replayed without
    communication after every step (the bench's stall measurement): training must not
    notice, and the replay must run the stage's own schedule."""
    spec = job.session
    assert spec.hybrid is not None
    stages = HybridStages(spec.hybrid, spec.hybrid.groups)
    session = hybrid_session(spec, ctx, ctx.group, stages)
    rec = SpanRecorder(ctx.rank, ctx.device)
    data = dataclasses.replace(job.data)  # type: ignore[type-var]
    losses, replayed = [], []
    for _ in range(job.steps):
        outcome = run_step(session, data.next_step(), ctx.group, rec)
        losses.append(outcome.result.loss)
        replayed.append([s.name for s in session.isolated_compute(outcome.micro)])
    state = session.gather_state()
    session.close()
    return {"losses": losses, "state": state, "replayed": replayed}


def _run_cases(ctx: WorkerContext, jobs: dict[str, FinetuneJob]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, job in jobs.items():
        if name.startswith("interleaved/"):
            out[name] = _interleaved(ctx, job)
        elif name.startswith("control/"):  # the TP stage's partial gradients never summed
            import xronos.train.shardgrads as shardgrads

            original = shardgrads.ShardGrads.sync
            shardgrads.ShardGrads.sync = lambda self: None  # type: ignore[method-assign]
            try:
                out[name] = finetune_worker(ctx, job)
            finally:
                shardgrads.ShardGrads.sync = original  # type: ignore[method-assign]
        else:
            out[name] = finetune_worker(ctx, job)
    return out


def _assert_same_run(r: WorkerResult, ref: WorkerResult) -> None:
    assert r.losses == pytest.approx(ref.losses, rel=LOSS_RTOL)
    assert r.grad_norms == pytest.approx(ref.grad_norms, rel=NORM_RTOL)
    assert ref.state is not None and r.state is not None
    assert r.state.keys() == ref.state.keys()
    for name, want in ref.state.items():
        torch.testing.assert_close(r.state[name], want, atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=name)


@pytest.mark.slow
def test_a_tp_stage_in_a_pipeline_matches_single_process() -> None:
    jobs = {
        name: _job(tp_first, tied=tied, lora=lora) for name, (tp_first, tied, lora) in CASES.items()
    }
    jobs["control/lora"] = _job(True, tied=False, lora=True)
    jobs["interleaved/tp-last"] = _job(False, tied=True, lora=True)
    per_rank = run_world(_run_cases, 3, jobs, timeout_s=180.0)
    for name, job in jobs.items():
        results = [r[name] for r in per_rank]
        ref = product.single(job)
        if name.startswith("interleaved/"):
            for r in results:
                assert r["losses"] == pytest.approx(ref.losses, rel=LOSS_RTOL), name
                assert ref.state is not None
                for key, want in ref.state.items():
                    torch.testing.assert_close(
                        r["state"][key], want, atol=PARAM_ATOL, rtol=PARAM_RTOL
                    )
                # 4 micro-batches, each a forward and a backward, every step
                assert all(len(names) == 8 for names in r["replayed"]), r["replayed"]
            continue
        if name.startswith("control/"):
            with pytest.raises(AssertionError):
                _assert_same_run(results[0], ref)
            continue
        assert ref.losses[-1] < ref.losses[0] - 0.05, f"{name}: the run should learn something"
        assert job.session.hybrid is not None
        for r in results:
            _assert_same_run(r, ref)
            assert r.plan == job.session.hybrid.to_dict(), name
        for records in results[0].records:
            got = product.check_pipeline_records(records, name)
            assert max(got.values()) == 1, name  # each message sent once, to one member
            # the TP stage's two members both received every activation or gradient
            assert any(m.endswith(".1") for m in got), name


def test_layout_rejects_groups_that_are_not_a_partition() -> None:
    tp = Plan.from_shares(CFG, [1.0, 1.0], mlp_chunk=8, vocab_chunk=8)
    with pytest.raises(ValueError, match="cover each of 3 ranks once"):
        StageLayout.of(3, stage_groups=[[0, 1], [1]], tp=tp)
    with pytest.raises(ValueError, match="ascending"):
        StageLayout.of(3, stage_groups=[[1, 0], [2]], tp=tp)
    with pytest.raises(ValueError, match="tensor-parallel plan of 2"):
        StageLayout.of(3, stage_groups=[[0, 1], [2]])
    layout = StageLayout.of(3, stage_groups=[[2], [0, 1]], tp=tp)
    assert layout.stage_of(1) == 1 and layout.member(1) == 1 and layout.member(2) == 0
    assert layout.end(1, 1) == "1.1" and layout.end(0, 0) == "0"
    # the TP stage's members tile the vocabulary between them
    rows = layout.vocab_rows(CFG, 1)
    assert rows[0][0] == 0 and rows[0][1] == rows[1][0] and rows[1][1] == CFG.vocab_size


def test_tied_rows_travel_once_between_the_end_stages() -> None:
    """The first stage (rank 2) reads the step's rows from the TP stage's two members,
    each the rows it holds; both ends name each pair alike, so each message is matched."""
    tp = Plan.from_shares(CFG, [2.0, 1.0], mlp_chunk=8, vocab_chunk=8)
    layout = StageLayout.of(3, stage_groups=[[2], [0, 1]], tp=tp)
    ids = torch.tensor([0, 5, 50, 71, 72, 99])
    reader = tied_pairs(layout, CFG, 2, ids)
    assert [peer for peer, _, _ in reader] == [0, 1]
    assert torch.equal(torch.cat([rows for _, _, rows in reader]), ids)  # each row once
    split = layout.vocab_rows(CFG, 1)[0][1]  # member 0 holds the rows below this
    assert all(int(r) < split for r in reader[0][2]) and all(int(r) >= split for r in reader[1][2])
    for member, (_, name, rows) in enumerate(reader):
        ((peer, theirs, same),) = tied_pairs(layout, CFG, member, ids)
        assert peer == 2 and theirs == name == f"0->1.{member}" and torch.equal(same, rows)
