"""Resident memory of this process: now, its peak since a reset, and the memory cgroup's
cap and count.

The peak is the kernel's high-water mark of the process's resident memory (``VmHWM``),
reset by writing ``5`` to ``/proc/self/clear_refs``; where that is refused the only peak
left is ``ru_maxrss``, the process's lifetime maximum (:attr:`PeakRSS.note` says which).
A memory cgroup (v1 or v2) counts what is charged to it, which can be less than the
resident memory: pages the process touched before it joined the group, and shared pages
(libraries' code) first read by another process, are charged elsewhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
from pathlib import Path

MIB = 2**20
CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")
UNLIMITED = 2**62
"""cgroup v1 writes "no limit" as a number near 2**63."""


def _status_bytes(key: str) -> int | None:
    """A ``kB`` line of ``/proc/self/status`` in bytes (None where there is none)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def release() -> None:
    """Hand freed memory back to the kernel: collect cycles, then ask the C allocator to
    return its free pages (glibc's ``malloc_trim``; elsewhere nothing more is done)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def resident_bytes() -> int:
    """This process's resident memory now (``VmRSS``; the peak where that is unknown)."""
    now = _status_bytes("VmRSS")
    return now if now is not None else PeakRSS.lifetime_bytes()


class PeakRSS:
    """This process's peak resident memory since the last :meth:`reset`, and over its
    whole life (:meth:`overall_bytes`: a reset clears the kernel's mark, and with it what
    ``ru_maxrss`` reports, so the peaks before each reset are kept here)."""

    def __init__(self) -> None:
        self.earlier = max(_status_bytes("VmHWM") or 0, self.lifetime_bytes())
        """The highest peak before the last reset."""
        self.resettable = self._clear()
        self.note = (
            "VmHWM, reset before each strategy"
            if self.resettable
            else "ru_maxrss: the process's lifetime peak (its high-water mark cannot be "
            "reset here), the same for every strategy"
        )

    @staticmethod
    def _clear() -> bool:
        try:
            CLEAR_REFS.write_text("5")
        except OSError:
            return False
        return _status_bytes("VmHWM") is not None

    @staticmethod
    def lifetime_bytes() -> int:
        """``ru_maxrss``: the process's peak since it started or since the last reset of
        its high-water mark."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux

    def reset(self) -> None:
        """Start a new peak at the current resident memory (no-op where not resettable)."""
        if self.resettable:
            self.earlier = max(self.earlier, self.peak_bytes())
            self._clear()

    def peak_bytes(self) -> int:
        hwm = _status_bytes("VmHWM") if self.resettable else None
        return hwm if hwm is not None else self.lifetime_bytes()

    def overall_bytes(self) -> int:
        """The highest resident memory of the process's life so far."""
        return max(self.earlier, self.peak_bytes())


def _memory_cgroup() -> tuple[Path, Path, str, str] | None:
    """(root of the hierarchy, this process's directory in it, its limit file, its peak
    file) of this process's memory cgroup; None where there is none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            root = Path("/sys/fs/cgroup/memory")
            return (
                root,
                root / path.lstrip("/"),
                "memory.limit_in_bytes",
                "memory.max_usage_in_bytes",
            )
    for line in lines:
        if line.startswith("0::"):
            root = Path("/sys/fs/cgroup")
            return root, root / line[3:].lstrip("/"), "memory.max", "memory.peak"
    return None


def _read_bytes(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < UNLIMITED else None


def enforced_cap() -> int | None:
    """The memory limit the kernel enforces on this process: the smallest limit of its
    memory cgroup and the cgroup's ancestors (v1 ``memory.limit_in_bytes``, v2
    ``memory.max``); None where there is none or it cannot be read."""
    found = _memory_cgroup()
    if found is None:
        return None
    root, d, limit, _ = found
    limits = [_read_bytes(p / limit) for p in (d, *d.parents) if p.is_relative_to(root)]
    known = [x for x in limits if x is not None]
    return min(known) if known else None


def cgroup_peak() -> int | None:
    """The kernel's count of the peak memory charged to this process's own capped cgroup
    (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``); None where the process is not
    in a cgroup with a cap of its own."""
    found = _memory_cgroup()
    if found is None:
        return None
    _, d, limit, peak = found
    return _read_bytes(d / peak) if _read_bytes(d / limit) is not None else None
