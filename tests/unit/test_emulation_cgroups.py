"""cgroup emulation: the v2 file protocol on a fake root, hierarchy detection, and — on a host
where cgroups are writable (root) — real CPU quota, memory cap and teardown on every exit path.

Other load on the host must not decide a CPU-share measurement. Device groups get 100× the
CFS weight of an ordinary process (part of the emulation), and the busy child also runs at
nice -20 (these tests need root anyway; weight 88761 against 1024 for nice 0), so it gets
≥ 98 % of a contended CPU unless the limit under test holds it back.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from xronos.emulation import (
    ClusterSpec,
    DeviceSlot,
    DeviceSpec,
    Emulator,
    cleanup_stale,
    hierarchies,
    throttle,
)
from xronos.emulation.cgroups import CgroupV1, CgroupV2, Limits, quota_and_period
from xronos.emulation.state import process_start_time
from xronos.errors import UserError

SPAWN = mp.get_context("spawn")


def _probe() -> str | None:
    """Why real cgroup tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to write cgroups"
    hierarchy = hierarchies.detect()
    if hierarchy is None:
        return "no cgroup hierarchy mounted"
    if "cpu" not in hierarchy.available():
        return "no cgroup cpu controller"
    cpu = min(os.sched_getaffinity(0))
    try:
        group = hierarchy.create(f"xronos-probe-{os.getpid()}", Limits((cpu,), None, 10_000))
    except OSError as e:
        return f"cgroups not writable here ({e.strerror})"
    hierarchy.destroy(group)
    return None if "cpu" in group.applied else f"cpu controller not writable: {group.problems}"


NO_CGROUPS = _probe()
needs_cgroups = pytest.mark.skipif(NO_CGROUPS is not None, reason=str(NO_CGROUPS))


def run_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def leftover_dirs(run: str) -> list[Path]:
    """Every cgroup directory of the run, in any hierarchy, at the mount roots or below this
    process's own cgroups."""
    hierarchy = hierarchies.detect()
    roots: set[Path] = set()
    if isinstance(hierarchy, CgroupV1):
        roots = set(hierarchy.parents.values())
    elif isinstance(hierarchy, CgroupV2):
        roots = {hierarchy.parent}
    roots |= {p for r in list(roots) for p in r.parents if p.name}
    return sorted(d for r in roots for d in r.glob(f"xronos-{run}*"))


# ----------------------------------------------------------------------------- children


def busy_child(slot: DeviceSlot, seconds: float, out: Any) -> None:
    os.nice(-20)
    slot.enter(configure_torch=False)
    wall0, cpu0 = time.monotonic(), time.process_time()
    while time.monotonic() - wall0 < seconds:
        pass
    out.put((slot.device, time.process_time() - cpu0, time.monotonic() - wall0))


def sleepy_child(slot: DeviceSlot, ready: Any) -> None:
    slot.enter(configure_torch=False)
    ready.put(os.getpid())
    time.sleep(60)


def hog_child(slot: DeviceSlot, megabytes: int) -> None:
    slot.enter(configure_torch=False)
    block = bytearray(megabytes * 2**20)
    for i in range(0, len(block), 4096):  # touch every page so it is really charged
        block[i] = 1


def torch_child(slot: DeviceSlot, out: Any) -> None:
    slot.enter()
    import torch

    out.put(
        (
            torch.get_num_threads(),
            torch.get_num_interop_threads(),
            sorted(os.sched_getaffinity(0)),
            os.environ["OMP_NUM_THREADS"],
        )
    )


# ----------------------------------------------------------------------------- no root needed


