"""The helper processes that keep throttled devices slow while a run lasts.

Two CPU mechanisms need a process of their own beside the workers: the competing load
(:mod:`competitor`, one real-time process per CPU of a slow device, started once the speed
check has calibrated it) and the duty-cycle fallback (:mod:`dutycycle`, one helper per
worker, started when the worker is attached). :class:`Throttles` starts and stops both.
"""

from __future__ import annotations

from collections.abc import Sequence

from xronos.emulation.competitor import MECHANISM as LOAD
from xronos.emulation.competitor import MIN_SPEED, Competitor, available
from xronos.emulation.dutycycle import DutyCycle
from xronos.emulation.slot import cpu_sharers
from xronos.emulation.speed import SpeedCheck
from xronos.errors import UserError

DUTY = "duty-cycle"


def load_ranks(
    mechanism: str, asked: Sequence[float], cpus: Sequence[tuple[int, ...]]
) -> tuple[set[int], str | None]:
    """The slow devices that get a competing load under ``mechanism`` (``auto`` or
    ``load``): those on CPUs of their own; none, and why, where the host cannot run one
    (a UserError where ``load`` was required)."""
    if mechanism not in ("auto", "load"):
        return set(), None
    sharers = cpu_sharers(cpus)
    ranks = {r for r in range(len(asked)) if MIN_SPEED <= asked[r] < 1.0 and not sharers[r]}
    why = available() if ranks else None
    if why is not None and mechanism == "load":
        raise UserError(f"emulation: {why}; run as root, or use --cpu-limit quota")
    return (set(), why) if why is not None else (ranks, None)


class Throttles:
    """Per rank, the helpers in force (see the module docstring)."""

    def __init__(self) -> None:
        self.loads: dict[int, Competitor] = {}
        self.duty: dict[int, float] = {}
        self.helpers: dict[int, DutyCycle] = {}

    def start(
        self,
        speeds: Sequence[SpeedCheck],
        asked: Sequence[float],
        cpus: Sequence[tuple[int, ...]],
    ) -> None:
        """After the speed check: start each competing load at its calibrated speed (the
        asked one where it was not measured); remember each duty cycle for :meth:`attach`."""
        for rank, check in enumerate(speeds):
            level = check.fraction if check.measured and check.fraction is not None else None
            if check.mechanism == LOAD and asked[rank] < 1.0:
                self.loads[rank] = Competitor(cpus[rank], level or asked[rank])
            elif check.mechanism == DUTY and level is not None:
                self.duty[rank] = level

    def attach(self, rank: int, pid: int, mechanism: str, asked: float, period_s: float) -> None:
        """A worker started: under the duty-cycle fallback, start its helper."""
        duty = self.duty.get(rank, asked)
        if mechanism == DUTY and duty < 1.0:
            if rank in self.helpers:
                self.helpers.pop(rank).stop()
            self.helpers[rank] = DutyCycle(pid, duty, period_s)

    def stop(self) -> None:
        """Stop every helper (idempotent); duty-cycled workers are left running."""
        for helper in self.helpers.values():
            helper.stop()
        self.helpers.clear()
        for load in self.loads.values():
            load.stop()
        self.loads.clear()
