"""``auto`` through the product's worker: it runs what the planner picked, on the devices
it picked; a device it leaves out takes no part, and the others train exactly as one
device would.

The devices' profiles are given (as a cache would give them), so what ``auto`` must pick
is known: two fast devices on a fast link and one far slower device on a slow link.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.dist import product
from tests.dist.world import WorkerContext, run_world
from xronos.planner import SEGMENTS
from xronos.planner.comm import LinkModel, tp_traffic
from xronos.planner.plan import Plan
from xronos.planner.profile import CostCurve, DeviceProfile
from xronos.run.refine import Refinement
from xronos.run.sessions import Profiles, ProfileSource, open_session
from xronos.run.trials import SHORTLIST
from xronos.run.worker import FinetuneJob, finetune_worker
from xronos.train.session import Strategy

# As in tests/dist/test_training.py: fp32 reassociation only (losses within 1e-7 relative,
# measured); a missing all-reduce or a wrong slice moves parameters by O(lr) = 3e-3 per step.
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-4

CFG = product.CFG


def _profile(name: str, speed: float, bandwidth: float) -> DeviceProfile:
    per_unit = {"attn": 0.02, "mlp": 0.004, "vocab": 0.001}
    return DeviceProfile(
        name=name,
        segments={s: CostCurve(0.0, per_unit[s] / speed) for s in SEGMENTS},
        replicated_s=0.01 / speed,
        link=LinkModel(1e-4, bandwidth),
        traffic=tp_traffic(num_layers=CFG.num_layers, hidden_size=CFG.hidden_size, tokens=32),
    )


@pytest.mark.slow
def test_auto_leaves_a_slow_far_device_out_and_trains_exactly() -> None:
    profiles = (
        _profile("rank0", 1.0, 1.25e9),
        _profile("rank1", 1.0, 1.25e9),
        _profile("rank2", 0.01, 1.25e3),  # 100x slower, 10 kbit/s: it can only cost time
    )
    job = product.job(CFG, lora=None, steps=4, strategy=Strategy.AUTO)
    # trust the predictions (no trial steps): what auto must pick is then known exactly
    job = dataclasses.replace(
        job,
        session=dataclasses.replace(job.session, trial_steps=0),
        profiles=ProfileSource(memory_caps=(None,) * 3, keys=("",) * 3, cached=profiles),
    )
    results = run_world(finetune_worker, 3, job)
    left_out = results[2]
    assert left_out.members == () and left_out.losses == [] and left_out.state is None
    trained = results[:2]
    assert all(r.members == (0, 1) for r in trained)
    ref = product.single(job)
    for r in trained:
        assert r.losses == pytest.approx(ref.losses, rel=LOSS_RTOL)
        assert list(r.plan["devices"]) == ["rank0", "rank1"]  # tensor parallel over the two
    assert ref.state is not None and trained[0].state is not None
    for name, want in ref.state.items():
        torch.testing.assert_close(trained[0].state[name], want, atol=PARAM_ATOL, rtol=1e-4)


@pytest.mark.slow
def test_searched_pipeline_runs_in_its_device_order() -> None:
    """The pipeline search puts the LM head (the last stage) on the fast device, here rank
    0: stage 0 runs on rank 1. The runner follows that order and stays exact."""
    profiles = (_profile("rank0", 1.0, 1.25e9), _profile("rank1", 0.4, 1.25e9))
    job = product.job(CFG, lora=None, steps=3, strategy=Strategy.PP_1F1B)
    job = dataclasses.replace(
        job, profiles=ProfileSource(memory_caps=(None,) * 2, keys=("",) * 2, cached=profiles)
    )
    results = run_world(finetune_worker, 2, job)
    ref = product.single(job)
    for r in results:
        assert r.members == (0, 1)
        assert list(r.plan["ranks"]) == [1, 0], r.plan  # the head stage on the fast rank 0
        assert r.losses == pytest.approx(ref.losses, rel=LOSS_RTOL)
    assert ref.state is not None and results[0].state is not None
    for name, want in ref.state.items():
        torch.testing.assert_close(results[0].state[name], want, atol=PARAM_ATOL, rtol=1e-4)


def _auto_with_trials(ctx: WorkerContext, job: FinetuneJob) -> dict[str, Any]:
    spec = job.session
    profiles = Profiles(ctx, spec.shape, job.profiles)
    opened = open_session(spec, ctx, ctx.group, profiles.get, job.data.peek())
    assert opened.ran is not None and opened.choice is not None
    plan = getattr(opened.session, "plan", None)
    out = {
        "trials": opened.trials,
        "refined": opened.refined,
        "ran": opened.ran.to_dict(),
        "has_session": opened.session is not None,
        "plan_mlp": list(plan.split("mlp")) if isinstance(plan, Plan) else None,
    }
    if opened.session is not None:
        opened.session.close()
    return out


@pytest.mark.slow
def test_auto_measures_its_shortlist_and_runs_the_fastest_measured() -> None:
    """With trial steps, auto times the best-predicted few on the devices (a real step
    cannot be off like a prediction can) and runs the one measured fastest; every rank
    agrees on it."""
    profiles = (_profile("rank0", 1.0, 1.25e9), _profile("rank1", 0.5, 1.25e9))
    job = product.job(CFG, lora=None, steps=1, strategy=Strategy.AUTO)
    job = dataclasses.replace(
        job, profiles=ProfileSource(memory_caps=(None,) * 2, keys=("",) * 2, cached=profiles)
    )
    got = run_world(_auto_with_trials, 2, job)
    trials = got[0]["trials"]
    assert len(trials) == SHORTLIST and all(t > 0 for t in trials.values())
    assert all(g["trials"] == trials and g["ran"] == got[0]["ran"] for g in got)
    ran = got[0]["ran"]
    key = f"{ran['strategy']}:{','.join(map(str, ran['devices']))}"
    assert trials[key] == min(trials.values())
    assert [g["has_session"] for g in got] == [r in ran["devices"] for r in range(2)]


@pytest.mark.slow
def test_auto_runs_a_hybrid_when_it_is_fastest_and_trains_exactly() -> None:
    """Two devices on a fast link and a third, faster one on a 100 Mbit/s link: TP over
    all three pays every all-reduce over the slow link, a pipeline stage on the third pays
    one message per micro-batch. The planner predicts the hybrid [rank2 -> rank0+rank1]
    fastest (11 % ahead of TP over all three); auto, trusting its predictions, runs it,
    and it trains as one device does."""
    profiles = (
        _profile("rank0", 1.0, 1.25e9),
        _profile("rank1", 1.0, 1.25e9),
        _profile("rank2", 1.5, 1.25e7),
    )
    job = product.job(CFG, lora=None, steps=3, strategy=Strategy.AUTO)
    job = dataclasses.replace(
        job,
        session=dataclasses.replace(job.session, trial_steps=0),
        profiles=ProfileSource(memory_caps=(None,) * 3, keys=("",) * 3, cached=profiles),
    )
    results = run_world(finetune_worker, 3, job)
    ref = product.single(job)
    for r in results:
        assert r.members == (0, 1, 2)
        assert [list(g) for g in r.plan["groups"]] == [[2], [0, 1]], r.plan
        assert r.losses == pytest.approx(ref.losses, rel=LOSS_RTOL)
    assert ref.state is not None and results[0].state is not None
    for name, want in ref.state.items():
        torch.testing.assert_close(results[0].state[name], want, atol=PARAM_ATOL, rtol=1e-4)


def _auto_with_a_refinement(ctx: WorkerContext, job: FinetuneJob) -> dict[str, Any]:
    """:func:`_auto_with_trials` where the re-plan from the trial steps always moves one
    MLP unit to the other device (whatever the steps say: which plan wins is then up to the
    race); it checks that the steps it is given are whole steps of both members."""
    from xronos.run import trials

    seen: list[int] = []

    def move_one(
        key: str,
        cfg: Any,
        profiles: Any,
        plan: Plan,
        steps: Any,
        chunks: tuple[int, int],
    ) -> Refinement:
        assert key == "xronos:0,1" and len(profiles) == 2
        assert steps and all(len(step) == 2 for step in steps), steps
        assert all(set(SEGMENTS) <= set(t) and t["mlp"] > 0 for step in steps for t in step)
        seen.append(len(steps))
        mlp = list(plan.split("mlp"))
        give = 0 if mlp[0] > mlp[1] else 1
        mlp[give], mlp[1 - give] = mlp[give] - 1, mlp[1 - give] + 1
        after = Plan.from_dict({**plan.to_dict(), "mlp": mlp, "predicted_s": {}})
        return Refinement(key, plan, after, 1.0, 0.9)

    trials.refine = move_one  # type: ignore[assignment]
    out = _auto_with_trials(ctx, job)
    out["seen"] = seen
    return out


@pytest.mark.slow
def test_auto_tries_the_plan_its_trial_steps_call_for_and_keeps_the_faster() -> None:
    """A heterogeneous TP candidate re-planned from its own trial steps is opened beside
    the others and raced again; both of its plans are measured, the faster one stands for
    the candidate (its trial time is that plan's), and every rank reports the same."""
    profiles = (_profile("rank0", 1.0, 1.25e9), _profile("rank1", 0.5, 1.25e9))
    job = product.job(CFG, lora=None, steps=1, strategy=Strategy.AUTO)
    job = dataclasses.replace(
        job, profiles=ProfileSource(memory_caps=(None,) * 2, keys=("",) * 2, cached=profiles)
    )
    got = run_world(_auto_with_a_refinement, 2, job)
    assert all(g["seen"] == [job.session.trial_steps] for g in got)  # every timed step
    refined = got[0]["refined"]
    assert len(refined) == 1 and all(g["refined"] == refined for g in got)
    r = refined[0]
    assert r["candidate"] == "xronos:0,1"
    assert r["measured_before_s"] > 0 and r["measured_after_s"] > 0
    assert sum(r["after"]["mlp"]) == sum(r["before"]["mlp"]) and r["after"] != r["before"]
    kept = min(("before", "after"), key=lambda k: r[f"measured_{k}_s"])
    assert r["kept"] == kept
    assert got[0]["trials"]["xronos:0,1"] == r[f"measured_{kept}_s"]
    if got[0]["ran"]["strategy"] == "xronos":  # it runs the plan kept
        assert all(g["plan_mlp"] == r[kept]["mlp"] for g in got)