def fake_v2_root(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    return root


def test_v2_file_protocol_on_a_fake_root(tmp_path: Path) -> None:
    root = fake_v2_root(tmp_path)
    hierarchy = CgroupV2(root)
    group = hierarchy.create("xronos-r-hub", Limits((0, 1), 4000, 10_000, 2**30))
    d = root / "xronos-r-hub"
    assert group.dirs == [d] and sorted(group.applied) == ["cpu", "cpuset", "memory"]
    assert (root / "cgroup.subtree_control").read_text() == "+cpu +cpuset +memory"
    assert (d / "cpu.max").read_text() == "4000 10000"
    assert (d / "cpu.weight").read_text() == "10000"
    assert (d / "cpuset.cpus").read_text() == "0,1"
    assert (d / "memory.max").read_text() == str(2**30)
    # No quota means "max"; no memory cap means the memory controller is left alone.
    other = hierarchy.create("xronos-r-nuc", Limits((2,), None, 10_000))
    assert (root / "xronos-r-nuc" / "cpu.max").read_text() == "max 10000"
    assert not (root / "xronos-r-nuc" / "memory.max").exists()
    assert other.procs_files == (str(root / "xronos-r-nuc" / "cgroup.procs"),)


def test_v2_reports_controllers_the_kernel_does_not_offer(tmp_path: Path) -> None:
    root = fake_v2_root(tmp_path)
    (root / "cgroup.controllers").write_text("cpu io\n")
    group = CgroupV2(root).create("xronos-r-hub", Limits((0,), 4000, 10_000, 2**30))
    assert group.applied == ["cpu"]
    assert set(group.problems) == {"cpuset", "memory"}


def test_v2_join_and_destroy_kill_what_is_inside(tmp_path: Path) -> None:
    root = fake_v2_root(tmp_path)
    hierarchy = CgroupV2(root)
    group = hierarchy.create("xronos-r-hub", Limits((0,), 4000, 10_000))
    (root / "xronos-r-hub" / "cgroup.kill").write_text("")
    leftover = subprocess.Popen(["sleep", "30"])
    hierarchy.add_pid(group, leftover.pid)
    assert (root / "xronos-r-hub" / "cgroup.procs").read_text() == str(leftover.pid)
    problems = hierarchy.destroy(group, timeout_s=0.1)
    assert leftover.wait(timeout=5) == -signal.SIGKILL
    assert (root / "xronos-r-hub" / "cgroup.kill").read_text() == "1"
    # A real kernel removes the control files with the directory; here they are plain files,
    # so the directory stays and destroy() says so instead of raising.
    assert len(problems) == 1 and "xronos-r-hub" in problems[0]


def test_destroy_moves_this_process_out_instead_of_killing_it(tmp_path: Path) -> None:
    root = fake_v2_root(tmp_path)
    hierarchy = CgroupV2(root)
    group = hierarchy.create("xronos-r-hub", Limits((0,), None, 10_000))
    hierarchy.add_pid(group, os.getpid())
    hierarchy.destroy(group, timeout_s=0.1)
    assert (root / "cgroup.procs").read_text() == str(os.getpid())


def write_proc_files(tmp_path: Path, mounts: str, own: str) -> tuple[Path, Path]:
    (tmp_path / "mounts").write_text(mounts)
    (tmp_path / "cgroup").write_text(own)
    return tmp_path / "mounts", tmp_path / "cgroup"


def test_detect_prefers_v1_controllers_on_a_hybrid_host(tmp_path: Path) -> None:
    (tmp_path / "memory" / "jobs" / "42").mkdir(parents=True)
    mounts = (
        "".join(
            f"cgroup {tmp_path}/{c} cgroup rw,relatime,{c} 0 0\n"
            for c in ("cpu", "cpuset", "memory")
        )
        + f"cgroup2 {tmp_path}/unified cgroup2 rw 0 0\n"
    )
    own = "4:memory:/jobs/42\n3:cpuset:/\n1:cpu:/\n0::/\n"
    hierarchy = hierarchies.detect(*write_proc_files(tmp_path, mounts, own))
    assert isinstance(hierarchy, CgroupV1)
    assert hierarchy.parents == {
        "cpu": tmp_path / "cpu",
        "cpuset": tmp_path / "cpuset",
        "memory": tmp_path / "memory" / "jobs" / "42",  # below our own cgroup
    }


def test_detect_co_mounted_cpu_and_cpuacct(tmp_path: Path) -> None:
    mounts = f"cgroup {tmp_path}/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n"
    hierarchy = hierarchies.detect(*write_proc_files(tmp_path, mounts, "2:cpu,cpuacct:/\n"))
    assert isinstance(hierarchy, CgroupV1)
    assert hierarchy.parents == {"cpu": tmp_path / "cpu,cpuacct"}


def unified(tmp_path: Path, passed: dict[str, str], own: str) -> CgroupV2:
    """A v2 mount at ``tmp_path/cg`` offering cpuset, cpu, io, memory and pids, whose
    cgroups (relative paths, "" = the root) pass ``passed`` to their children."""
    mount = tmp_path / "cg"
    for rel, controllers in passed.items():
        (mount / rel).mkdir(parents=True, exist_ok=True)
        (mount / rel / "cgroup.subtree_control").write_text(controllers + "\n")
    (mount / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    mounts = f"proc /proc proc rw 0 0\ncgroup2 {mount} cgroup2 rw,nsdelegate 0 0\n"
    hierarchy = hierarchies.detect(*write_proc_files(tmp_path, mounts, f"0::{own}\n"))
    assert isinstance(hierarchy, CgroupV2)
    return hierarchy


def test_detect_v2_makes_groups_at_the_root_when_no_ancestor_passes_the_controllers(
    tmp_path: Path,
) -> None:
    # A systemd host: our own scope holds this process, so v2 refuses to pass controllers
    # to children there (EBUSY); no slice above passes cpuset: only the root can host them.
    hierarchy = unified(
        tmp_path,
        {"": "cpu memory pids", "user.slice": "memory pids", "user.slice/s.scope": ""},
        "/user.slice/s.scope",
    )
    assert hierarchy.parent == tmp_path / "cg"
    assert f"not in this process's own cgroup {tmp_path}/cg/user.slice/s.scope" in (
        hierarchy.placement
    )


def test_detect_v2_makes_groups_in_the_nearest_ancestor_that_passes_the_controllers(
    tmp_path: Path,
) -> None:
    hierarchy = unified(
        tmp_path,
        {"": "cpuset cpu io memory pids", "jobs": "cpuset cpu memory", "jobs/a/b": ""},
        "/jobs/a/b",
    )
    assert hierarchy.parent == tmp_path / "cg" / "jobs"


def test_detect_v2_keeps_groups_below_its_own_cgroup_at_the_root(tmp_path: Path) -> None:
    hierarchy = unified(tmp_path, {"": "", "other.slice": "cpuset cpu memory"}, "/")
    assert hierarchy.parent == tmp_path / "cg" and hierarchy.placement == ""


def test_detect_v2_without_a_readable_root_keeps_its_own_cgroup(tmp_path: Path) -> None:
    (tmp_path / "user.slice" / "job.scope").mkdir(parents=True)
    mounts = f"proc /proc proc rw 0 0\ncgroup2 {tmp_path} cgroup2 rw,nsdelegate 0 0\n"
    own = "0::/user.slice/job.scope\n"
    hierarchy = hierarchies.detect(*write_proc_files(tmp_path, mounts, own))
    assert isinstance(hierarchy, CgroupV2)
    assert hierarchy.parent == tmp_path / "user.slice" / "job.scope"


def test_detect_none_without_cgroup_mounts(tmp_path: Path) -> None:
    mounts = "proc /proc proc rw 0 0\ntmpfs /tmp tmpfs rw 0 0\n"
    assert hierarchies.detect(*write_proc_files(tmp_path, mounts, "0::/\n")) is None


def test_quota_and_period() -> None:
    assert quota_and_period(0.4, 10_000) == (4000, 10_000)
    assert quota_and_period(2 * 0.6, 10_000) == (12_000, 10_000)
    # 0.05 CPU of a 10 ms period would be 0.5 ms, below the kernel's 1 ms minimum quota.
    quota, period = quota_and_period(0.05, 10_000)
    assert quota >= 1000 and quota / period == pytest.approx(0.05)


def test_mechanism_cgroup_without_cgroups_is_a_user_error(tmp_path: Path) -> None:
    cluster = ClusterSpec("c", (DeviceSpec("hub", 1, 0.5),))
    emu = Emulator(cluster, run_id(), mechanism="cgroup", hierarchy=None, state_dir=tmp_path)
    with pytest.raises(UserError, match="no cgroup hierarchy is mounted; run as root"):
        emu.start()


def test_unwritable_cgroups_fall_back_to_duty_cycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A host that allows no real-time scheduling either (else the competing load is used).
    monkeypatch.setattr(throttle, "available", lambda: "no real-time scheduling (denied)")
    missing = tmp_path / "not-mounted"
    hierarchy = CgroupV1({"cpu": missing, "cpuset": missing})
    cluster = ClusterSpec("c", (DeviceSpec("hub", 1, 0.5),))
    with Emulator(
        cluster, run_id(), hierarchy=hierarchy, state_dir=tmp_path, check_speed=False
    ) as emu:
        assert emu.cpu_mechanism == ["duty-cycle"]
        report = "\n".join(emu.report())
        assert emu.slot(0).cgroup_procs == ()
    assert "cpu limit: duty-cycle fallback" in report
    assert "cgroups not writable: No such file or directory" in report
    assert "cpu sets: sched_setaffinity" in report
    assert "competing load not used (no real-time scheduling (denied))" in report


# ----------------------------------------------------------------------------- real cgroups


@needs_cgroups
@pytest.mark.slow
def test_cgroup_cpu_quota_limits_a_busy_worker(tmp_path: Path) -> None:
    cluster = ClusterSpec("c", (DeviceSpec("fast", 1, 1.0), DeviceSpec("slow", 1, 0.3)))
    run = run_id()
    out = SPAWN.Queue()
    with Emulator(cluster, run, mechanism="cgroup", state_dir=tmp_path, check_speed=False) as emu:
        assert emu.cpu_mechanism[0].startswith("cgroup")
        assert f"cpu limit: cgroup {emu.hierarchy.version}" in "\n".join(emu.report())  # type: ignore[union-attr]
        procs = [SPAWN.Process(target=busy_child, args=(emu.slot(r), 0.5, out)) for r in (0, 1)]
        for rank, proc in enumerate(procs):
            proc.start()
            emu.attach(rank, proc.pid)  # type: ignore[arg-type]
        shares = {}
        for _ in procs:
            device, cpu, wall = out.get(timeout=60)
            shares[device] = cpu / wall
        for proc in procs:
            proc.join()
        slow_cpu = next(d for d in emu.groups[1].dirs if (d / "cpu.stat").exists())  # type: ignore[union-attr]
        throttled = dict(line.split() for line in (slow_cpu / "cpu.stat").read_text().splitlines())
    # CFS bandwidth hands quota to CPUs in slices (5 ms by default) and enforces it at tick
    # granularity, so a 0.5 s window (50 periods) can overrun 0.3 by a slice or two at its
    # edges (≈ 0.01–0.02); 0.45 allows that and is still far below an unthrottled 1.0.
    assert shares["slow"] <= 0.45
    assert int(throttled["nr_throttled"]) > 0  # the cgroup, not other load, held it back
    assert shares["fast"] >= 0.8  # quota 1.0 of one core: no throttling (nice -20, see top)
    assert leftover_dirs(run) == []


@needs_cgroups
def test_memory_cap_kills_a_worker_that_exceeds_it(tmp_path: Path) -> None:
    cluster = ClusterSpec("c", (DeviceSpec("pi", 1, 1.0, memory_bytes=64 * 2**20),))
    with Emulator(cluster, run_id(), state_dir=tmp_path) as emu:
        if not any("memory" in g.applied for g in emu.groups if g is not None):
            pytest.skip("memory controller not writable here")
        assert "memory cap: cgroup" in "\n".join(emu.report())
        proc = SPAWN.Process(target=hog_child, args=(emu.slot(0), 256))
        proc.start()
        proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL  # the kernel's OOM killer, inside the cap


@needs_cgroups
@pytest.mark.parametrize("ending", ["normal", "exception", "worker-sigkilled"])
def test_teardown_removes_every_cgroup_on_each_exit_path(tmp_path: Path, ending: str) -> None:
    run = run_id()
    ready = SPAWN.Queue()
    cluster = ClusterSpec("c", (DeviceSpec("hub", 1, 0.5, memory_bytes=2**30),))
    expected = pytest.raises(RuntimeError) if ending == "exception" else contextlib.nullcontext()
    with expected, Emulator(cluster, run, state_dir=tmp_path, check_speed=False) as emu:
        proc = SPAWN.Process(target=sleepy_child, args=(emu.slot(0), ready))
        proc.start()
        pid = ready.get(timeout=60)
        assert leftover_dirs(run) and all(
            str(pid) in Path(f).read_text().split() for f in emu.slot(0).cgroup_procs
        )
        if ending == "worker-sigkilled":
            os.kill(pid, signal.SIGKILL)
        elif ending == "exception":
            raise RuntimeError("launcher failed while the worker runs")
        else:
            proc.terminate()
        proc.join(timeout=10)
    proc.join(timeout=10)
    assert proc.exitcode is not None  # nobody is left running inside a device
    assert leftover_dirs(run) == []
    assert list(tmp_path.iterdir()) == []  # the state file went with them


LAUNCHER = """
import multiprocessing as mp, signal, sys, time
from xronos.emulation import Emulator, load_cluster

def worker(slot):
    slot.enter(configure_torch=False)
    time.sleep(120)

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the test runner's was
    with Emulator(
        load_cluster("ci-2dev"), sys.argv[1], state_dir=sys.argv[2], check_speed=False
    ) as emu:
        procs = [mp.get_context("spawn").Process(target=worker, args=(emu.slot(r),))
                 for r in range(2)]
        for rank, p in enumerate(procs):
            p.start()
            emu.attach(rank, p.pid)
        print(" ".join(str(p.pid) for p in procs), flush=True)
        time.sleep(120)
"""


def start_launcher(tmp_path: Path, run: str) -> tuple[subprocess.Popen[str], list[int]]:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, str(script), run, str(state)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], 60)
    assert readable, "launcher did not start its workers"
    return proc, [int(p) for p in proc.stdout.readline().split()]


