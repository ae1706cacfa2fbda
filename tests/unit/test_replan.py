"""The planner's verdict on a running pipeline once its devices' speeds moved: profiles
slowed by the observed factors, the running plan priced as the search priced it, the best
candidate planned at the new speeds."""

from __future__ import annotations

import dataclasses

import pytest

from xronos.config import small
from xronos.planner import SEGMENTS
from xronos.planner.auto import plan_auto, stage_messages
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.pipesearch import (
    device_stages,
    priced,
    search_pipeline,
    stage_compute_s,
    stage_costs_for,
)
from xronos.planner.profile import DeviceProfile, slowed
from xronos.planner.replan import Forecast, Replanner

from .test_planner_auto import GBIT, B, S, profile

CFG = dataclasses.replace(small(), num_layers=8)
CHUNKS = {"mlp_chunk": 32, "vocab_chunk": 32}


def _profiles() -> list[DeviceProfile]:
    # a 100 Mbit/s link: a pipeline's one message per micro-batch beats TP's all-reduces
    ps = [profile(CFG, "fast", 1.0, GBIT / 10), profile(CFG, "slow", 0.5, GBIT / 10)]
    return [
        dataclasses.replace(p, split_s={"attn": 0.01, "mlp": 0.01}, update_s={"layer": 0.001})
        for p in ps
    ]


def _running(ps: list[DeviceProfile]) -> PipelinePlan:
    c = next(
        c
        for c in plan_auto(CFG, ps, batch_size=B, seq_len=S, **CHUNKS).candidates
        if c.strategy == "pp-1f1b"
    )
    assert isinstance(c.plan, PipelinePlan)
    return c.plan


def _planner(ps: list[DeviceProfile], only: str | None) -> Replanner:
    return Replanner(
        cfg=CFG,
        profiles=ps,
        running=_running(ps),
        batch_size=B,
        seq_len=S,
        grad_accum=1,
        only=only,
        **CHUNKS,
    )


def _forecast(ps: list[DeviceProfile], factors: dict[str, float], only: str | None) -> Forecast:
    return _planner(ps, only).forecast(factors)


def test_a_slowed_profile_computes_everything_that_much_slower_and_sends_as_fast() -> None:
    p = _profiles()[1]
    q = slowed(p, 2.5)
    units = {s: 7 for s in SEGMENTS}
    assert q.step_time(units) == pytest.approx(2.5 * p.step_time(units))
    assert q.split_s == pytest.approx({k: 2.5 * v for k, v in p.split_s.items()})
    assert q.update_s == pytest.approx({k: 2.5 * v for k, v in p.update_s.items()})
    assert (q.link, q.traffic, q.memory_bytes, q.sync_s) == (p.link, p.traffic, 0, p.sync_s)


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_a_plan_priced_anew_costs_what_the_search_predicted_for_it(grad_accum: int) -> None:
    ps = _profiles()
    devices = device_stages(ps, CFG, **CHUNKS)
    act, tied = stage_messages(CFG, ps, B * S, grad_accum)
    kw = {"batch_size": B, "grad_accum": grad_accum, "act_bytes": act, "tied_bytes": tied}
    plan = search_pipeline(CFG.num_layers, devices, **kw)
    # several micro-batches per batch: each one's fixed cost is priced too
    assert plan is not None and plan.num_microbatches > grad_accum
    assert priced(plan, devices, **kw) == pytest.approx(plan.predicted_step_s, rel=1e-12)
    # at other speeds the old plan is still priced, and no better than the search's own
    moved = device_stages([ps[0], slowed(ps[1], 3.0)], CFG, **CHUNKS)
    best = search_pipeline(CFG.num_layers, moved, **kw)
    assert best is not None and best.layer_ranges != plan.layer_ranges
    assert priced(plan, moved, **kw) > best.predicted_step_s * 1.05


def test_unchanged_speeds_keep_the_running_pipeline() -> None:
    seen = _forecast(_profiles(), {}, "pp-1f1b")
    assert seen.best.startswith("pp-1f1b") and seen.gain == pytest.approx(0.0, abs=1e-12)


def test_a_slowed_device_gets_fewer_layers_or_the_fast_one_runs_alone() -> None:
    ps = _profiles()
    running = _running(ps)
    layers = {d: b - a for d, (a, b) in zip(running.devices, running.layer_ranges, strict=True)}
    seen = _forecast(ps, {"slow": 3.0}, "pp-1f1b")
    assert seen.best.startswith("pp-1f1b") and seen.gain > 0.05
    # the running plan at the new speeds: its slow stage three times as slow
    assert seen.now_s > _forecast(ps, {}, "pp-1f1b").now_s * 1.2
    assert layers["slow"] > 1  # there were layers to give back
    # an auto run may leave the pipeline for the fast device alone
    alone = _forecast(ps, {"slow": 20.0}, None)
    assert alone.best == "single [fast]" and alone.gain > seen.gain


def test_each_stage_is_predicted_to_compute_its_micro_batches_without_sends() -> None:
    ps = _profiles()
    planner = _planner(ps, "pp-1f1b")
    running = planner.running
    got = planner.compute_s()
    assert set(got) == set(running.devices)
    # B divides into equal micro-batches: each stage computes m of them, the first stage
    # without its sends to the next (the runtime records those apart)
    m = running.num_microbatches
    assert B % m == 0
    devices = device_stages(ps, CFG, **CHUNKS)
    act, _ = stage_messages(CFG, ps, B * S, 1)
    by_name = {d.costs.name: d for d in devices}
    staged = [by_name[n] for n in running.devices]
    costs = stage_costs_for(staged, fraction=1 / m, act_bytes=act)
    (a, b), (c, d) = running.layer_ranges
    first = costs[0].stage_s(b - a, first=True, last=False) - costs[0].send_s
    assert costs[0].send_s > 0 and got[running.devices[0]] == pytest.approx(m * first)
    last = costs[1].stage_s(d - c, first=False, last=True)
    assert got[running.devices[1]] == pytest.approx(m * last)
    # a device that computes twice as slowly is predicted to compute twice as long
    slow = _planner([ps[0], slowed(ps[1], 2.0)], "pp-1f1b")
    slow = dataclasses.replace(slow, running=running)
    assert slow.compute_s()["slow"] == pytest.approx(2 * got["slow"])
    assert slow.compute_s()["fast"] == pytest.approx(got["fast"])
    again = stage_compute_s(running, devices, batch_size=B, grad_accum=1)
    assert again == pytest.approx(got)
