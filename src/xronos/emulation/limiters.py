"""What the start-up speed check (:mod:`speed`) turns on and off around its probe: a device
group's CPU quota, the duty-cycle helper, or a competing load on the probe's CPUs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from xronos.emulation.cgroups import Group, Hierarchy, quota_and_period
from xronos.emulation.competitor import Competitor
from xronos.emulation.dutycycle import DutyCycle


class Limiter(Protocol):
    """Puts a limit on the probe and lifts it again."""

    def on(self, fraction: float, period_us: int) -> int:
        """Limit to ``fraction`` of the CPU set; returns the period really used."""
        ...

    def off(self) -> None: ...

    def settle(self, fraction: float, period_us: int) -> None:
        """Leave the device with this limit once the probe is done."""
        ...


class CgroupLimiter:
    """A device group's CPU quota (``fraction × cpus`` CPUs per period)."""

    def __init__(self, hierarchy: Hierarchy, group: Group, n_cpus: int, period_us: int) -> None:
        self.hierarchy, self.group, self.n_cpus, self.period_us = (
            hierarchy,
            group,
            n_cpus,
            period_us,
        )

    def on(self, fraction: float, period_us: int) -> int:
        quota_us, period = quota_and_period(fraction * self.n_cpus, period_us)
        self.hierarchy.set_quota(self.group, quota_us, period)
        self.period_us = period
        return period

    def off(self) -> None:
        self.hierarchy.set_quota(self.group, None, self.period_us)

    def settle(self, fraction: float, period_us: int) -> None:
        self.on(fraction, period_us)


class _HelperLimiter:
    """A helper process that holds the limit while it runs (stopped by :meth:`off`); the
    device gets its own lasting one from the emulator, so nothing stays on the probe."""

    def __init__(self) -> None:
        self.helper: DutyCycle | Competitor | None = None

    def _start(self, fraction: float, period_s: float) -> DutyCycle | Competitor:
        raise NotImplementedError

    def on(self, fraction: float, period_us: int) -> int:
        self.off()
        if fraction < 1.0:
            self.helper = self._start(fraction, period_us / 1e6)
        return period_us

    def off(self) -> None:
        if self.helper is not None:
            self.helper.stop()
            self.helper = None

    def settle(self, fraction: float, period_us: int) -> None:
        self.off()


class DutyLimiter(_HelperLimiter):
    """The duty-cycle fallback's helper process on the probe."""

    SETTLE_S = 0.2
    """Time for the helper to start before the kernel runs."""

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid

    def _start(self, fraction: float, period_s: float) -> DutyCycle:
        helper = DutyCycle(self.pid, fraction, period_s)
        time.sleep(self.SETTLE_S)
        return helper


class LoadLimiter(_HelperLimiter):
    """A :class:`Competitor` on the probe's CPUs while the limited kernel runs."""

    def __init__(self, cpus: Sequence[int]) -> None:
        super().__init__()
        self.cpus = tuple(cpus)

    def _start(self, fraction: float, period_s: float) -> Competitor:
        return Competitor(self.cpus, fraction, period_s)
