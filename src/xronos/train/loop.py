"""The training loop: one loop for the product, the benchmark and the tests.

Every rank runs it with its own :class:`~xronos.train.session.Session`::

    for each step:
        micro = data.next_step()
        run_step(session, micro, …)      # spans recorded around session.step(micro),
                                         # every rank's record gathered, loss checked
        on_step(outcome)                 # the caller: progress, checkpoints, evaluation;
                                         # True = stop after this step

:func:`run_step` is the step itself; the benchmark calls it directly, strategy after
strategy, round by round. :func:`train_loop` repeats it until ``steps`` or a stop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from xronos.comm.mappings import TPGroup
from xronos.errors import UserError
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.metrics.records import StepRecord, pack_records, unpack_records
from xronos.train.batches import Batch, StepSource
from xronos.train.session import Session, StepResult

STEP_END = "step.end"


class Leave:
    """What ``swap`` returns on a rank that has no part in the run from the next step (a
    device released, :mod:`xronos.run.release`)."""


LEAVE = Leave()


class LossNotFinite(UserError):
    """The loss became NaN or infinite: training stops (the caller names the last good
    checkpoint)."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"loss is {loss} at step {step}; lower --lr or check the data")
        self.step, self.loss = step, loss


def gather_records(rec: StepRecord | None, group: TPGroup, max_events: int) -> list[StepRecord]:
    """Every rank's record of the same step, on every rank (outside the timed step; gloo
    needs equal sizes, so each record is packed to ``max_events``)."""
    if rec is None:
        return []
    if group.size == 1:
        return [rec]
    parts = group.all_gather(pack_records([rec], max_events), "records")
    return [r for p in parts for r in unpack_records(p)]


@dataclass(frozen=True)
class StepOutcome:
    """One finished step as every rank sees it."""

    step: int
    """Steps done, this one included."""
    result: StepResult
    records: list[StepRecord]
    """Every rank's spans of this step (empty when not recorded)."""
    micro: list[Batch]


def run_step(
    session: Session,
    micro: list[Batch],
    group: TPGroup,
    recorder: SpanRecorder,
    *,
    end_collective: bool = False,
) -> StepOutcome:
    """One optimizer step of ``session`` on ``micro``, its spans recorded and gathered.

    ``end_collective`` closes the step with one timed all-reduce (``step.end``): where
    something untimed follows the step (the benchmark's barrier between strategies), a
    device that finished early then still waits inside the step, as it would at the next
    step's first collective in a real run.
    """
    step = session.steps_done
    recorder.start_step(step)
    with use_recorder(recorder):
        result = session.step(micro)
        if end_collective:
            group.all_reduce(torch.zeros(1), STEP_END)
    records = gather_records(recorder.end_step(), group, session.max_events)
    if not math.isfinite(result.loss):
        raise LossNotFinite(step, result.loss)
    return StepOutcome(session.steps_done, result, records, micro)


@dataclass
class LoopResult:
    steps: int = 0
    """Steps done at the end."""
    stopped: bool = False
    """Ended by a stop request before ``steps``."""
    left: bool = False
    """This rank was released: the run went on without it."""
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)


def train_loop(
    session: Session,
    data: StepSource,
    steps: int,
    group: TPGroup,
    recorder: SpanRecorder,
    on_step: Callable[[StepOutcome], bool] | None = None,
    swap: Callable[[Session, StepOutcome], Session | Leave | None] | None = None,
) -> LoopResult:
    """Train ``session`` until it has done ``steps`` steps, or ``on_step`` returns True.
    ``swap`` may return another session (the same training state under another plan, maybe
    on fewer ranks) to go on with from the next step, or :data:`LEAVE` on a rank that has
    no part in it."""
    out = LoopResult(steps=session.steps_done)
    while session.steps_done < steps:
        outcome = run_step(session, data.next_step(), group, recorder)
        out.steps = outcome.step
        out.losses.append(outcome.result.loss)
        out.grad_norms.append(outcome.result.grad_norm)
        if on_step is not None and on_step(outcome):
            out.stopped = outcome.step < steps
            break
        fresh = swap(session, outcome) if swap is not None else None
        if isinstance(fresh, Leave):
            out.left = True
            break
        if fresh is not None:
            session, group = fresh, fresh.group
    return out
