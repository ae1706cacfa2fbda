"""The bench's warm-up may move a tensor-parallel session to a better-balanced plan, as the
fine-tune's live re-balancing does; its counted steps keep the session they start with."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from xronos.bench.steps import Run, StrategyLog
from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.metrics.records import StepRecord
from xronos.planner.plan import Plan
from xronos.train.loop import LEAVE, Leave
from xronos.train.optim import OptimConfig
from xronos.train.session import Strategy
from xronos.train.source import ModelSource
from xronos.train.tp import TPSession

WARMUP = 2


@dataclass
class _Mover:
    """Stands in for :class:`~xronos.run.rebalance.Rebalancer` (its own tests cover when
    it moves): hands back ``fresh`` after every step it sees, and keeps what it saw."""

    fresh: TPSession
    seen: list[tuple[TPSession, list[StepRecord]]] = field(default_factory=list)

    def after(self, session: TPSession, records: list[StepRecord]) -> TPSession:
        self.seen.append((session, records))
        return self.fresh


def _session(source: ModelSource) -> TPSession:
    plan = Plan.single(source.cfg, "local")
    return TPSession(source, plan, TPGroup(), OptimConfig(), Strategy.XRONOS)


def _run(mover: Any) -> Run:
    run = object.__new__(Run)  # only what _step reads
    run.job = SimpleNamespace(warmup=WARMUP)  # type: ignore[assignment]
    run.ctx = WorkerContext(0, 1, "local", TPGroup(), 30.0, ("local",))
    run.logs = {Strategy.XRONOS: StrategyLog()}
    run.movers = {Strategy.XRONOS: mover}
    run.io_restored = None
    return run


def test_a_warm_up_step_hands_over_the_moved_session_and_a_counted_one_does_not() -> None:
    torch.manual_seed(0)
    source = ModelSource.from_name("tiny")
    first, moved = _session(source), _session(source)
    mover = _Mover(moved)
    run = _run(mover)
    ids = torch.randint(0, source.cfg.vocab_size, (2, 8))
    micro = [(ids, ids.clone())]
    assert run._step(Strategy.XRONOS, first, micro, step=WARMUP - 1) is moved
    ((seen, records),) = mover.seen
    assert seen is first and [r.rank for r in records] == [0]  # the step's own record
    assert run._step(Strategy.XRONOS, moved, micro, step=WARMUP) is moved
    assert len(mover.seen) == 1  # counted steps are not offered to the mover
    assert len(run.logs[Strategy.XRONOS].records) == 2


@dataclass
class _Releaser:
    """Stands in for a Rebalancer that released this device (:data:`LEAVE`)."""

    def after(self, session: TPSession, records: list[StepRecord]) -> Leave:
        return LEAVE


def test_a_released_device_has_no_session_for_the_later_steps() -> None:
    torch.manual_seed(0)
    source = ModelSource.from_name("tiny")
    run = _run(_Releaser())
    ids = torch.randint(0, source.cfg.vocab_size, (2, 8))
    micro = [(ids, ids.clone())]
    # its later steps of the strategy run on the devices kept (steps.py: those without a
    # session wait and gather their records)
    assert run._step(Strategy.XRONOS, _session(source), micro, step=WARMUP - 1) is None
