"""The bench's solo steps: every device running the whole model alone, in turn (the ideal
step time's ``T_i^solo``) and all at the same moment (what sharing one host costs).

Timed together, one step of each device starts after one barrier; a device whose step ends
first keeps stepping (uncounted steps of the same batch on its own solo model) until the
time the slowest device's step is expected to take has passed, so that every device's
counted step runs, from start to end, beside the others' work. Without that cover the fast
device of ``ci-2dev`` sat idle through about 60 % of the slow device's step, and the slow
device's contention read between −8 and +6 % over runs; covered, +1.3 to +6.1 % in seven
runs (+5.9 % with the other core stepping throughout, measured apart from the bench).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.metrics.recorder import SpanRecorder
from xronos.train.batches import Batch
from xronos.train.loop import run_step
from xronos.train.session import Session

COVER_MARGIN = 1.15
"""The cover lasts this many times the longest step expected: a device computes slower
beside the others than in turn (measured up to +14 %, ``docs/benchmarks.md``)."""


@dataclass
class SoloTimes:
    """Per device, its counted solo steps: in turn (the others waiting: ``T_i^solo``) and
    together (every device's at the same moment)."""

    alone: list[list[float]]
    together: list[list[float]]

    @classmethod
    def empty(cls, n: int) -> SoloTimes:
        return cls([[] for _ in range(n)], [[] for _ in range(n)])

    def cover_s(self, this_round: Iterable[float | None]) -> float:
        """How long the devices stepping together keep busy: :data:`COVER_MARGIN` × the
        longest of this round's in-turn steps and of the earlier together steps' medians
        (0: nothing known yet, no cover)."""
        known = [t for t in this_round if t is not None]
        known += [statistics.median(t) for t in self.together if t]
        return COVER_MARGIN * max(known, default=0.0)


def median_or_none(times: list[float]) -> float | None:
    return statistics.median(times) if times else None


def solo_time(session: Session | None, micro: list[Batch], ctx: WorkerContext) -> float | None:
    """One step of this device's whole model alone (None where it has no solo session)."""
    if session is None:
        return None
    rec = SpanRecorder(ctx.rank, ctx.device)
    outcome = run_step(session, micro, TPGroup(), rec)
    return outcome.records[0].duration if outcome.records else None


def in_turn(session: Session | None, micro: list[Batch], ctx: WorkerContext) -> list[float | None]:
    """Each device in turn runs one step of its whole model while the others wait; every
    device's step time (None where it has no solo session), on every rank."""
    out: list[float | None] = []
    for r in range(ctx.world_size):
        ctx.group.barrier()
        t = solo_time(session, micro, ctx) if r == ctx.rank else None
        out.append(ctx.group.gather_object(t)[r])
    return out


def together(
    session: Session | None, micro: list[Batch], ctx: WorkerContext, cover_s: float
) -> list[float | None]:
    """Every device runs one step of its whole model alone, all at the same moment (after
    one barrier), and keeps stepping until ``cover_s`` has passed since it began (see the
    module docstring); every device's first step time, on every rank."""
    ctx.group.barrier()
    began = time.perf_counter()
    t = solo_time(session, micro, ctx)
    while session is not None and time.perf_counter() - began < cover_s:
        solo_time(session, micro, ctx)
    return list(ctx.group.gather_object(t))
