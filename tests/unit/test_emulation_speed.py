"""Faithful CPU emulation: no quota where the quota covers the CPU set, the start-up speed
check and its calibration arithmetic (on fake cgroup trees and fake measurements), the report
built from plain data, and — where cgroups are writable — one real measurement."""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from xronos.emulation import ClusterSpec, DeviceSpec, Emulator, hierarchies, speed
from xronos.emulation.cgroups import CgroupV1, CgroupV2, Group, Limits
from xronos.emulation.probe import ProbeError
from xronos.emulation.report import ReportInput, emulator_report
from xronos.emulation.speed import (
    Measurement,
    SpeedCheck,
    SpeedChecker,
    anchored_step,
    calibrate,
    check_device,
    next_fraction,
    next_fraction_anchored,
    periods_to_try,
)


def run_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def fake_v1(tmp_path: Path) -> CgroupV1:
    parents = {c: tmp_path / c for c in ("cpu", "cpuset", "memory")}
    for d in parents.values():
        d.mkdir()
    (parents["cpuset"] / "cpuset.mems").write_text("0\n")
    return CgroupV1(parents)


def fake_v2(tmp_path: Path) -> CgroupV2:
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu memory\n")
    (root / "cgroup.subtree_control").write_text("")
    return CgroupV2(root)


def two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("xronos.emulation.limits.os.sched_getaffinity", lambda pid: {0, 1})


MIXED = ClusterSpec(
    "mixed",
    (
        DeviceSpec("fast", 1, 1.0),
        DeviceSpec("slow", 1, 0.4),
        DeviceSpec("big", 4, 0.6),  # 2.4 CPUs of work on a 2-CPU host: covers its set
    ),
)


# ----------------------------------------------------------------------------- no quota


def test_v1_device_whose_quota_covers_its_cpu_set_gets_no_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    two_cpus(monkeypatch)
    h = fake_v1(tmp_path)
    with Emulator(MIXED, "r", hierarchy=h, state_dir=tmp_path, check_speed=False) as emu:
        quota = {d.name: (h.parents["cpu"] / f"xronos-r-{d.name}") for d in MIXED.devices}
        assert (quota["fast"] / "cpu.cfs_quota_us").read_text() == "-1"
        assert (quota["big"] / "cpu.cfs_quota_us").read_text() == "-1"
        assert (quota["slow"] / "cpu.cfs_quota_us").read_text() == "4000"
        assert (quota["slow"] / "cpu.cfs_period_us").read_text() == "10000"
        assert [emu.asked_speed(r) for r in range(3)] == [1.0, 0.4, 1.0]
        assert emu.effective_speeds() == [1.0, None, 1.0]
        lines = emu.report()
    assert "speed: device fast: asked 1.00, got 1.00 (no quota: whole CPU set)" in lines
    assert "speed: device slow: asked 0.40, not measured (speed check off)" in lines


