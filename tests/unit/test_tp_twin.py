"""The stall ratio's isolated replay: a twin of the shard, warmed up before it is timed."""

from __future__ import annotations

import pytest
import torch

from xronos.comm.mappings import TPGroup
from xronos.planner.plan import Plan
from xronos.train import tp
from xronos.train.optim import OptimConfig
from xronos.train.session import Strategy
from xronos.train.source import ModelSource
from xronos.train.trainer import SLOW_FIRST_STEPS, Trainer


def test_the_twin_runs_its_warm_up_steps_before_the_timed_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fresh shard's first steps run slow; timing them would put the isolated reference
    # high and hide the stall. The twin takes SLOW_FIRST_STEPS untimed steps when it is built,
    # then one timed step per replay, and the session's own trainer is not stepped.
    source = ModelSource.from_name("tiny")
    session = tp.TPSession(
        source, Plan.single(source.cfg, "local"), TPGroup(), OptimConfig(), Strategy.XRONOS
    )
    steps: list[Trainer] = []
    real_step = Trainer.step

    def step(self: Trainer, *args: object, **kwargs: object) -> object:
        steps.append(self)
        return real_step(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Trainer, "step", step)
    ids = torch.randint(0, source.cfg.vocab_size, (2, 8))
    micro = [(ids, ids.clone())]
    assert session.isolated_compute(micro)  # the timed step's compute spans
    assert SLOW_FIRST_STEPS >= 3
    assert len(steps) == SLOW_FIRST_STEPS + 1
    assert all(t is not session.trainer for t in steps)
    session.isolated_compute(micro)
    assert len(steps) == SLOW_FIRST_STEPS + 2  # a built twin is not warmed again


def test_the_bench_pairs_alternate_which_half_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # Always second, the twin read faster than the step it followed (a `single` that sends
    # nothing read up to 29 % of stall): tensor parallelism's pairs alternate the order; the
    # first pair builds the twin and is not kept.
    from types import SimpleNamespace

    from xronos.bench import steps as bench_steps
    from xronos.comm.launch import WorkerContext

    source = ModelSource.from_name("tiny")
    session = tp.TPSession(
        source, Plan.single(source.cfg, "local"), TPGroup(), OptimConfig(), Strategy.SINGLE
    )
    order: list[str] = []
    real_iso = tp.TPSession.isolated_compute

    def iso(self: tp.TPSession, micro: object) -> object:
        order.append("twin")
        return real_iso(self, micro)  # type: ignore[arg-type]

    real_step = bench_steps._step

    def step(*args: object, **kwargs: object) -> object:
        order.append("step")
        return real_step(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tp.TPSession, "isolated_compute", iso)
    monkeypatch.setattr(bench_steps, "_step", step)
    ctx = WorkerContext(0, 1, "local", TPGroup(), 60.0, ("local",))
    log = bench_steps.StrategyLog()
    run = SimpleNamespace(ctx=ctx, logs={Strategy.SINGLE: log})
    ids = torch.randint(0, source.cfg.vocab_size, (2, 8))
    for r in range(bench_steps.ISOLATED_REPEATS + 1):
        bench_steps._paired(Strategy.SINGLE, session, [(ids, ids.clone())], run, r)  # type: ignore[arg-type]
    pairs = [tuple(order[i : i + 2]) for i in range(0, len(order), 2)]
    rounds = range(bench_steps.ISOLATED_REPEATS + 1)
    assert pairs == [("twin", "step") if r % 2 else ("step", "twin") for r in rounds]
    assert bench_steps.ISOLATED_REPEATS % 2 == 0  # as many kept pairs of either order
    # every kept pair's halves are in the log, the first pair's not: one span a step here
    assert len(log.observed) == len(log.isolated) == bench_steps.ISOLATED_REPEATS
    assert {s.name for s in log.observed} == {s.name for s in log.isolated}
