"""The profiler's overlap measurement on real gloo ranks: what computing while an
all-reduce travels fails to hide (:mod:`xronos.profiler.overlap`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tests.dist.world import WorkerContext, run_world
from xronos.profiler.overlap import measure_overlap

TOKENS, HIDDEN = 64, 256  # a 64 KiB activation: gloo moves it in well under a millisecond
LATENCY_S = 0.01  # each link's: 20 ms an all-reduce between two ranks


def _latency_only(ctx: WorkerContext, serial: bool) -> float:
    from xronos.comm.links import LinkDelays
    from xronos.comm.mappings import TPGroup

    group = replace(ctx.group, links=LinkDelays((LATENCY_S,) * ctx.world_size))
    if serial:  # an all-reduce that does not move before its wait: one after the other

        class Later:
            def __init__(self, t: Any, name: str) -> None:
                self.t, self.name = t, name

            def wait(self) -> Any:
                return TPGroup.start_all_reduce(group, self.t, self.name).wait()

        object.__setattr__(group, "start_all_reduce", Later)
    return measure_overlap(group, TOKENS, HIDDEN)


def test_a_transfer_that_needs_no_cpu_hides_behind_the_computing() -> None:
    # The links' latency is a timer of the communication layer: the all-reduce's 20 ms pass
    # while the products (sized to them) run, and the overlap costs ~nothing. A busy host
    # adds a few ms of noise to a 20 ms overlap: 0.3 leaves room for it, far from the 1 of
    # the serial case below.
    losses = run_world(_latency_only, 2, False)
    assert losses[0] == losses[1]  # the group's figure, the same on every rank
    assert losses[0] < 0.3


def test_a_transfer_that_waits_for_the_computing_hides_nothing() -> None:
    # The same all-reduce started only at its wait: overlapped takes W + T, the measure 1
    # (noise as above, either way; it is clamped at 2).
    losses = run_world(_latency_only, 2, True)
    assert losses[0] == losses[1]
    assert 0.7 < losses[0] <= 2.0


def _alone(ctx: WorkerContext, _: None) -> float:
    return measure_overlap(ctx.group, TOKENS, HIDDEN)


def test_one_rank_has_nothing_to_overlap() -> None:
    assert run_world(_alone, 1) == [0.0]
