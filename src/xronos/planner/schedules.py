"""Pipeline schedules as orders of work, and the step time they take.

A schedule is, per stage, the order of its micro-batch forwards ``F(i)`` and backwards
``B(i)``. With ``n`` stages, stage ``j`` and ``m`` micro-batches::

    GPipe  (all forwards, then all backwards):
        stage j:  F0 F1 … F(m-1)  B0 B1 … B(m-1)
    1F1B   (PipeDream-flush: warm-up, steady one-forward-one-backward, cool-down):
        stage j:  F0 … F(w-1) | F(w) B0 F(w+1) B1 … F(m-1) B(m-1-w) | B(m-w) … B(m-1)
                  w = min(n - 1 - j, m) warm-up forwards

1F1B keeps at most ``n - j`` micro-batches' activations alive on stage ``j``; GPipe keeps
all ``m``. The runtime (:mod:`xronos.pipeline.schedule`) executes these orders; the
planner times them with :func:`makespan`.

**Why simulate.** The closed form ``Σ_j t_j + (m − 1) · max_j t_j`` assumes every
micro-batch costs the same. A batch of ``B`` sequences cut into ``k`` parts does not cut
evenly unless ``k`` divides ``B`` (4 into 3: 2, 1, 1), and on a CPU a micro-batch's cost
is far from proportional to its tokens (each pass re-reads the weights). The first
micro-batch, the biggest, then fills the pipeline, and the stages wait on each other in
both directions. Measured on ``ci-2dev`` (layer 0 on the 0.4 device, layers 1-3 and the
head on the full-speed one, micro-batches of 2, 1, 1 sequences): the closed form predicted
0.644 s, the schedule simulated with the same costs 0.683 s, the step took 0.786 s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from xronos.errors import UserError

STRATEGIES = ("pp-gpipe", "pp-1f1b")

FORWARD_SHARE = 1.0 / 3.0
"""A forward's share of a micro-batch's forward + backward: the backward computes two
products for each of the forward's one (input and weight gradients). Measured on the
stages of ``ci-2dev``: 0.32-0.40."""


class Action(NamedTuple):
    """One step of a stage's schedule: ``kind`` is ``"F"`` (forward) or ``"B"`` (backward)."""

    kind: str
    mb: int


def gpipe(stage: int, num_stages: int, m: int) -> list[Action]:
    """All forwards, then all backwards (GPipe)."""
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(stage: int, num_stages: int, m: int) -> list[Action]:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards (1F1B)."""
    warmup = min(num_stages - 1 - stage, m)
    actions = [Action("F", i) for i in range(warmup)]
    for k in range(m - warmup):
        actions += [Action("F", warmup + k), Action("B", k)]
    actions += [Action("B", i) for i in range(m - warmup, m)]
    return actions


def schedule(strategy: str, stage: int, num_stages: int, m: int) -> list[Action]:
    """The actions of ``stage`` under ``strategy`` (``pp-gpipe`` or ``pp-1f1b``)."""
    if strategy == "pp-gpipe":
        return gpipe(stage, num_stages, m)
    if strategy == "pp-1f1b":
        return one_f_one_b(stage, num_stages, m)
    raise UserError(f"unknown pipeline strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")


def microbatch_sizes(batch_size: int, parts: int, grad_accum: int = 1) -> list[int]:
    """Sequences in each micro-batch when each of ``grad_accum`` batches of ``batch_size``
    is cut into ``parts`` (as ``Tensor.tensor_split`` cuts: the first ``batch_size %
    parts`` one longer), in the order the pipeline runs them."""
    base, extra = divmod(batch_size, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)] * grad_accum


def makespan(strategy: str, stage_s: Sequence[Sequence[float]]) -> float:
    """Seconds from the first forward to the last backward of ``strategy``'s schedule.

    ``stage_s[j][i]``: stage ``j``'s forward + backward of micro-batch ``i`` (its messages
    to the next stage included); the forward takes :data:`FORWARD_SHARE` of it. Each action
    starts when its stage is free and its input is there: ``F(i)`` after stage ``j − 1``'s
    ``F(i)``, ``B(i)`` after stage ``j + 1``'s ``B(i)``."""
    n = len(stage_s)
    m = len(stage_s[0]) if n else 0
    orders = [schedule(strategy, j, n, m) for j in range(n)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * n
    nxt = [0] * n
    progressed = True
    while progressed:
        progressed = False
        for j in range(n):
            while nxt[j] < len(orders[j]):
                kind, i = orders[j][nxt[j]]
                src = j - 1 if kind == "F" else j + 1
                ready = done.get((kind, src, i)) if 0 <= src < n else 0.0
                if ready is None:
                    break  # waits for a neighbour: go on with the other stages
                share = FORWARD_SHARE if kind == "F" else 1.0 - FORWARD_SHARE
                free[j] = done[kind, j, i] = max(free[j], ready) + share * stage_s[j][i]
                nxt[j] += 1
                progressed = True
    if any(nxt[j] < len(orders[j]) for j in range(n)):  # a schedule that cannot finish
        raise ValueError(f"pipeline schedule {strategy} deadlocks with {n} stages, {m} mbs")
    return max(free, default=0.0)
