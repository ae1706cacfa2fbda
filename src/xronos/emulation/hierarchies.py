"""Which cgroup hierarchy this process can use, and where device groups go in it.

:func:`detect` reads ``/proc/mounts`` and ``/proc/self/cgroup``: v1 where any of the cpu,
cpuset and memory controllers is mounted as v1 (hybrid hosts included), else v2 where a
unified hierarchy is mounted. On v1, device groups go below this process's own cgroups;
on v2 only where that cgroup is the root (:func:`v2_parent`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from xronos.emulation.cgroups import CONTROLLERS, CgroupV1, CgroupV2, Hierarchy


def _unescape(field_: str) -> str:
    """Mount points in /proc/mounts escape space, tab, newline and backslash as octal."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field_ = field_.replace(code, char)
    return field_


def _own_paths(self_cgroup: str) -> dict[str, str]:
    """``/proc/self/cgroup`` -> {controller: path}; the v2 entry is under key ``""``."""
    paths: dict[str, str] = {}
    for line in self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    return paths


def _below(mountpoint: Path, own: str | None) -> Path:
    """This process's cgroup directory, or the mount root where the path is not visible
    (a container without its own cgroup namespace)."""
    if own:
        candidate = mountpoint / own.lstrip("/")
        if candidate.is_dir():
            return candidate
    return mountpoint


def detect(
    mounts: str | os.PathLike[str] = "/proc/mounts",
    self_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
) -> Hierarchy | None:
    """The hierarchy to use: v1 if any of cpu/cpuset/memory is mounted as v1 (hybrid hosts
    included), else v2 if a unified hierarchy is mounted, else None."""
    try:
        mount_lines = Path(mounts).read_text().splitlines()
        own = _own_paths(Path(self_cgroup).read_text())
    except OSError:
        return None
    v1: dict[str, Path] = {}
    v2_mount: Path | None = None
    for line in mount_lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        mountpoint, fstype, options = Path(_unescape(parts[1])), parts[2], parts[3].split(",")
        if fstype == "cgroup":
            for controller in CONTROLLERS:
                if controller in options:
                    v1[controller] = _below(mountpoint, own.get(controller))
        elif fstype == "cgroup2" and v2_mount is None:
            v2_mount = mountpoint
    if v1:
        return CgroupV1(v1)
    if v2_mount is not None:
        own_dir = _below(v2_mount, own.get(""))
        parent = v2_parent(v2_mount, own_dir)
        placement = (
            f"device groups under {parent}, not in this process's own cgroup {own_dir}: "
            "cgroup v2 passes controllers only to children of the root or of a cgroup "
            "that holds no processes"
        )
        return CgroupV2(parent, placement if parent != own_dir else "")
    return None


def v2_parent(mount: Path, own: Path) -> Path:
    """Where device groups go on the unified hierarchy: ``own`` (this process's cgroup)
    where it is the root; else the nearest ancestor that already passes every controller
    the root offers to its children (such a cgroup holds no processes); else the root."""
    if own == mount:
        return own
    try:
        offered = set((mount / "cgroup.controllers").read_text().split()) & set(CONTROLLERS)
    except OSError:
        return own
    for parent in own.parents:
        if parent == mount or mount not in parent.parents:
            break
        with contextlib.suppress(OSError):
            if offered <= set((parent / "cgroup.subtree_control").read_text().split()):
                return parent
    return mount
