"""Pipeline-parallel training (GPipe, 1F1B) follows the single-process run step by step.

One world per world size runs every case (spawning ranks costs more than the math): 2
stages with layers [1, 3], 3 stages with layers [2, 1, 1]; full fine-tuning and LoRA, tied
and untied embeddings. Each case runs the product's own worker (pipeline session, the one
loop) and is compared with the same worker on one device (``single``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.dist import product
from tests.dist.world import WorkerContext, run_world
from xronos.comm.mappings import TPGroup
from xronos.errors import UserError
from xronos.metrics import stall_ratio
from xronos.metrics.recorder import SpanRecorder
from xronos.model.lora import LoRAConfig
from xronos.pipeline.runner import PipelineRunner
from xronos.pipeline.schedule import split_microbatches
from xronos.pipeline.session import PipelineSession
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.schedules import Action, gpipe, one_f_one_b, schedule
from xronos.run.worker import FinetuneJob, WorkerResult, finetune_worker
from xronos.train.loop import run_step
from xronos.train.session import Strategy

# PP runs the single-device arithmetic; only the order of some sums changes (CE summed per
# smaller micro-batch, the tied matrix's two gradient halves added after the schedule, the
# squared norm summed per stage). Observed max |Δ| ≈ 2e-6 over 4 steps. The tolerances are
# those of tests/dist/test_training.py: Adam divides by sqrt(v), so a noise-level gradient
# entry may move by a fraction of lr; a missing gradient exchange or a wrong stage boundary
# moves parameters by O(lr) = 3e-3 per step, far above 1e-4, and the losses by 1.5e-3.
LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4
PARAM_ATOL = 1e-4
PARAM_RTOL = 1e-4
STEPS = 4
# ``--comm-dtype bf16``: activations and their gradients cross stages in bf16 (8 bits of
# mantissa, each value off by up to 2^-9 relative), so the loss leaves the exact run's a
# little at every step; within 2 % over 4 steps (as tests/dist/test_training.py's bf16
# payloads), while a message dropped or read as the wrong dtype is far off.
BF16_RTOL = 2e-2


def _job(
    strategy: str,
    ranges: tuple[tuple[int, int], ...],
    *,
    tied: bool,
    lora: bool,
    m: int = 4,
    batch_size: int = 2,
) -> FinetuneJob:
    devices = tuple(f"rank{i}" for i in range(len(ranges)))
    return product.job(
        product.four_layers(tied),
        lora=LoRAConfig(r=4, alpha=8.0, dropout=0.1) if lora else None,
        steps=STEPS,
        pipeline=PipelinePlan(devices, ranges, (), m),
        strategy=Strategy(strategy),
        batch_size=batch_size,
        keep_records=True,
    )


def _pplan(job: FinetuneJob) -> PipelinePlan:
    assert job.session.pipeline is not None
    return job.session.pipeline


def _variants(ranges: tuple[tuple[int, int], ...], **kw: Any) -> dict[str, FinetuneJob]:
    return {
        f"{strategy}/{'lora' if lora else 'full'}/{'tied' if tied else 'untied'}": _job(
            strategy, ranges, tied=tied, lora=lora, **kw
        )
        for strategy in ("pp-gpipe", "pp-1f1b")
        for lora in (False, True)
        for tied in (True, False)
    }


# ----------------------------------------------------------------------------- workers


def _custom_loop(ctx: WorkerContext, job: FinetuneJob, mode: str) -> dict[str, Any]:
    """The product's session and step, driven by hand. ``interleaved``: isolated compute
    after every step (it must not disturb training). ``no-tied-sync``: the tied-gradient
    exchange left out (the control that must fail)."""
    spec = job.session
    session = PipelineSession(spec.source, _pplan(job), ctx.group, spec.optim, spec.strategy)
    if mode == "no-tied-sync":
        session.runner._sync_tied = lambda p2p: None  # type: ignore[method-assign]
    rec = SpanRecorder(ctx.rank, ctx.device)
    losses, observed, isolated, spans = [], [], [], []
    data = dataclasses.replace(job.data)  # type: ignore[type-var]
    for _ in range(job.steps):
        outcome = run_step(session, data.next_step(), ctx.group, rec)
        losses.append(outcome.result.loss)
        mine = next(r for r in outcome.records if r.rank == ctx.rank)
        observed.append([s.name for s in mine.computes])
        spans += mine.computes
        if mode == "interleaved":
            replay = session.isolated_compute(outcome.micro)
            isolated.append([s.name for s in replay])
            stall = stall_ratio(spans, replay)
            assert 0.0 <= stall < 1.0
    state = session.gather_state()
    session.close()
    return {"losses": losses, "state": state, "observed": observed, "isolated": isolated}


def _run_cases(ctx: WorkerContext, cases: dict[str, tuple[str, FinetuneJob]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (mode, job) in cases.items():
        plain = mode in ("plain", "rounded", "recompute")
        out[name] = finetune_worker(ctx, job) if plain else _custom_loop(ctx, job, mode)
    return out


# ----------------------------------------------------------------------------- checks


def _assert_same_run(
    losses: list[float], state: dict[str, torch.Tensor] | None, ref: WorkerResult
) -> None:
    assert losses == pytest.approx(ref.losses, rel=LOSS_RTOL)
    assert ref.state is not None and state is not None
    assert state.keys() == ref.state.keys()
    for name, want in ref.state.items():
        torch.testing.assert_close(state[name], want, atol=PARAM_ATOL, rtol=PARAM_RTOL, msg=name)


def _expected_computes(job: FinetuneJob, stage: int) -> list[str]:
    pplan = _pplan(job)
    n, m = pplan.num_stages, pplan.num_microbatches
    return [
        f"{'fwd' if a.kind == 'F' else 'bwd'}:mb{a.mb}"
        for a in schedule(job.session.strategy.value, stage, n, m)
    ]


def _check_plain(name: str, job: FinetuneJob, per_rank: list[WorkerResult]) -> None:
    ref = product.single(job)
    assert ref.losses[-1] < ref.losses[0] - 0.05, f"{name}: the run should learn something"
    for r in per_rank:
        _assert_same_run(r.losses, r.state, ref)
        assert r.grad_norms == pytest.approx(ref.grad_norms, rel=NORM_RTOL), name
        assert r.plan == _pplan(job).to_dict(), name
    result = per_rank[0]
    assert len(result.records) == STEPS, name
    for records in result.records:
        product.check_pipeline_records(records, name)
        for r in records:  # the stage ran its schedule, micro-batch by micro-batch
            assert [s.name for s in r.computes] == _expected_computes(job, r.rank), name


def _check_world(cases: dict[str, tuple[str, FinetuneJob]], world: int) -> None:
    per_rank = run_world(_run_cases, world, cases, timeout_s=120.0)
    for name, (mode, job) in cases.items():
        results = [r[name] for r in per_rank]
        if mode == "plain":
            _check_plain(name, job, results)
        elif mode == "interleaved":
            for rank, r in enumerate(results):
                _assert_same_run(r["losses"], r["state"], product.single(job))
                assert r["isolated"] == r["observed"], name
                assert r["isolated"][0] == _expected_computes(job, rank), name
        elif mode == "recompute":  # checkpointed stages: the oracle without checkpointing
            ref = product.single(product.recomputing(job, on=False))
            for r in results:
                _assert_same_run(r.losses, r.state, ref)
        elif mode == "rounded":  # bf16 messages: close to the exact run, and not equal to it
            ref = product.single(job)
            for r in results:
                assert r.losses == pytest.approx(ref.losses, rel=BF16_RTOL), name
                assert r.losses != pytest.approx(ref.losses, rel=1e-6, abs=0), name
        else:  # the control: without the tied-gradient exchange the run must differ
            with pytest.raises(AssertionError):
                ref = product.single(job)
                _assert_same_run(results[0]["losses"], results[0]["state"], ref)


@pytest.mark.slow
def test_two_stages_match_single_process() -> None:
    ranges = ((0, 1), (1, 4))
    cases = {name: ("plain", job) for name, job in _variants(ranges).items()}
    cases["interleaved/full"] = ("interleaved", _job("pp-1f1b", ranges, tied=True, lora=False))
    cases["interleaved/lora"] = ("interleaved", _job("pp-gpipe", ranges, tied=False, lora=True))
    cases["control/no-tied-sync"] = ("no-tied-sync", _job("pp-1f1b", ranges, tied=True, lora=False))
    exact = _job("pp-1f1b", ranges, tied=True, lora=False)
    bf16 = dataclasses.replace(exact.session, comm_dtype="bf16")
    cases["rounded/bf16"] = ("rounded", dataclasses.replace(exact, session=bf16))
    # --gradient-checkpointing: LoRA dropout's masks drawn again in backward, in 1F1B order
    lora = _job("pp-1f1b", ranges, tied=True, lora=True)
    cases["recompute/lora"] = ("recompute", product.recomputing(lora))
    _check_world(cases, 2)


@pytest.mark.slow
def test_three_uneven_stages_match_single_process() -> None:
    # batch 3 cut in 2 micro-batches: uneven sizes 2 and 1
    ranges = ((0, 2), (2, 3), (3, 4))
    cases = {name: ("plain", job) for name, job in _variants(ranges, batch_size=3).items()}
    # fewer micro-batches than stages: 1F1B's warm-up is cut short
    cases["pp-1f1b/m2"] = ("plain", _job("pp-1f1b", ranges, tied=True, lora=False, m=2))
    cases["interleaved/3"] = ("interleaved", _job("pp-1f1b", ranges, tied=True, lora=True))
    _check_world(cases, 3)


# ----------------------------------------------------------------------------- pure


def _simulate(strategy: str, n: int, m: int) -> list[list[Action]]:
    """Run every stage's schedule against the data dependencies; fails on a deadlock."""
    plans = [schedule(strategy, j, n, m) for j in range(n)]
    done: set[tuple[int, Action]] = set()
    pos = [0] * n
    while any(pos[j] < len(plans[j]) for j in range(n)):
        moved = False
        for j in range(n):
            if pos[j] == len(plans[j]):
                continue
            a = plans[j][pos[j]]
            if a.kind == "F":
                ready = j == 0 or (j - 1, Action("F", a.mb)) in done
            else:
                ready = j == n - 1 or (j + 1, Action("B", a.mb)) in done
            if ready:
                done.add((j, a))
                pos[j] += 1
                moved = True
        assert moved, f"{strategy} deadlocks with {n} stages, {m} micro-batches at {pos}"
    return plans


