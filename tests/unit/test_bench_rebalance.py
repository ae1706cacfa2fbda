"""The bench's warm-up may move a tensor-parallel session to a better-balanced plan, as the
fine-tune's live re-balancing does; its counted steps keep the session they start with,
and begin only once a move has settled and a balance move has been judged."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from xronos.bench.steps import MORE_WARMUP, SETTLE, Run, StrategyLog
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
    it moves): hands back what ``moves`` holds for each step it sees (the first once, None
    after it), keeps what it saw, and has a move to judge while ``judging`` holds steps."""

    moves: list[TPSession | None]
    judging: int = 0
    seen: list[tuple[TPSession, list[StepRecord]]] = field(default_factory=list)
    undo: object | None = None

    def after(self, session: TPSession, records: list[StepRecord]) -> TPSession | None:
        self.seen.append((session, records))
        self.undo = object() if len(self.seen) <= self.judging else None
        return self.moves[len(self.seen) - 1] if len(self.seen) <= len(self.moves) else None


def _session(source: ModelSource) -> TPSession:
    plan = Plan.single(source.cfg, "local")
    return TPSession(source, plan, TPGroup(), OptimConfig(), Strategy.XRONOS)


def _run(mover: Any) -> Run:
    run = object.__new__(Run)  # only what _step reads
    run.job = SimpleNamespace(warmup=WARMUP)  # type: ignore[assignment]
    run.warmup = WARMUP
    run.ctx = WorkerContext(0, 1, "local", TPGroup(), 30.0, ("local",))
    run.logs = {Strategy.XRONOS: StrategyLog()}
    run.movers = {Strategy.XRONOS: mover}
    run.io_restored = None
    return run


def _micro(source: ModelSource) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(0, source.cfg.vocab_size, (2, 8))
    return [(ids, ids.clone())]


def test_a_warm_up_step_hands_over_the_moved_session_and_a_counted_one_does_not() -> None:
    torch.manual_seed(0)
    source = ModelSource.from_name("tiny")
    first, moved = _session(source), _session(source)
    mover = _Mover([moved])
    run, micro = _run(mover), _micro(source)
    assert run._step(Strategy.XRONOS, first, micro, step=WARMUP - 1) is moved
    ((seen, records),) = mover.seen
    assert seen is first and [r.rank for r in records] == [0]  # the step's own record
    # the moved plan's first steps are warm-up too, offered to the mover
    assert run.warmup == WARMUP + SETTLE
    for step in range(WARMUP, WARMUP + SETTLE):
        assert run._step(Strategy.XRONOS, moved, micro, step=step) is moved
    assert len(mover.seen) == 1 + SETTLE
    assert run._step(Strategy.XRONOS, moved, micro, step=WARMUP + SETTLE) is moved
    assert len(mover.seen) == 1 + SETTLE  # counted steps are not offered to the mover
    assert len(run.logs[Strategy.XRONOS].records) == 2 + SETTLE


def test_counting_waits_until_a_balance_move_is_judged() -> None:
    """While the mover holds a move to judge (its undo), each step leaves the next one in
    the warm-up; counting starts right after the step that judged it."""
    torch.manual_seed(0)
    source = ModelSource.from_name("tiny")
    first, moved = _session(source), _session(source)
    judging = SETTLE + 5
    mover = _Mover([moved], judging=judging)
    run, micro = _run(mover), _micro(source)
    session: TPSession = first
    step = 0
    while step < run.warmup:
        got = run._step(Strategy.XRONOS, session, micro, step=step)
        assert isinstance(got, TPSession)
        session, step = got, step + 1
    # the move at step 0, pending through step judging - 1, judged at step judging: the
    # last of the warm-up, past the job's and the move's SETTLE steps
    assert len(mover.seen) == judging + 1 and mover.undo is None
    assert run.warmup == judging + 1 > WARMUP + SETTLE
    assert run._step(Strategy.XRONOS, session, micro, step=step) is session
    assert len(mover.seen) == judging + 1  # counted: not offered


def test_warm_up_moves_lengthen_the_warm_up_by_a_bounded_number_of_steps() -> None:
    torch.manual_seed(0)
    source = ModelSource.from_name("tiny")
    mover = _Mover([], judging=10 * MORE_WARMUP)  # a verdict that never comes
    run, micro = _run(mover), _micro(source)
    session = _session(source)
    step = 0
    while step < run.warmup:
        run._step(Strategy.XRONOS, session, micro, step=step)
        step += 1
    assert run.warmup == WARMUP + MORE_WARMUP


@dataclass
class _Releaser:
    """Stands in for a Rebalancer that released this device (:data:`LEAVE`)."""

    undo: object | None = None

    def after(self, session: TPSession, records: list[StepRecord]) -> Leave:
        return LEAVE


def test_a_released_device_has_no_session_for_the_later_steps() -> None:
    torch.manual_seed(0)
    source = ModelSource.from_name("tiny")
    run, micro = _run(_Releaser()), _micro(source)
    # its later steps of the strategy run on the devices kept (steps.py: those without a
    # session wait and gather their records)
    assert run._step(Strategy.XRONOS, _session(source), micro, step=WARMUP - 1) is None