def wait_gone(pids: list[int], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(process_start_time(pid) is None for pid in pids):
            return True
        time.sleep(0.05)
    return False


@needs_cgroups
@pytest.mark.slow
def test_sigterm_to_the_launcher_tears_down_and_still_terminates_it(tmp_path: Path) -> None:
    run = run_id()
    launcher, workers = start_launcher(tmp_path, run)
    try:
        assert len(leftover_dirs(run)) >= 2
        launcher.send_signal(signal.SIGTERM)
        # the launcher sleeps 120 s: anything but -SIGTERM well before that is a failure
        assert launcher.wait(timeout=60) == -signal.SIGTERM  # the default handler ran
        assert wait_gone(workers)
        assert leftover_dirs(run) == []
    finally:  # a failure leaves no load or cgroup behind for the tests after it
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        cleanup_stale(state_dir=tmp_path / "state")


@needs_cgroups
def test_a_process_that_ignores_sigterm_keeps_ignoring_it(tmp_path: Path) -> None:
    cluster = ClusterSpec("c", (DeviceSpec("hub", 1, 1.0),))
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with Emulator(cluster, run_id(), state_dir=tmp_path, check_speed=False):
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with Emulator(cluster, run_id(), state_dir=tmp_path, check_speed=False) as emu:
            assert signal.getsignal(signal.SIGTERM) == emu._on_sigterm  # teardown first
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # then the default again
    finally:
        signal.signal(signal.SIGTERM, before)


@needs_cgroups
def test_an_owner_that_stops_on_sigterm_as_on_ctrl_c_tears_down_on_the_way_out(
    tmp_path: Path,
) -> None:
    # `xronos finetune` maps SIGTERM to Ctrl-C: its workers must finish their step first,
    # so the signal may not tear the devices down under them; the `with` block does, as
    # the KeyboardInterrupt leaves it.
    cluster = ClusterSpec("c", (DeviceSpec("hub", 1, 1.0),))
    run = run_id()
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with Emulator(cluster, run, state_dir=tmp_path, check_speed=False):
            made, during = leftover_dirs(run), None
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises before this ends
            except KeyboardInterrupt:
                during = leftover_dirs(run)
        assert made, "the emulator made no cgroup to observe"
        assert during == made  # the signal left the devices standing
        assert leftover_dirs(run) == []  # the `with` block took them down
        assert signal.getsignal(signal.SIGTERM) == signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGTERM, before)


