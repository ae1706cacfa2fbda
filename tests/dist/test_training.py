"""Tensor-parallel training on uneven splits follows the single-device run step by step.

Every case runs the product's own worker (:func:`xronos.run.worker.finetune_worker`: the
session, the one loop) on gloo ranks and compares losses, gradient norms and the final
parameters with the same worker on one device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.dist import product
from tests.dist.world import WorkerContext, run_world
from xronos.config import ModelConfig
from xronos.metrics.records import LANE
from xronos.model.head import CHUNK_TOKENS
from xronos.model.lora import LoRAConfig
from xronos.planner.plan import Plan
from xronos.run.worker import FinetuneJob, WorkerResult, finetune_worker

# Reassociation only (docs/architecture.md, Exactness). Losses agree to about 1e-7 relative
# (at most 1.6e-7 over 20 steps on three uneven ranks); 1e-5 leaves a margin of 60, and a
# missing all-reduce moved them by 1.2e-4 to 5e-3. Gradient norms are more sensitive: up to
# 1.9e-5 relative by step 20 of the same run, hence 1e-4. Parameters: Adam divides each
# update by sqrt(v), so an entry whose gradient is at the fp32 noise level can take an
# update that differs by a fraction of lr (3e-3) from the reference; observed max
# |Δ| ≈ 3.5e-5 over 20 steps. A missing all-reduce or a wrong slice changes
# parameters by O(lr) per step (≥ 1e-3), far above 1e-4.
LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4
PARAM_ATOL = 1e-4
PARAM_RTOL = 1e-4

CFG = product.CFG
UNTIED = dataclasses.replace(CFG, tie_word_embeddings=False)


def _assert_same_run(results: list[WorkerResult], ref: WorkerResult) -> None:
    assert ref.state is not None
    for r in results:
        assert r.losses == pytest.approx(ref.losses, rel=LOSS_RTOL)
        assert r.grad_norms == pytest.approx(ref.grad_norms, rel=NORM_RTOL)
    state = results[0].state
    assert state is not None and state.keys() == ref.state.keys()
    for name, want in ref.state.items():
        torch.testing.assert_close(state[name], want, atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=name)


def _variants(ctx: WorkerContext, jobs: list[FinetuneJob]) -> list[WorkerResult]:
    return [finetune_worker(ctx, job) for job in jobs]


@pytest.mark.slow
def test_three_uneven_ranks_match_single_process() -> None:
    # 4 query heads (2 KV groups) at shares 3 : 1.5 : 1 -> heads 2 : 1 : 1, so ranks 1 and
    # 2 share KV group 1: both compute its K/V and their K/V gradients are summed.
    jobs = [
        product.job(
            cfg,
            plan=Plan.from_shares(cfg, [3.0, 1.5, 1.0], mlp_chunk=8, vocab_chunk=8),
            lora=lora,
            steps=20 if cfg is CFG else 6,
        )
        for cfg, lora in (
            (CFG, None),
            (CFG, LoRAConfig(r=4, alpha=8.0, dropout=0.1)),
            (UNTIED, None),
        )
    ]
    per_rank = run_world(_variants, 3, jobs)
    for i, job in enumerate(jobs):
        assert job.session.plan is not None and job.session.plan.attn == (2, 1, 1)
        ref = product.single(job)
        assert ref.losses[-1] < ref.losses[0] - 0.05, "the run should learn something"
        _assert_same_run([rank[i] for rank in per_rank], ref)
        # the workers ran the plan they were given, each with its own slice
        assert per_rank[0][i].plan == job.session.plan.to_dict()  # type: ignore[union-attr]


@pytest.mark.slow
def test_more_devices_than_kv_groups() -> None:
    # 4 ranks, 2 KV groups of 2 query heads: two ranks hold no attention at all, only MLP
    # and vocab work. In the second plan the zero-head rank 1 sits inside KV group 0, which
    # ranks 0 and 2 share (rank 2's first query head is the group's second).
    base = Plan.from_shares(CFG, [1, 1, 1, 1], mlp_chunk=8, vocab_chunk=8)
    jobs = [
        product.job(CFG, plan=dataclasses.replace(base, attn=attn), lora=lora, steps=6)
        for attn, lora in (
            ((2, 0, 2, 0), None),
            ((1, 0, 3, 0), None),
            ((1, 0, 3, 0), LoRAConfig(r=4, alpha=8.0)),
        )
    ]
    per_rank = run_world(_variants, 4, jobs)
    for i, job in enumerate(jobs):
        _assert_same_run([rank[i] for rank in per_rank], product.single(job))


def _train_without(ctx: WorkerContext, arg: tuple[FinetuneJob, str]) -> WorkerResult:
    import xronos.train.shardgrads as shardgrads

    job, dropped = arg
    original = shardgrads.partial_grad

    def fewer(name: str) -> bool:  # forget one of the gradient all-reduces LoRA needs
        return original(name) and f"{dropped}" not in name

    shardgrads.partial_grad = fewer
    return finetune_worker(ctx, job)


@pytest.mark.slow
def test_lora_needs_both_gradient_all_reduces() -> None:
    """Dropping the all-reduce of A on column-parallel bases, or of B on row-parallel
    bases, must break the equivalence check used above (losses and final parameters)."""
    plan = Plan.from_shares(CFG, [2.0, 1.0], mlp_chunk=8, vocab_chunk=8)
    job = product.job(CFG, plan=plan, lora=LoRAConfig(r=4, alpha=8.0), steps=8)
    ref = product.single(job)
    _assert_same_run(run_world(_train_without, 2, (job, "nothing")), ref)  # the control
    for dropped in ("q_proj.lora_A", "down_proj.lora_B"):
        with pytest.raises(AssertionError):
            _assert_same_run(run_world(_train_without, 2, (job, dropped)), ref)


def _train_unshared(ctx: WorkerContext, arg: tuple[FinetuneJob, bool]) -> WorkerResult:
    import xronos.train.shardgrads as shardgrads
    from xronos.parallel.shared import SharedRows

    job, drop = arg
    if drop:  # forget the sum of the shared K/V rows' gradients among their ranks

        def none(named: object, cfg: ModelConfig, plan: Plan, rank: int) -> SharedRows:
            return SharedRows([], cfg, plan, rank)

        shardgrads.shared_rows = none
    return finetune_worker(ctx, job)


@pytest.mark.slow
def test_shared_kv_groups_need_their_gradient_sum() -> None:
    """Without summing the gradients of a shared KV group's K/V rows (and of LoRA B on
    k/v) among the ranks that hold it, the equivalence check used above must break."""
    plan = Plan.from_shares(CFG, [3.0, 1.5, 1.0], mlp_chunk=8, vocab_chunk=8)
    assert plan.attn == (2, 1, 1)  # ranks 1 and 2 share KV group 1
    jobs = [
        product.job(CFG, plan=plan, lora=lora, steps=6)
        for lora in (None, LoRAConfig(r=4, alpha=8.0, target_modules=("k_proj", "v_proj")))
    ]
    for job in jobs:
        ref = product.single(job)
        _assert_same_run(run_world(_train_unshared, 3, (job, False)), ref)  # the control
        with pytest.raises(AssertionError):
            _assert_same_run(run_world(_train_unshared, 3, (job, True)), ref)


@pytest.mark.slow
def test_bf16_payloads_stay_close_to_the_exact_run() -> None:
    """``--comm-dtype bf16``: the activation all-reduces travel in bf16. bf16 keeps 8 bits
    of mantissa, so each partial sum is off by up to 2^-9 relative; over 6 steps the loss
    stays within 2 % of the exact run (observed ~0.1 %) — and does differ from it, so the
    payload really was rounded."""
    plan = Plan.from_shares(CFG, [2.0, 1.0], mlp_chunk=8, vocab_chunk=8)
    job = product.job(CFG, plan=plan, lora=None, steps=6)
    rounded = dataclasses.replace(job, session=dataclasses.replace(job.session, comm_dtype="bf16"))
    ref = product.single(job)
    results = run_world(finetune_worker, 2, rounded)
    for r in results:
        assert r.losses == pytest.approx(ref.losses, rel=2e-2)
        assert r.losses != pytest.approx(ref.losses, rel=1e-6, abs=0)


def _overlapped(ctx: WorkerContext, jobs: list[FinetuneJob]) -> list[WorkerResult]:
    return [finetune_worker(ctx, job) for job in jobs]


@pytest.mark.slow
def test_overlapped_lanes_match_single_process() -> None:
    """Two halves of every micro-batch in two lanes at once (each lane's collectives on its
    own process group) follow the single-device run like the plain split does, and the
    steps really ran in two lanes."""
    plan = Plan.from_shares(CFG, [2.0, 1.0], mlp_chunk=8, vocab_chunk=8)
    jobs = [
        dataclasses.replace(
            j, session=dataclasses.replace(j.session, overlap=True), keep_records=True
        )
        for j in (
            product.job(CFG, plan=plan, lora=None, steps=12, batch_size=4),
            product.job(CFG, plan=plan, lora=LoRAConfig(r=4, alpha=8.0), steps=6, batch_size=4),
        )
    ]
    per_rank = run_world(_overlapped, 2, jobs)
    for i, job in enumerate(jobs):
        ref = product.single(job)
        assert ref.losses[-1] < ref.losses[0] - 0.05, "the run should learn something"
        _assert_same_run([rank[i] for rank in per_rank], ref)
        records = per_rank[0][i].records
        assert records, "the worker kept its step records"
        lanes = {s.name for step in records for r in step for s in r.computes if s.kind == LANE}
        assert lanes == {"L0", "L1"}
        names = [s.name for step in records for r in step for s in r.collectives]
        assert any(n.startswith("L1:") for n in names) and any(n.startswith("L0:") for n in names)


@pytest.mark.slow
def test_gradient_checkpointing_changes_nothing() -> None:
    """``--gradient-checkpointing`` on an uneven split (and LoRA with dropout, whose masks
    are drawn again in backward) runs the same collectives in the same order on the same
    values as without it: losses, gradient norms and parameters equal bit for bit, and the
    single-device run's within the usual tolerance."""
    plan = Plan.from_shares(CFG, [2.0, 1.0], mlp_chunk=8, vocab_chunk=8)
    jobs = []
    for lora in (None, LoRAConfig(r=4, alpha=8.0, dropout=0.1)):
        plain = product.job(CFG, plan=plan, lora=lora, steps=6)
        jobs += [plain, product.recomputing(plain)]
    per_rank = run_world(_variants, 2, jobs)
    for rank in per_rank:
        for plain, rc in zip(rank[0::2], rank[1::2], strict=True):
            assert rc.losses == plain.losses and rc.grad_norms == plain.grad_norms
            assert (rc.state is None) == (plain.state is None)
            for name, t in (plain.state or {}).items():
                assert rc.state is not None and torch.equal(rc.state[name], t), name
    for i in (1, 3):
        _assert_same_run([rank[i] for rank in per_rank], product.single(jobs[i - 1]))


@pytest.mark.slow
def test_the_head_in_chunks_of_tokens_matches_single_process() -> None:
    """Checkpointed micro-batches of more tokens than a chunk (36 x 15 targets): each rank
    computes its vocabulary rows' loss in chunks and the logits again in backward; the run
    stays within the usual tolerance of the single-device run without checkpointing (the
    head's own cross-entropy)."""
    assert CHUNK_TOKENS < 36 * 15
    plan = Plan.from_shares(CFG, [2.0, 1.0], mlp_chunk=8, vocab_chunk=8)
    chunked = product.recomputing(product.job(CFG, plan=plan, lora=None, steps=6, batch_size=36))
    per_rank = run_world(_variants, 2, [chunked])
    _assert_same_run(
        [rank[0] for rank in per_rank], product.single(product.recomputing(chunked, False))
    )
