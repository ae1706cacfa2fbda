"""Check, and correct, the speed each emulated device really gets.

A CFS quota of 40 % does not make a program run at 40 % of its unthrottled speed: the kernel
enforces the quota at scheduler-tick granularity (4 ms at 250 Hz), so with a period of a few
milliseconds a throttled group overruns and then owes whole periods, and a throttled program
finds its caches cold when it runs again. At start-up the emulator therefore times a fixed
CPU kernel (:mod:`probe`) inside each throttled device's limits and, on the same CPUs, with
the limit lifted; the ratio is the device's effective speed. Where it is off by more than
:data:`TOLERANCE` the limit is moved and measured again (:func:`calibrate`): a CFS quota
scaled by asked/measured, a competing load along the line through full speed fitted to
every setting tried (:func:`anchored_step`); where that cannot reach :data:`ACCEPT` at the
requested period, longer periods (:data:`FALLBACK_PERIODS_US`) are tried. Every device's
result is a :class:`SpeedCheck`, reported as ``speed: device slow: asked 0.40, got 0.39
(…)``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from xronos.emulation.cgroups import Group, Hierarchy
from xronos.emulation.cluster import DeviceSpec
from xronos.emulation.competitor import MECHANISM as LOAD
from xronos.emulation.competitor import PERIOD_S as LOAD_PERIOD_S
from xronos.emulation.limiters import CgroupLimiter, DutyLimiter, Limiter, LoadLimiter
from xronos.emulation.probe import REPS, Probe, ProbeError

ROUNDS = 3
"""Timed pairs (unlimited, limited) per measurement; the median ratio counts."""
TOLERANCE = 0.03
"""Relative error at which calibration stops."""
ACCEPT = 0.05
"""Relative error a period must reach, else a longer one is tried."""
ATTEMPTS = 3
"""Quota settings tried per period."""
MAX_CORRECTION = 0.15
"""Largest relative change of the limit that calibration makes at a period that is not the
last one to try. A larger one means the kernel does not enforce the quota as written at that
period (the overrun of a tick or more per period), and there the speed is erratic, not merely
offset (measured: 0.60 and 0.70 of a 2.5 ms period both gave 0.48); a longer period is tried
instead."""
FALLBACK_PERIODS_US = (10_000, 20_000)
"""Periods tried, in order, after a shorter requested one fails :data:`ACCEPT`."""


@dataclass(frozen=True)
class Measurement:
    """Speed measured with a limit of ``fraction`` of the device's CPUs per period."""

    fraction: float
    period_us: int
    got: float
    """Median over :data:`ROUNDS` of unlimited time / limited time."""
    samples: tuple[float, ...]