@needs_cgroups
@pytest.mark.slow
def test_cleanup_stale_removes_what_a_killed_launcher_left(tmp_path: Path) -> None:
    run = run_id()
    launcher, workers = start_launcher(tmp_path, run)
    launcher.kill()  # no teardown can run
    launcher.wait(timeout=10)
    assert len(leftover_dirs(run)) >= 2 and not wait_gone(workers, 0.2)
    # A live run in the same state directory is left alone.
    cluster = ClusterSpec("c", (DeviceSpec("hub", 1, 0.5),))
    live = run_id()
    with Emulator(cluster, live, state_dir=tmp_path / "state", check_speed=False):
        cleaned = cleanup_stale(state_dir=tmp_path / "state")
        assert len(leftover_dirs(live)) >= 1
    assert len(cleaned) == 1 and f"run {run}: removed" in cleaned[0]
    assert leftover_dirs(run) == []
    assert wait_gone(workers)  # orphaned workers inside the devices were killed
    assert list((tmp_path / "state").iterdir()) == []


@needs_cgroups
@pytest.mark.slow
def test_slot_enter_sizes_torch_pools_and_pins_cpus(tmp_path: Path) -> None:
    host = sorted(os.sched_getaffinity(0))
    cluster = ClusterSpec("c", (DeviceSpec("nuc", 2, 1.0),))
    out = SPAWN.Queue()
    with Emulator(cluster, run_id(), state_dir=tmp_path) as emu:
        proc = SPAWN.Process(target=torch_child, args=(emu.slot(0), out))
        proc.start()
        threads, interop, cpus, omp = out.get(timeout=120)
        proc.join()
    assert (threads, interop, omp) == (2, 1, "2")
    assert cpus == host[:2]
