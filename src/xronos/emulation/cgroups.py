"""The cgroup file protocol, for cgroup v1 and v2.

Three controllers matter to Xronos:

- cpu: v1 ``cpu.cfs_period_us`` + ``cpu.cfs_quota_us`` (and ``cpu.shares``);
  v2 ``cpu.max`` = "quota period" (and ``cpu.weight``).
- cpuset: v1 ``cpuset.mems`` (copied from the parent) + ``cpuset.cpus``; v2 ``cpuset.cpus``.
- memory: v1 ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``); v2
  ``memory.max``.

A process joins a group by writing its pid to ``cgroup.procs`` (v1: in every hierarchy;
v2: once); all its threads move with it and threads it creates later are born inside.
Device groups are created below the cgroups of the process that creates them, so limits
that already apply to it keep applying; on v2 only where that cgroup is the root, since v2
passes controllers only to the children of the root or of a cgroup that holds no processes,
and the creating process's own cgroup holds it (:mod:`hierarchies`). Nothing here
decides policy: :mod:`limits` does.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

CONTROLLERS = ("cpu", "cpuset", "memory")
MIN_QUOTA_US = 1000
"""Smallest CPU quota (and period) the kernel accepts, in microseconds."""
MAX_PERIOD_US = 1_000_000
"""Largest CPU period the kernel accepts, in microseconds."""
WEIGHT_FACTOR = 100
"""A device group's CPU weight relative to an ordinary process (v1 ``cpu.shares`` 102400,
v2 ``cpu.weight`` 10000): other load on the host must not push a device below its quota,
and the quota still caps what the device takes."""


@dataclass(frozen=True)
class Limits:
    """What to write into one device's cgroup."""

    cpus: tuple[int, ...]
    """CPUs of its cpuset."""
    quota_us: int | None
    """CPU time per period over all its threads, or None for no quota."""
    period_us: int
    memory_bytes: int | None = None


@dataclass
class Group:
    """One device's cgroup: a directory per hierarchy (one on v2)."""

    name: str
    dirs: list[Path]
    applied: list[str] = field(default_factory=list)
    """Controllers whose limits were written."""
    problems: dict[str, str] = field(default_factory=dict)
    """Controller -> why its limit could not be written."""

    @property
    def procs_files(self) -> tuple[str, ...]:
        return tuple(str(d / "cgroup.procs") for d in self.dirs)