@dataclass(frozen=True)
class SpeedCheck:
    """What one device asked for and what it gets (as fractions of its CPU set)."""

    device: str
    asked: float
    got: float | None
    """Measured speed; 1.0 for a device with no quota; None where not measured."""
    mechanism: str
    measured: bool = False
    fraction: float | None = None
    """Limit in force, as a fraction of the CPU set (None: no limit)."""
    period_us: int | None = None
    samples: tuple[float, ...] = ()
    """The rounds of the measurement in force."""
    tried: tuple[Measurement, ...] = ()
    note: str = ""

    @property
    def error(self) -> float | None:
        """got / asked - 1, or None where nothing was measured."""
        return None if self.got is None else self.got / self.asked - 1.0

    def line(self) -> str:
        head = f"speed: device {self.device}: asked {self.asked:.2f}"
        if not self.measured:
            got = "not measured" if self.got is None else f"got {self.got:.2f}"
            return f"{head}, {got} ({self.note})"
        assert self.got is not None and self.fraction is not None and self.period_us is not None
        spread = f"{min(self.samples):.2f}-{max(self.samples):.2f}" if self.samples else "-"
        limit = f"quota {self.fraction:.3f} of a {self.period_us / 1000:g} ms period"
        if self.mechanism == "duty-cycle":
            limit = f"duty {self.fraction:.3f} of a {self.period_us / 1000:g} ms cycle"
        elif self.mechanism == LOAD:
            limit = f"leaves {self.fraction:.3f} of every {self.period_us / 1000:g} ms"
        text = f"{head}, got {self.got:.2f} ({self.mechanism} {limit}; rounds {spread}"
        text += f"; {len(self.tried)} setting{'s' if len(self.tried) != 1 else ''} tried)"
        err = self.error or 0.0
        if abs(err) > ACCEPT:
            text += f": off by {err:+.0%}, outside the {ACCEPT:.0%} target"
        return text + (f"; {self.note}" if self.note else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(
    probe: Probe,
    limiter: Limiter,
    fraction: float,
    period_us: int,
    threads: int,
    cpus: Sequence[int],
    rounds: int = ROUNDS,
    reps: int = REPS,
) -> Measurement:
    """Interleave unlimited and limited runs of the kernel; the speed is their time ratio."""
    samples = []
    period = period_us
    for _ in range(rounds):
        limiter.off()
        base = probe.run(threads, cpus, reps)
        try:
            period = limiter.on(fraction, period_us)
            limited = probe.run(threads, cpus, reps)
        finally:
            limiter.off()
        samples.append(base / limited)
    return Measurement(fraction, period, statistics.median(samples), tuple(samples))


def next_fraction(fraction: float, asked: float, got: float) -> float:
    """The limit to try next: scaled by asked/got (a loss proportional to the limit, as a
    CFS quota's), by at most ×2 either way, at most 1."""
    if not math.isfinite(got) or got <= 0:
        return min(1.0, 2 * fraction)
    return min(1.0, fraction * min(2.0, max(0.5, asked / got)))


def next_fraction_anchored(fraction: float, asked: float, got: float) -> float:
    """The limit to try next on the line through the measurement and (1, 1): with no
    competing load the device runs at full speed, and the load costs the device a share of
    each busy slice beyond the slice itself (cache refills, switches), so the loss grows
    with the load, not with the limit (measured on one host: 0.28 at 0.40, 0.49 at 0.57,
    0.37 at 0.47, i.e. about ``1.2 f - 0.2``, where scaling by asked/got overshoots). Within
    ×2 of ``fraction`` either way, at most 1; :func:`next_fraction` where the line is not
    defined."""
    if not math.isfinite(got) or got <= 0 or got >= 1.0 or fraction >= 1.0:
        return next_fraction(fraction, asked, got)
    target = 1.0 - (1.0 - asked) * (1.0 - fraction) / (1.0 - got)
    return min(1.0, 2 * fraction, max(0.5 * fraction, target))


Step = Callable[[Sequence[Measurement], float], float]
"""The next limit to try at one period, from every measurement made at it so far (in
order) and the asked speed."""


def scaled_step(here: Sequence[Measurement], asked: float) -> float:
    """A CFS quota's step: :func:`next_fraction` from the last measurement."""
    return next_fraction(here[-1].fraction, asked, here[-1].got)


def anchored_step(here: Sequence[Measurement], asked: float) -> float:
    """A competing load's step: :func:`next_fraction_anchored` on the line through (1, 1)
    fitted to every measurement at this period by least squares (``1 - got = c·(1 - f)``),
    not only the last. One measurement is off by up to ±10 % on a busy host (its three
    rounds spread 0.33–0.46 at one setting): from the last alone, a setting measured 9 %
    high stepped back below one measured 9 % low (0.400 → 0.364, 0.434 → 0.436, then
    0.398), where the line through both reaches 0.40 at 0.417."""
    last = here[-1]
    usable = [m for m in here if 0 < m.got < 1 and m.fraction < 1]  # NaN compares False
    if len(usable) < 2 or last not in usable:
        return next_fraction_anchored(last.fraction, asked, last.got)
    c = sum((1 - m.got) * (1 - m.fraction) for m in usable) / sum(
        (1 - m.fraction) ** 2 for m in usable
    )
    return next_fraction_anchored(last.fraction, asked, 1.0 - c * (1.0 - last.fraction))


def relative_error(m: Measurement, asked: float) -> float:
    return abs(m.got / asked - 1.0)


def calibrate(
    measure_at: Callable[[float, int], Measurement],
    asked: float,
    periods: Sequence[int],
    *,
    tolerance: float = TOLERANCE,
    accept: float = ACCEPT,
    attempts: int = ATTEMPTS,
    max_correction: float = MAX_CORRECTION,
    step: Step = scaled_step,
) -> tuple[Measurement, list[Measurement]]:
    """Find the limit (fraction, period) whose measured speed is closest to ``asked``.

    For each period in turn: start at ``asked``, measure, and move the limit by ``step``
    (the period's measurements so far, asked) until within ``tolerance`` (at most
    ``attempts`` settings; a change beyond ``max_correction`` of ``asked`` moves on to the
    next period instead, except at the last one). Stop at the first period whose best
    setting is within ``accept``; else return the best setting over all periods. Returns
    that measurement and every measurement made, in order."""
    if not periods:
        raise ValueError("calibrate() needs at least one period")
    tried: list[Measurement] = []
    for i, period in enumerate(periods):
        fraction = asked
        here: list[Measurement] = []
        last = i == len(periods) - 1
        for _ in range(attempts):
            m = measure_at(fraction, period)
            here.append(m)
            if relative_error(m, asked) <= tolerance:
                return m, tried + here
            following = step(here, asked)
            if following == fraction:  # at the cap: a larger limit is not possible
                break
            if not last and abs(following / asked - 1.0) > max_correction:
                break
            fraction = following
        tried += here
        if relative_error(min(here, key=lambda x: relative_error(x, asked)), asked) <= accept:
            break
    return min(tried, key=lambda x: relative_error(x, asked)), tried


def periods_to_try(requested_us: int, mechanism: str) -> list[int]:
    """The requested period, then (for CFS quotas) the longer fallback periods; the
    competing load's own period."""
    if mechanism == LOAD:
        return [round(LOAD_PERIOD_S * 1e6)]
    if mechanism == "duty-cycle":
        return [requested_us]
    return [requested_us] + [p for p in FALLBACK_PERIODS_US if p > requested_us]


def check_device(
    probe: Probe,
    limiter: Limiter,
    device: str,
    asked: float,
    threads: int,
    cpus: Sequence[int],
    mechanism: str,
    requested_period_us: int,
) -> SpeedCheck:
    """Calibrate one throttled device (see :func:`calibrate`) and leave the best limit found
    in force; on any failure the plain limit ``asked`` is put back before raising."""
    periods = periods_to_try(requested_period_us, mechanism)
    done = False
    try:
        best, tried = calibrate(
            lambda f, p: measure(probe, limiter, f, p, threads, cpus),
            asked,
            periods,
            step=anchored_step if mechanism == LOAD else scaled_step,
        )
        limiter.settle(best.fraction, best.period_us)
        done = True
    finally:
        if not done:
            limiter.settle(asked, requested_period_us)
    note = ""
    if best.period_us > requested_period_us and tried[0].period_us == requested_period_us:
        first = tried[0]
        note = (
            f"period lengthened from {requested_period_us / 1000:g} ms, where quota "
            f"{first.fraction:.2f} gave {first.got:.2f}"
        )
    return SpeedCheck(
        device,
        asked,
        best.got,
        mechanism,
        measured=True,
        fraction=best.fraction,
        period_us=best.period_us,
        samples=best.samples,
        tried=tuple(tried),
        note=note,
    )


class SpeedChecker:
    """Runs the start-up speed check of all devices; holds the probe while it runs, so that
    :meth:`close` (teardown from any exit path) can stop it."""

    def __init__(self) -> None:
        self.probe: Probe | None = None

    def run(
        self,
        devices: Sequence[DeviceSpec],
        asked: Sequence[float],
        mechanisms: Sequence[str],
        cpus: Sequence[tuple[int, ...]],
        groups: Sequence[Group | None],
        hierarchy: Hierarchy | None,
        period_us: int,
        *,
        measure: bool = True,
    ) -> list[SpeedCheck]:
        """One :class:`SpeedCheck` per device. Devices without a limit are not measured
        (speed 1.0); throttled ones are calibrated with the probe unless ``measure`` is off.
        A probe that fails leaves the plain limits in force and is reported per device."""
        checks: list[SpeedCheck] = []
        todo: list[int] = []
        for rank, device in enumerate(devices):
            mech = mechanisms[rank]
            check = SpeedCheck(device.name, asked[rank], 1.0, mech, note="no quota: whole CPU set")
            if mech == "none" and asked[rank] < 1.0:
                check = SpeedCheck(device.name, asked[rank], 1.0, mech, note="no limit emulated")
            elif asked[rank] < 1.0:
                check = SpeedCheck(device.name, asked[rank], None, mech, note="speed check off")
                todo += [rank] if measure else []
            checks.append(check)
        if not todo:
            return checks
        try:
            self.probe = probe = Probe()
            for rank in todo:
                limiter: Limiter = DutyLimiter(probe.pid)
                group = groups[rank]
                if mechanisms[rank] == LOAD:
                    if group is not None:
                        probe.join(group.procs_files)
                    limiter = LoadLimiter(cpus[rank])
                elif mechanisms[rank].startswith("cgroup") and group and hierarchy is not None:
                    probe.join(hierarchy.cpu_procs_files(group))
                    limiter = CgroupLimiter(hierarchy, group, len(cpus[rank]), period_us)
                checks[rank] = check_device(
                    probe, limiter, devices[rank].name, asked[rank], devices[rank].cores,
                    cpus[rank], mechanisms[rank], period_us,
                )  # fmt: skip
        except (ProbeError, OSError) as e:
            for rank in todo:
                if not checks[rank].measured:
                    checks[rank] = SpeedCheck(
                        devices[rank].name, asked[rank], None, mechanisms[rank],
                        note=f"not measured: {e}",
                    )  # fmt: skip
        finally:
            self.close()
        return checks

    def close(self) -> None:
        """Stop the probe if it is running (idempotent)."""
        if self.probe is not None:
            self.probe.close()
            self.probe = None
