"""The bench's solo steps timed together: each device's counted step is covered by work."""

from __future__ import annotations

import time

import pytest
import torch

from xronos.bench import solo
from xronos.bench.solo import COVER_MARGIN, SoloTimes
from xronos.comm.launch import WorkerContext
from xronos.comm.mappings import TPGroup
from xronos.planner.plan import Plan
from xronos.train.optim import OptimConfig
from xronos.train.session import Strategy
from xronos.train.source import ModelSource
from xronos.train.tp import TPSession


def test_cover_is_the_longest_step_known_with_a_margin() -> None:
    times = SoloTimes.empty(2)
    assert times.cover_s([None, None]) == 0.0  # nothing known: one step each, no cover
    # this round in turn: the fastest device's is single's (None), the slow one's 1.2 s
    assert times.cover_s([None, 1.2]) == pytest.approx(COVER_MARGIN * 1.2)
    # beside the others the slow device was slower than in turn: its together median counts
    times.together[1] += [1.3, 1.5, 1.4]
    assert times.cover_s([None, 1.2]) == pytest.approx(COVER_MARGIN * 1.4)


def test_a_device_keeps_stepping_until_the_cover_has_passed() -> None:
    torch.manual_seed(0)
    source = ModelSource.from_name("tiny")
    session = TPSession(
        source, Plan.single(source.cfg, "local"), TPGroup(), OptimConfig(), Strategy.SINGLE
    )
    ctx = WorkerContext(0, 1, "local", TPGroup(), 30.0, ("local",))
    ids = torch.randint(0, source.cfg.vocab_size, (2, 8))
    micro = [(ids, ids.clone())]
    (first,) = solo.together(session, micro, ctx, cover_s=0.0)
    assert first is not None and first > 0 and session.steps_done == 1  # no cover: one step
    (warm,) = solo.together(session, micro, ctx, cover_s=0.0)
    assert warm is not None and session.steps_done == 2
    began = time.perf_counter()
    (timed,) = solo.together(session, micro, ctx, cover_s=10 * warm)
    assert time.perf_counter() - began >= 10 * warm
    # Ten warm step times of cover: about ten steps of the same batch ran; asked: at least
    # one after the timed one, so that a host that slows one step 5x cannot fail this.
    assert session.steps_done >= 2 + 2
    assert timed is not None and timed > 0  # the window's first step, the one timed
    assert solo.together(None, micro, ctx, cover_s=1.0) == [None]  # no solo model: no steps
