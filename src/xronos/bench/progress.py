"""What a bench run shows while it works.

A run of several strategies over a slow cluster takes minutes between the emulation report
and the table. The first device's process writes a line on stderr when profiling ends, as
each strategy is ready (and what ``auto`` runs), and as the steps go by, at most one every
:data:`EVERY_S` seconds and after the last, so such a run is never silent for long. The
other ranks write nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

EVERY_S = 15.0
"""Least time between two step lines."""


class Progress:
    """The lines of one bench run; ``clock`` and ``out`` are for tests."""

    def __init__(
        self,
        rank: int,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
        every_s: float = EVERY_S,
    ) -> None:
        self.on, self.out, self.clock, self.every_s = rank == 0, out, clock, every_s
        self.t0 = self.last = clock()

    def say(self, what: str) -> None:
        """One line with the seconds since the bench began (the first rank only)."""
        if self.on:
            now = self.clock()
            print(f"bench: {what} ({now - self.t0:.0f} s)", file=self.out or sys.stderr, flush=True)
            self.last = now

    def step(self, done: int, total: int, warmup: int, what: str = "") -> None:
        """After ``done`` of ``total`` steps (the first ``warmup`` uncounted): a line where
        :attr:`every_s` has passed since the last one, and after the last step."""
        if done == total or self.clock() - self.last >= self.every_s:
            phase = "warm-up" if done <= warmup else "counted"
            self.say(f"{what}step {done} of {total} ({phase})")