@pytest.mark.parametrize("strategy", ["pp-gpipe", "pp-1f1b"])
def test_schedules_complete_and_bound_memory(strategy: str) -> None:
    for n in range(1, 5):
        for m in range(1, 7):
            for j, actions in enumerate(_simulate(strategy, n, m)):
                assert sorted(actions) == sorted(gpipe(j, n, m))  # each F and B exactly once
                in_flight, peak = 0, 0
                for a in actions:
                    in_flight += 1 if a.kind == "F" else -1
                    peak = max(peak, in_flight)
                    assert in_flight >= 0
                want = min(n - j, m) if strategy == "pp-1f1b" else m
                assert peak == want, (strategy, n, m, j)


def test_one_f_one_b_order() -> None:
    assert [f"{a.kind}{a.mb}" for a in one_f_one_b(0, 3, 4)] == [
        "F0",
        "F1",
        "F2",
        "B0",
        "F3",
        "B1",
        "B2",
        "B3",
    ]
    assert [f"{a.kind}{a.mb}" for a in one_f_one_b(2, 3, 2)] == ["F0", "B0", "F1", "B1"]


def test_split_microbatches() -> None:
    ids = torch.arange(30).view(3, 10)
    parts = split_microbatches([(ids, ids), (ids + 1, ids + 1)], 4)
    assert [p[0].shape[0] for p in parts] == [2, 1, 2, 1]
    assert torch.equal(torch.cat([p[0] for p in parts[:2]]), ids)
    with pytest.raises(UserError, match="multiple of 2"):
        split_microbatches([(ids, ids), (ids, ids)], 3)
    with pytest.raises(UserError, match="cannot make 4"):
        split_microbatches([(ids, ids)], 4)


def test_runner_rejects_a_plan_for_another_cluster() -> None:
    job = _job("pp-1f1b", ((0, 1), (1, 4)), tied=True, lora=False)
    src, pplan, optim = job.session.source, _pplan(job), job.session.optim
    with pytest.raises(UserError, match="2 stages but 1 devices"):
        PipelineRunner(src, pplan, TPGroup(), optim)
    single = dataclasses.replace(pplan, devices=("a",), layer_ranges=((0, 3),))
    with pytest.raises(UserError, match="covers 3 layers"):
        PipelineRunner(src, single, TPGroup(), optim)
    with pytest.raises(UserError, match="unknown pipeline strategy"):
        PipelineRunner(src, pplan, TPGroup(), optim, strategy="pp-zb")


@pytest.mark.parametrize("strategy", ["pp-gpipe", "pp-1f1b"])
def test_one_stage_matches_single_process(strategy: str) -> None:
    job = _job(strategy, ((0, 4),), tied=True, lora=False)
    ctx = WorkerContext(0, 1, "local", TPGroup(), 0.0, ("local",))
    result = finetune_worker(ctx, job)
    _assert_same_run(result.losses, result.state, product.single(job))