def test_v2_device_whose_quota_covers_its_cpu_set_gets_max(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    two_cpus(monkeypatch)
    h = fake_v2(tmp_path)
    with Emulator(MIXED, "r", hierarchy=h, state_dir=tmp_path, check_speed=False):
        assert (h.parent / "xronos-r-fast" / "cpu.max").read_text() == "max 10000"
        assert (h.parent / "xronos-r-big" / "cpu.max").read_text() == "max 10000"
        assert (h.parent / "xronos-r-slow" / "cpu.max").read_text() == "4000 10000"


def test_set_quota_and_cpu_procs_files_on_both_hierarchies(tmp_path: Path) -> None:
    v1 = fake_v1(tmp_path)
    group = v1.create("xronos-r-hub", Limits((0,), 4000, 10_000, 2**30))
    cpu = v1.parents["cpu"] / "xronos-r-hub"
    v1.set_quota(group, 9000, 20_000)
    assert (cpu / "cpu.cfs_period_us").read_text() == "20000"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "9000"
    v1.set_quota(group, None, 20_000)
    assert (cpu / "cpu.cfs_quota_us").read_text() == "-1"
    # The probe joins the CPU limits, not the memory cap.
    assert v1.cpu_procs_files(group) == (
        str(cpu / "cgroup.procs"),
        str(v1.parents["cpuset"] / "xronos-r-hub" / "cgroup.procs"),
    )
    v2 = fake_v2(tmp_path)
    group2 = v2.create("xronos-r-hub", Limits((0,), 4000, 10_000))
    v2.set_quota(group2, 9000, 20_000)
    assert (v2.parent / "xronos-r-hub" / "cpu.max").read_text() == "9000 20000"
    v2.set_quota(group2, None, 20_000)
    assert (v2.parent / "xronos-r-hub" / "cpu.max").read_text() == "max 20000"
    assert v2.cpu_procs_files(group2) == group2.procs_files


# ----------------------------------------------------------------------------- calibration


def fake_kernel(
    response: Callable[[float, int], float],
) -> tuple[Callable[[float, int], Measurement], list[tuple[float, int]]]:
    """A measurement function whose speed is ``response(fraction, period)``, and its calls."""
    calls: list[tuple[float, int]] = []

    def measure_at(fraction: float, period: int) -> Measurement:
        calls.append((fraction, period))
        got = response(fraction, period)
        return Measurement(fraction, period, got, (got,))

    return measure_at, calls


def test_next_fraction_scales_by_asked_over_got_within_bounds() -> None:
    assert next_fraction(0.4, 0.4, 0.32) == pytest.approx(0.5)
    assert next_fraction(0.4, 0.4, 0.5) == pytest.approx(0.32)
    assert next_fraction(0.4, 0.4, 0.1) == pytest.approx(0.8)  # at most ×2
    assert next_fraction(0.8, 0.4, 0.1) == 1.0  # never above the whole CPU set
    assert next_fraction(0.4, 0.4, 0.0) == pytest.approx(0.8)
    assert next_fraction(0.4, 0.4, math.nan) == pytest.approx(0.8)


def test_calibration_corrects_a_proportional_loss() -> None:
    measure_at, calls = fake_kernel(lambda f, p: 0.9 * f)  # 10 % lost to throttling
    best, tried = calibrate(measure_at, 0.4, [10_000])
    assert best.fraction == pytest.approx(0.4 / 0.9)
    assert best.got == pytest.approx(0.4)
    assert calls == [(0.4, 10_000), (pytest.approx(0.4 / 0.9), 10_000)]
    assert tried[-1] is best


def test_anchored_step_lies_on_the_line_through_full_speed() -> None:
    # Got 0.28 at a limit of 0.40: the line through (0.40, 0.28) and (1, 1) reaches 0.40 at
    # 1 - 0.6 * 0.6 / 0.72 = 0.5.
    assert next_fraction_anchored(0.4, 0.4, 0.28) == pytest.approx(0.5)
    assert next_fraction_anchored(0.5, 0.4, 0.28) == pytest.approx(1 - 0.6 * 0.5 / 0.72)
    assert next_fraction_anchored(0.4, 0.4, 0.9) == pytest.approx(0.2)  # at most ×2 down
    assert next_fraction_anchored(0.3, 0.9, 0.1) == pytest.approx(0.6)  # at most ×2 up
    # Where the line is not defined, the proportional step.
    for got in (0.0, 1.0, 1.2, math.nan):
        assert next_fraction_anchored(0.4, 0.4, got) == next_fraction(0.4, 0.4, got)


def test_a_loss_that_grows_with_the_load_takes_one_anchored_correction() -> None:
    # The competing load's shape (measured: 0.28 at 0.40, 0.49 at 0.57, 0.37 at 0.47): the
    # device loses a fifth of each busy slice beyond the slice itself.
    def load(f: float, p: int) -> float:
        return 1.2 * f - 0.2

    measure_at, calls = fake_kernel(load)
    best, _ = calibrate(measure_at, 0.4, [1_000], step=anchored_step)
    assert [f for f, _ in calls] == [0.4, pytest.approx(0.5)]
    assert best.got == pytest.approx(0.4)
    # Scaling by asked/got overshoots (0.4 * 0.4 / 0.28 = 0.571 runs at 0.486) and never
    # reaches the tolerance in three settings.
    measure_at, calls = fake_kernel(load)
    best, _ = calibrate(measure_at, 0.4, [1_000])
    assert len(calls) == 3 and abs(best.got / 0.4 - 1) > speed.TOLERANCE


def test_a_competing_load_steps_along_the_line_through_every_setting_it_measured() -> None:
    # A busy host's readings (one start of ci-2dev): 0.364 at 0.400, then 0.436 at the
    # anchored step 0.434 (each ±9 % off). From the last reading alone the next setting
    # would fall back below the first (0.398); the line through full speed fitted to both
    # reaches 0.40 between them.
    readings = {0.4: 0.364}
    second = next_fraction_anchored(0.4, 0.4, 0.364)
    readings[round(second, 6)] = 0.436
    measure_at, calls = fake_kernel(lambda f, p: readings.get(round(f, 6), 0.401))
    best, tried = calibrate(measure_at, 0.4, [1_000], step=anchored_step)
    assert second == pytest.approx(0.434, abs=5e-4)  # as that start stepped
    third = calls[2][0]
    # 1 - got = c (1 - f), least squares over both: c = Σ(1-g)(1-f) / Σ(1-f)²
    c = (0.636 * 0.6 + 0.564 * (1 - second)) / (0.6**2 + (1 - second) ** 2)
    assert third == pytest.approx(1 - 0.6 / c, rel=1e-12)  # float rounding only
    assert 0.4 < third < second and third == pytest.approx(0.4175, abs=5e-4)
    assert best.got == 0.401 and len(tried) == 3
    assert next_fraction_anchored(second, 0.4, 0.436) < 0.4  # what the last alone gives
    # With one reading, the step is the anchored step of that reading.
    one = [Measurement(0.4, 1_000, 0.28, (0.28,))]
    assert anchored_step(one, 0.4) == next_fraction_anchored(0.4, 0.4, 0.28)


def test_calibration_leaves_a_period_the_kernel_does_not_enforce() -> None:
    # At 2.5 ms the quota loses a third of the time; at 10 ms it is 5 % short.
    measure_at, calls = fake_kernel(lambda f, p: (0.66 if p == 2_500 else 0.95) * f)
    best, _ = calibrate(measure_at, 0.4, periods_to_try(2_500, "cgroup v1"))
    # One look at 2.5 ms: the correction it needs (×1.5) is past MAX_CORRECTION.
    assert [p for _, p in calls] == [2_500, 10_000, 10_000]
    assert best.period_us == 10_000 and best.got == pytest.approx(0.4)


def test_calibration_at_the_last_period_corrects_as_far_as_needed() -> None:
    measure_at, _ = fake_kernel(lambda f, p: 0.66 * f)
    best, _ = calibrate(measure_at, 0.4, [20_000])
    assert best.fraction == pytest.approx(0.4 / 0.66)


def test_calibration_stops_at_a_period_within_accept() -> None:
    answers = iter([0.384, 0.418, 0.386])  # noise of ±4 %: within ACCEPT, never TOLERANCE
    measure_at, calls = fake_kernel(lambda f, p: next(answers))
    best, tried = calibrate(measure_at, 0.4, [10_000, 20_000])
    assert len(calls) == 3 and {p for _, p in calls} == {10_000}
    assert best.got == 0.386 and len(tried) == 3


def test_calibration_returns_the_best_when_nothing_is_good_enough() -> None:
    measure_at, calls = fake_kernel(lambda f, p: min(f, 0.2))  # can never exceed 0.2
    best, tried = calibrate(measure_at, 0.4, [10_000, 20_000])
    assert best.got == 0.2 and len(tried) == len(calls)
    # One look at 10 ms (the ×2 it asks for is past MAX_CORRECTION), then up to the cap.
    assert calls == [(0.4, 10_000), (0.4, 20_000), (0.8, 20_000), (1.0, 20_000)]


def test_periods_to_try() -> None:
    assert periods_to_try(2_500, "cgroup v1") == [2_500, 10_000, 20_000]
    assert periods_to_try(10_000, "cgroup v2") == [10_000, 20_000]
    assert periods_to_try(50_000, "cgroup v1") == [50_000]
    assert periods_to_try(2_500, "duty-cycle") == [2_500]


class FakeProbe:
    """Answers like the probe: the limited run takes ``1 / speed(fraction)`` times longer."""

    pid = 0

    def __init__(self, limiter: FakeLimiter, loss: float) -> None:
        self.limiter, self.loss = limiter, loss

    def run(self, threads: int, cpus: tuple[int, ...], reps: int = 1) -> float:
        fraction = self.limiter.fraction
        return 0.1 if fraction is None else 0.1 / (self.loss * fraction)


class FakeLimiter:
    def __init__(self) -> None:
        self.fraction: float | None = None
        self.settled: tuple[float, int] | None = None

    def on(self, fraction: float, period_us: int) -> int:
        self.fraction = fraction
        return period_us

    def off(self) -> None:
        self.fraction = None

    def settle(self, fraction: float, period_us: int) -> None:
        self.settled = (fraction, period_us)


def test_check_device_leaves_the_calibrated_limit_in_force() -> None:
    limiter = FakeLimiter()
    probe = FakeProbe(limiter, 0.9)
    check = check_device(
        probe,  # type: ignore[arg-type]
        limiter,
        "slow",
        0.4,
        1,
        (1,),
        "cgroup v1",
        10_000,
    )
    assert check.measured and check.got == pytest.approx(0.4)
    assert limiter.settled == (pytest.approx(0.4 / 0.9), 10_000)
    assert check.fraction == pytest.approx(0.4 / 0.9) and check.error == pytest.approx(0.0)
    line = check.line()
    assert line.startswith("speed: device slow: asked 0.40, got 0.40 (cgroup v1 quota 0.444")
    assert "outside" not in line


def test_check_device_puts_the_plain_limit_back_when_the_probe_fails() -> None:
    limiter = FakeLimiter()

    class BrokenProbe(FakeProbe):
        def run(self, threads: int, cpus: tuple[int, ...], reps: int = 1) -> float:
            raise ProbeError("the speed probe is gone")

    broken = BrokenProbe(limiter, 1.0)
    with pytest.raises(ProbeError):
        check_device(broken, limiter, "slow", 0.4, 1, (1,), "cgroup v1", 2_500)  # type: ignore[arg-type]
    assert limiter.settled == (0.4, 2_500)


def test_a_speed_far_off_is_flagged_in_its_line() -> None:
    m = Measurement(0.4, 10_000, 0.32, (0.31, 0.32, 0.33))
    check = SpeedCheck("slow", 0.4, 0.32, "cgroup v1", True, 0.4, 10_000, m.samples, (m,))
    assert check.line().endswith("1 setting tried): off by -20%, outside the 5% target")
    assert check.to_dict()["got"] == 0.32


def test_a_probe_that_cannot_start_is_reported_and_the_plain_quota_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_probe() -> None:
        raise ProbeError("the speed probe did not start (is torch installed?)")

    monkeypatch.setattr(speed, "Probe", no_probe)
    two_cpus(monkeypatch)
    h = fake_v1(tmp_path)
    with Emulator(MIXED, "r", hierarchy=h, state_dir=tmp_path) as emu:
        slow = h.parents["cpu"] / "xronos-r-slow"
        assert (slow / "cpu.cfs_quota_us").read_text() == "4000"
        assert emu.effective_speeds() == [1.0, None, 1.0]
        assert emu.speeds[1].note.startswith("not measured: the speed probe did not start")


def test_speed_checker_without_a_limit_measures_nothing() -> None:
    devices = (DeviceSpec("a", 1, 1.0), DeviceSpec("b", 1, 0.5))
    checks = SpeedChecker().run(
        devices, [1.0, 0.5], ["none", "none"], [(0,), (1,)], [None, None], None, 10_000
    )
    assert [c.got for c in checks] == [1.0, 1.0] and not any(c.measured for c in checks)
    assert checks[1].line() == "speed: device b: asked 0.50, got 1.00 (no limit emulated)"


# ----------------------------------------------------------------------------- report


def test_report_is_built_from_plain_data_and_shows_a_lengthened_period() -> None:
    cluster = ClusterSpec("c", (DeviceSpec("fast", 1, 1.0), DeviceSpec("slow", 1, 0.4)))
    first = Measurement(0.4, 2_500, 0.28, (0.28,))
    best = Measurement(0.41, 10_000, 0.4, (0.39, 0.4, 0.41))
    data = ReportInput(
        cluster=cluster,
        host_cpus=(0, 1),
        cpus=((0,), (1,)),
        period_us=2_500,
        cpu_mechanism=("cgroup v1", "cgroup v1"),
        notes={},
        hierarchy_version="v1",
        groups=(Group("a", [], ["cpu", "cpuset"]), Group("b", [], ["cpu", "cpuset"])),
        network=False,
        net=None,
        bridge_ip=None,
        net_notes=(),
        speeds=(
            SpeedCheck("fast", 1.0, 1.0, "cgroup v1", note="no quota: whole CPU set"),
            SpeedCheck("slow", 0.4, 0.4, "cgroup v1", True, 0.41, 10_000, best.samples,
                       (first, best), note="period lengthened from 2.5 ms"),
        ),
    )  # fmt: skip
    lines = emulator_report(data)
    assert lines[1] == "cpu limit: cgroup v1, period 10 ms (2.5 ms requested; see speed lines)"
    assert "cpu sets: cgroup v1 cpuset + sched_setaffinity" in lines
    assert lines[-1].startswith("speed: device slow: asked 0.40, got 0.40 (cgroup v1 quota 0.410")
    assert lines[-1].endswith("2 settings tried); period lengthened from 2.5 ms")
    assert not any(line.startswith("cgroups:") for line in lines)


def test_report_says_where_v2_device_groups_were_made() -> None:
    cluster = ClusterSpec("c", (DeviceSpec("fast", 1, 1.0), DeviceSpec("slow", 1, 0.4)))
    groups = (Group("a", [], ["cpu"]), Group("b", [], ["cpu"]))
    data = ReportInput(cluster, (0, 1), ((0,), (1,)), 10_000, ("cgroup v2",) * 2,
                       {"placement": "device groups under /cg"}, "v2", groups, False, None,
                       None)  # fmt: skip
    assert "cgroups: device groups under /cg" in emulator_report(data)
    # no group took a limit (all fell back): where they were made is not worth a line
    bare = replace(data, groups=(Group("a", []), Group("b", [])))
    assert not any(line.startswith("cgroups:") for line in emulator_report(bare))


# ----------------------------------------------------------------------------- real cgroups


def _cgroups_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to write cgroups"
    h = hierarchies.detect()
    if h is None or "cpu" not in h.available():
        return "no cgroup cpu controller"
    return None


@pytest.mark.skipif(_cgroups_usable() is not None, reason=str(_cgroups_usable()))
@pytest.mark.slow
def test_real_speed_check_measures_and_leaves_nothing_behind(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    cluster = ClusterSpec("c", (DeviceSpec("full", 1, 1.0), DeviceSpec("slow", 1, 0.4)))
    with Emulator(cluster, run_id(), mechanism="cgroup", state_dir=tmp_path) as emu:
        if not emu.cpu_mechanism[1].startswith("cgroup"):
            pytest.skip(f"cgroup cpu quota not in force: {emu.cpu_mechanism}")
        full, slow = emu.effective_speeds()
        report = "\n".join(emu.report())
        check = emu.speeds[1]
        group = emu.groups[0]
        assert group is not None
        quotas = [(d / "cpu.cfs_quota_us") for d in group.dirs]
        assert [f.read_text().strip() for f in quotas if f.exists()] in (["-1"], [])
        assert emu._checker.probe is None  # the probe is gone before start() returns
    assert full == 1.0
    assert slow is not None and math.isfinite(slow) and slow > 0  # reported, not asserted
    assert check.measured and check.tried and check.period_us is not None
    assert "speed: device slow: asked 0.40, got " in report
    assert list(tmp_path.iterdir()) == []