def quota_and_period(cpus: float, period_us: int) -> tuple[int, int]:
    """CPU quota for ``cpus`` CPUs' worth of time per period; the period is stretched when the
    quota would fall below the kernel's 1 ms minimum."""
    period = max(period_us, MIN_QUOTA_US)
    if cpus * period < MIN_QUOTA_US:
        milli_cpus = max(1, round(cpus * 1000))
        period = min(MAX_PERIOD_US, -(-MIN_QUOTA_US * 1000 // milli_cpus))
    return max(MIN_QUOTA_US, round(cpus * period)), period


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_pids(procs: Path) -> set[int]:
    try:
        return {int(line) for line in procs.read_text().split()}
    except FileNotFoundError:
        return set()


def _pick(directory: Path, name: str) -> Path:
    """``cpuset.cpus`` or, on a hierarchy mounted with ``noprefix``, ``cpus``."""
    path = directory / name
    if path.exists() or not (directory / name.split(".", 1)[1]).exists():
        return path
    return directory / name.split(".", 1)[1]


def _describe(e: OSError) -> str:
    return e.strerror or str(e)


class Hierarchy:
    """Where device groups are made and how limits are written; see the subclasses."""

    version = ""
    placement = ""
    """Where device groups are made, when not below this process's own cgroups."""

    def available(self) -> tuple[str, ...]:
        """Controllers among :data:`CONTROLLERS` that this host offers."""
        raise NotImplementedError

    def plan_dirs(self, name: str, limits: Limits) -> list[Path]:
        """Directories :meth:`create` makes for ``name`` (known before it runs)."""
        raise NotImplementedError

    def create(self, name: str, limits: Limits) -> Group:
        """Make the group and write every limit it can; failures land in ``Group.problems``.
        Raises ``OSError`` only if not even the directories can be made."""
        raise NotImplementedError

    def add_pid(self, group: Group, pid: int) -> None:
        for procs in group.procs_files:
            _write(Path(procs), str(pid))

    def cpu_procs_files(self, group: Group) -> tuple[str, ...]:
        """``cgroup.procs`` files that put a process under the group's CPU limits only (on
        v1 not its memory cap; v2 has one file for all)."""
        return group.procs_files

    def set_quota(self, group: Group, quota_us: int | None, period_us: int) -> None:
        """Change the CPU quota of an existing group (None: no quota)."""
        raise NotImplementedError

    def destroy(self, group: Group, timeout_s: float = 3.0) -> list[str]:
        """Empty the group (this process moves to the parent; any other process in it is
        SIGKILLed) and remove its directories. Returns what could not be done."""
        return destroy_dirs(group.dirs, timeout_s)


def destroy_dirs(dirs: list[Path], timeout_s: float = 3.0) -> list[str]:
    """Kill leftovers in cgroup directories and remove them (deepest first)."""
    problems: list[str] = []
    live = [d for d in dirs if d.is_dir()]
    for d in live:
        for pid in _read_pids(d / "cgroup.procs"):
            try:
                if pid == os.getpid():
                    _write(d.parent / "cgroup.procs", str(pid))
                else:
                    os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except OSError as e:
                problems.append(f"{d}: cannot remove process {pid} ({_describe(e)})")
    deadline = time.monotonic() + timeout_s
    for d in live:
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                # EBUSY while a killed process is still exiting: wait for it, within bounds.
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    problems.append(f"{d}: cannot remove ({_describe(e)})")
                    break
                time.sleep(0.01)
    return problems


class CgroupV1(Hierarchy):
    """Legacy hierarchies: ``parents[controller]`` is this process's cgroup directory in the
    hierarchy that holds that controller (co-mounted controllers share a directory)."""

    version = "v1"

    def __init__(self, parents: dict[str, Path]) -> None:
        self.parents = parents

    def available(self) -> tuple[str, ...]:
        return tuple(c for c in CONTROLLERS if c in self.parents)

    def cpu_procs_files(self, group: Group) -> tuple[str, ...]:
        dirs = {self.parents[c] / group.name for c in ("cpu", "cpuset") if c in self.parents}
        return tuple(str(d / "cgroup.procs") for d in group.dirs if d in dirs)

    def set_quota(self, group: Group, quota_us: int | None, period_us: int) -> None:
        d = self.parents["cpu"] / group.name
        # The kernel checks quota against period on every write: lift the quota first.
        _write(d / "cpu.cfs_quota_us", "-1")
        _write(d / "cpu.cfs_period_us", str(period_us))
        if quota_us is not None:
            _write(d / "cpu.cfs_quota_us", str(quota_us))

    def _needed(self, limits: Limits) -> list[str]:
        wanted = ["cpu", "cpuset"] + (["memory"] if limits.memory_bytes is not None else [])
        return [c for c in wanted if c in self.parents]

    def plan_dirs(self, name: str, limits: Limits) -> list[Path]:
        dirs: list[Path] = []
        for c in self._needed(limits):
            d = self.parents[c] / name
            if d not in dirs:
                dirs.append(d)
        return dirs

    def create(self, name: str, limits: Limits) -> Group:
        group = Group(name, self.plan_dirs(name, limits))
        for d in group.dirs:
            d.mkdir(exist_ok=True)
        for controller in self._needed(limits):
            d = self.parents[controller] / name
            try:
                self._apply(controller, d, limits)
                group.applied.append(controller)
            except OSError as e:
                group.problems[controller] = _describe(e)
        return group

    @staticmethod
    def _apply(controller: str, d: Path, limits: Limits) -> None:
        if controller == "cpu":
            _write(d / "cpu.shares", str(1024 * WEIGHT_FACTOR))
            _write(d / "cpu.cfs_quota_us", "-1")  # no quota; also lets any period be set
            _write(d / "cpu.cfs_period_us", str(limits.period_us))
            if limits.quota_us is not None:
                _write(d / "cpu.cfs_quota_us", str(limits.quota_us))
        elif controller == "cpuset":
            # A new v1 cpuset starts empty and refuses tasks until mems and cpus are set.
            mems = _pick(d.parent, "cpuset.mems").read_text().strip()
            _write(_pick(d, "cpuset.mems"), mems)
            _write(_pick(d, "cpuset.cpus"), ",".join(map(str, limits.cpus)))
        elif controller == "memory" and limits.memory_bytes is not None:
            _write(d / "memory.limit_in_bytes", str(limits.memory_bytes))
            # pages the worker touched before it joined (its interpreter, torch) move with
            # it, so the cap counts what the device holds (v2 has no such move)
            with contextlib.suppress(OSError):
                _write(d / "memory.move_charge_at_immigrate", "3")
            memsw = d / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # no swapping past the cap either, where swap is accounted
                with contextlib.suppress(OSError):
                    _write(memsw, str(limits.memory_bytes))


class CgroupV2(Hierarchy):
    """The unified hierarchy: device groups are children of ``parent``, whose
    ``cgroup.subtree_control`` must enable the controllers for them."""

    version = "v2"

    def __init__(self, parent: Path, placement: str = "") -> None:
        self.parent = parent
        self.placement = placement

    def available(self) -> tuple[str, ...]:
        try:
            offered = (self.parent / "cgroup.controllers").read_text().split()
        except OSError:
            return ()
        return tuple(c for c in CONTROLLERS if c in offered)

    def plan_dirs(self, name: str, limits: Limits) -> list[Path]:
        return [self.parent / name]

    def set_quota(self, group: Group, quota_us: int | None, period_us: int) -> None:
        quota = "max" if quota_us is None else str(quota_us)
        _write(group.dirs[0] / "cpu.max", f"{quota} {period_us}")

    def _enable(self, controllers: list[str]) -> dict[str, str]:
        """Enable controllers for the parent's children in one write (the kernel applies
        "+a +b" as a whole); on failure try one by one. Returns controller -> problem."""
        control = self.parent / "cgroup.subtree_control"
        try:
            missing = [c for c in controllers if c not in control.read_text().split()]
            if missing:
                _write(control, " ".join(f"+{c}" for c in missing))
            return {}
        except OSError:
            pass
        problems: dict[str, str] = {}
        for c in controllers:
            try:
                _write(control, f"+{c}")
            except OSError as e:
                # EBUSY: the parent holds processes itself (v2's "no internal processes" rule).
                problems[c] = f"cannot enable it in {control} ({_describe(e)})"
        return problems

    def create(self, name: str, limits: Limits) -> Group:
        wanted = ["cpu", "cpuset"] + (["memory"] if limits.memory_bytes is not None else [])
        offered = self.available()
        group = Group(name, self.plan_dirs(name, limits))
        group.problems = {c: "not offered by the kernel" for c in wanted if c not in offered}
        group.problems.update(self._enable([c for c in wanted if c in offered]))
        group.dirs[0].mkdir(exist_ok=True)
        for controller in wanted:
            if controller in group.problems:
                continue
            try:
                self._apply(controller, group.dirs[0], limits)
                group.applied.append(controller)
            except OSError as e:
                group.problems[controller] = _describe(e)
        return group

    @staticmethod
    def _apply(controller: str, d: Path, limits: Limits) -> None:
        if controller == "cpu":
            _write(d / "cpu.weight", str(100 * WEIGHT_FACTOR))
            quota = "max" if limits.quota_us is None else str(limits.quota_us)
            _write(d / "cpu.max", f"{quota} {limits.period_us}")
        elif controller == "cpuset":
            _write(d / "cpuset.cpus", ",".join(map(str, limits.cpus)))
        elif controller == "memory" and limits.memory_bytes is not None:
            _write(d / "memory.max", str(limits.memory_bytes))

    def destroy(self, group: Group, timeout_s: float = 3.0) -> list[str]:
        d = group.dirs[0]
        kill = d / "cgroup.kill"  # kernel ≥ 5.14: SIGKILL everything inside at once
        if kill.exists() and os.getpid() not in _read_pids(d / "cgroup.procs"):
            with contextlib.suppress(OSError):
                _write(kill, "1")
        return destroy_dirs(group.dirs, timeout_s)
