"""The competing load: a real-time process per CPU of a slow device takes ``1 - speed`` of
every millisecond, so the device runs at ``speed`` without the bursts of a CFS quota."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from xronos.emulation import ClusterSpec, DeviceSpec, Emulator, competitor, throttle
from xronos.emulation.competitor import MECHANISM, Competitor, available
from xronos.errors import UserError

WHY = available()
needs_realtime = pytest.mark.skipif(WHY is not None, reason=str(WHY))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _share_of_busy_loop(cpu: int, seconds: float = 1.0) -> float:
    """CPU time / wall time of a busy loop pinned to ``cpu``."""
    code = (
        "import os, time\n"
        f"os.sched_setaffinity(0, {{{cpu}}})\n"
        "w, c = time.monotonic(), time.process_time()\n"
        f"while time.monotonic() - w < {seconds}: pass\n"
        "print((time.process_time() - c) / (time.monotonic() - w))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


def test_speeds_it_cannot_make_are_refused() -> None:
    for speed in (1.0, 0.01):
        with pytest.raises(ValueError, match="speed must be in"):
            Competitor((0,), speed)


def test_devices_sharing_cpus_or_at_full_speed_get_no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throttle, "available", lambda: None)
    # fast alone on CPU 0; "a" and "b" share CPU 1; "c" alone on CPU 2, slow.
    cpus = [(0,), (1,), (1,), (2,)]
    ranks, why = throttle.load_ranks("auto", [1.0, 0.5, 0.25, 0.4], cpus)
    assert (ranks, why) == ({3}, None)
    assert throttle.load_ranks("cgroup", [1.0, 0.5, 0.25, 0.4], cpus) == (set(), None)


def test_a_required_load_the_host_cannot_run_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(throttle, "available", lambda: "no real-time scheduling (denied)")
    assert throttle.load_ranks("auto", [1.0, 0.4], [(0,), (1,)]) == (
        set(),
        "no real-time scheduling (denied)",
    )
    with pytest.raises(UserError, match=r"no real-time scheduling.*--cpu-limit quota"):
        throttle.load_ranks("load", [1.0, 0.4], [(0,), (1,)])


@needs_realtime
@pytest.mark.slow
def test_the_load_takes_its_share_of_the_cpu_and_gives_it_back() -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    before = _share_of_busy_loop(cpu)
    load = Competitor((cpu,), 0.4)
    try:
        limited = _share_of_busy_loop(cpu)
    finally:
        load.stop()
    after = _share_of_busy_loop(cpu)
    # The load leaves 0.4 of each millisecond; context switches and the helper's wake-ups
    # cost a few hundredths (calibration corrects that in the emulator). Other activity on
    # a shared host lowers every share alike (one CI host gave the loop 0.19 under the
    # load), so the share under load is taken against the share just before it:
    # 0.25-0.55 of it tells "limited to about 0.4" from both "no limit" (~1.0) and
    # "starved"; after stop() the loop has at least twice the limited share again.
    assert 0.25 <= limited / before <= 0.55, (before, limited)
    assert after > 2 * limited, (limited, after)
    assert all(p.poll() is not None for p in load.processes)


@needs_realtime
def test_the_load_leaves_when_the_process_that_started_it_is_gone() -> None:
    code = (
        "from xronos.emulation.competitor import Competitor\n"
        "c = Competitor((0,), 0.5)\n"
        "print(' '.join(str(p.pid) for p in c.processes), flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    pids = [int(p) for p in owner.stdout.readline().split()]
    assert pids and all(_alive(p) for p in pids)
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10  # the helper checks its owner every second
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


@needs_realtime
@pytest.mark.slow
def test_emulator_puts_a_load_on_the_slow_devices_cpu_and_no_quota(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs (one per device)")
    cluster = ClusterSpec("c", (DeviceSpec("fast", 1, 1.0), DeviceSpec("slow", 1, 0.4)))
    with Emulator(
        cluster, f"t{uuid.uuid4().hex[:8]}", mechanism="load", state_dir=tmp_path,
        check_speed=False,  # the load is the spec's, not a calibrated one
    ) as emu:  # fmt: skip
        assert emu.cpu_mechanism[1] == MECHANISM and emu.cpu_mechanism[0] != MECHANISM
        loads = emu._throttles.loads
        assert list(loads) == [1]
        pids = [p.pid for p in loads[1].processes]
        assert [os.sched_getaffinity(p) for p in pids] == [set(emu.cpus[1])]
        assert [os.sched_getscheduler(p) for p in pids] == [os.SCHED_FIFO]
        group = emu.groups[1]
        quotas = [d / "cpu.cfs_quota_us" for d in group.dirs] if group else []
        assert [f.read_text().strip() for f in quotas if f.exists()] in (["-1"], [])
        report = "\n".join(emu.report())
    assert "cpu limit: " in report and "competing load (a real-time process" in report
    with contextlib.suppress(subprocess.TimeoutExpired):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)  # stopped at teardown


def _refuse_first(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the first ``sched_setscheduler`` fail as a cgroup without real-time time does."""
    calls: list[int] = []

    def setscheduler(pid: int, policy: int, param: os.sched_param) -> None:
        calls.append(policy)
        if len(calls) == 1:
            raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(competitor.os, "sched_setscheduler", setscheduler)
    monkeypatch.setattr(competitor.os, "sched_setaffinity", lambda pid, cpus: None)
    return calls


def test_refused_real_time_moves_the_helper_to_the_v2_root_and_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Real-time group scheduling on cgroup v2 refuses SCHED_FIFO below the root cgroup.
    (tmp_path / "cgroup.procs").write_text("")
    (tmp_path / "mounts").write_text(f"proc /proc proc rw 0 0\ncgroup2 {tmp_path} cgroup2 rw 0 0\n")
    monkeypatch.setattr(competitor, "MOUNTS", str(tmp_path / "mounts"))
    calls = _refuse_first(monkeypatch)
    competitor._become_realtime(0)
    assert calls == [os.SCHED_FIFO, os.SCHED_FIFO]
    assert (tmp_path / "cgroup.procs").read_text() == str(os.getpid())


def test_refused_real_time_without_a_v2_root_stays_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mounts").write_text(f"cgroup {tmp_path} cgroup rw,cpu 0 0\n")
    monkeypatch.setattr(competitor, "MOUNTS", str(tmp_path / "mounts"))
    calls = _refuse_first(monkeypatch)
    with pytest.raises(PermissionError):
        competitor._become_realtime(0)
    assert calls == [os.SCHED_FIFO]
