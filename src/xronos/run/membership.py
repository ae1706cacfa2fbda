"""A device that comes back: join requests in a run directory (the local launcher).

A device the run lost can be taken back while the run goes on. The operator (or the
emulation's ``--rejoin``) asks with ``xronos join RUN_DIR DEVICE``, which leaves a request
in the run directory; the launcher notices it within a fraction of a second, asks the
workers to stop after the step in flight (they write a checkpoint), and starts them again
on the devices it has plus the returning ones — profiled anew, planned anew, from that
checkpoint (:mod:`xronos.run.elastic`)::

    RUN_DIR/devices.json   {"devices": [...], "lost": ["slow"]}   what the launcher runs now
    RUN_DIR/join/slow      the request (removed once the device is back, or refused)

Only a device of the run's own cluster that was lost can join this way: the launcher knows
how to start and emulate it. Devices on other hosts join through torchrun's elastic
rendezvous instead (``--nnodes MIN:MAX``; see the deployment guide). There torchrun's agent
stops and starts the workers itself, and the coordinator must tell a restart of its job
from a new job: torchrun's restart count does not (a membership change — a device that
arrives — restarts the workers without counting), so the coordinator writes which agent
started the run (``RUN_DIR/torchrun-agent``) and continues the run whenever the same agent
starts it again (:func:`restarted_by_agent`).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xronos.errors import UserError
from xronos.run.monitor import RunMonitor
from xronos.utils import atomic_write_text

JOIN_DIR = "join"
AGENT_FILE = "torchrun-agent"


def read_devices(run_dir: Path) -> dict[str, Any]:
    """The run's ``devices.json`` (``{}`` when there is none yet)."""
    path = run_dir / "devices.json"
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable ({e})") from None


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def request_join(run_dir: str | Path, device: str) -> Path:
    """Ask the launcher of the run in ``run_dir`` to take ``device`` back; the request's
    path. Raises UserError (one line) when no run is going on there or the run did not
    lose that device."""
    run = Path(run_dir)
    if not (run / "config.json").is_file():
        raise UserError(f"{run}: not a run directory (no config.json)")
    table = read_devices(run)
    rows = table.get("devices", [])
    if not any(_alive(r.get("pid")) for r in rows):
        raise UserError(
            f"{run}: no run is going on there (its workers have exited); continue it on "
            f"every device of its cluster with: xronos finetune --resume {run}"
        )
    lost = [str(x) for x in table.get("lost", [])]
    if any(r.get("name") == device for r in rows):
        raise UserError(f"{run}: device {device!r} is already training in this run")
    if device not in lost:
        known = ", ".join(repr(x) for x in lost) or "none"
        raise UserError(
            f"{run}: the run did not lose a device {device!r} (lost: {known}); only a "
            "device it lost can join it"
        )
    path = run / JOIN_DIR / device
    path.parent.mkdir(exist_ok=True)
    atomic_write_text(path, device + "\n")
    return path


class JoinWatch:
    """The launcher's side: which lost devices asked to come back."""

    def __init__(self, run_dir: Path, say: Callable[[str], None]) -> None:
        self.dir, self.say = run_dir / JOIN_DIR, say
        self.lost: list[str] = []
        """Devices lost so far and not back (the order they were lost)."""
        self.asked = False
        """:meth:`ask` said to stop the workers (cleared by the launcher at each start)."""
        if self.dir.is_dir():  # left by an earlier launch of this run directory: stale
            for old in self.dir.iterdir():
                old.unlink(missing_ok=True)

    def requests(self) -> list[str]:
        """The lost devices that asked to come back (cheap: one directory listing). A
        request for a device that is not lost is dropped with one line."""
        try:
            names = sorted(p.name for p in self.dir.iterdir() if not p.name.startswith("."))
        except FileNotFoundError:
            return []
        wanted = []
        for name in names:
            if name in self.lost:
                wanted.append(name)
            else:
                self.say(f"join request for {name!r} ignored: it is not a device this run lost")
                (self.dir / name).unlink(missing_ok=True)
        return wanted

    def ask(self) -> bool:
        """Whether to stop the workers now to take a device back (then :attr:`asked`)."""
        if self.lost and self.requests():
            self.asked = True
        return self.asked

    def take(self) -> list[str]:
        """The devices coming back now (in the order they were lost); their requests are
        removed."""
        back = [d for d in self.lost if d in self.requests()]
        for name in back:
            (self.dir / name).unlink(missing_ok=True)
            self.lost.remove(name)
        return back


def restart_events(monitor: RunMonitor, run_dir: Path, devices: list[str], step: int) -> None:
    """A job that torchrun restarted (elastic rendezvous) and that resumes ``run_dir`` from
    the checkpoint of ``step`` on ``devices``: ``device_lost`` for each device of the run's
    last plan that is not among them, ``device_joined`` for each one that is new, and
    ``resumed`` once the new plan is made — the events ``xronos finetune`` writes."""
    try:
        before = [str(d) for d in json.loads((run_dir / "plan.json").read_text())["devices"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        before = []
    done = [r["step"] for r in _rows(run_dir / "metrics.jsonl") if "loss" in r]
    monitor.last_step = max(done, default=step)
    for name in before:
        if name not in devices:
            monitor.lost(name, before.index(name), "left the torchrun job")
    for name in devices:
        if before and name not in before:
            monitor.event("device_joined", step, device=name)
    monitor.resuming(step, monitor.last_step)


def torchrun_agent() -> str:
    """Which torchrun agent started this worker: its host, the job's rendezvous id, and the
    agent's process id and start time (its parent's: the agent starts the worker). The same
    for every restart of the workers of one torchrun job, whatever caused it; another for a
    new ``torchrun`` command, even with the same rendezvous id."""
    parent = os.getppid()
    try:  # the start time makes a reused process id another agent
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"{socket.gethostname()} {run_id} {parent} {started}"


def restarted_by_agent(run_dir: Path, agent: str) -> bool:
    """Whether ``agent`` (:func:`torchrun_agent`) is the one that started the run in
    ``run_dir`` (:func:`record_agent`): then torchrun restarted this run's workers."""
    try:
        return (run_dir / AGENT_FILE).read_text().strip() == agent
    except OSError:
        return False


def record_agent(run_dir: Path, agent: str) -> None:
    """Write which torchrun agent runs the job in ``run_dir`` (see :func:`restarted_by_agent`)."""
    atomic_write_text(run_dir / AGENT_FILE, agent + "\n")


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by the crash that restarted the job
    return rows
