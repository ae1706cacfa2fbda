"""Record of what a run created, so that a crashed run's leftovers can be removed later.

Before an :class:`~xronos.emulation.limits.Emulator` creates anything it writes
``<state dir>/xronos-<run id>.json`` with its owner's pid (and that process's start time,
which tells a live owner from a reused pid) and every cgroup directory, namespace and link
it is about to create. Normal teardown deletes the file; :func:`cleanup_stale` removes the
resources of every file whose owner is gone.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xronos.emulation.cgroups import destroy_dirs
from xronos.emulation.netns import teardown_network
from xronos.utils import atomic_write_text

log = logging.getLogger(__name__)

PREFIX = "xronos-"


def default_state_dir() -> Path:
    """``/run/xronos`` for root, else ``$XDG_RUNTIME_DIR/xronos``, else a per-user temp dir."""
    if os.geteuid() == 0 and os.access("/run", os.W_OK):
        return Path("/run/xronos")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "xronos"
    return Path(tempfile.gettempdir()) / f"xronos-{os.getuid()}"


def process_start_time(pid: int) -> str | None:
    """Start time of a live process (clock ticks since boot), None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


@dataclass
class RunState:
    run_id: str
    owner_pid: int
    owner_start: str | None
    cgroup_dirs: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    def owner_alive(self) -> bool:
        start = process_start_time(self.owner_pid)
        return start is not None and start == self.owner_start

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> RunState:
        return cls(**json.loads(path.read_text()))

    def release(self, prefix: str = PREFIX) -> list[str]:
        """Remove every recorded resource that still exists; returns what failed. Only
        cgroup directories whose name starts with ``prefix`` are touched."""
        dirs = [Path(d) for d in self.cgroup_dirs if Path(d).name.startswith(prefix)]
        problems = destroy_dirs(dirs)
        if self.namespaces or self.links:
            problems += teardown_network(self.namespaces, self.links)
        return problems


def cleanup_stale(
    prefix: str = PREFIX, state_dir: str | os.PathLike[str] | None = None
) -> list[str]:
    """Remove cgroups, namespaces and links left by runs whose owner process has died
    (killed, crashed, power cut). Runs that are still alive are left alone.

    Returns one line per stale run cleaned up."""
    directory = Path(state_dir) if state_dir is not None else default_state_dir()
    if not directory.is_dir():
        return []
    cleaned: list[str] = []
    for path in sorted(directory.glob(f"{prefix}*.json")):
        try:
            state = RunState.load(path)
        except (OSError, ValueError, TypeError) as e:
            log.warning("skipping unreadable emulation state %s: %s", path, e)
            continue
        if state.owner_alive():
            continue
        problems = state.release(prefix)
        if problems:
            cleaned.append(f"run {state.run_id}: partly cleaned up: {'; '.join(problems)}")
            continue
        path.unlink(missing_ok=True)
        cleaned.append(
            f"run {state.run_id}: removed {len(state.cgroup_dirs)} cgroup dirs, "
            f"{len(state.namespaces)} namespaces (owner pid {state.owner_pid} is gone)"
        )
    return cleaned
