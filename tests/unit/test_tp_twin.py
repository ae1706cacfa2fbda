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
