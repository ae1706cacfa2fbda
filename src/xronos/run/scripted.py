"""What the devices' owners do during an emulated run, at given steps: ``--disturb``
(another program starts on a device; one program per item of its comma-separated list, so
``slow@16,slow@16`` starts two on one device), ``--leave`` (a device is switched off: its
worker is killed with SIGKILL) and ``--rejoin`` (a lost device comes back, as ``xronos
join`` asks).
Each acts from outside the workers, as its real counterpart would, through the run's
``devices.json``; each acts once. A program started by ``--disturb`` follows its device
when the run starts its workers again (new limits, a new worker): within
:data:`FOLLOW_S` of the new worker's start, before it profiles the device.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xronos.emulation.intruder import Intruder
from xronos.errors import UserError
from xronos.run.membership import read_devices, request_join
from xronos.runconfig import RunConfig

FOLLOW_S = 0.05
"""How often a started ``--disturb`` program checks that its device's worker is the same."""


def parse_at(flag: str, text: str, devices: list[str]) -> tuple[str, int]:
    """``DEVICE@STEP`` (e.g. ``slow@40``), or one line naming the mistake."""
    name, _, step = text.partition("@")
    if not step.isdigit() or int(step) < 1:
        raise UserError(f"{flag} {text!r}: give DEVICE@STEP, e.g. slow@40")
    if name not in devices:
        raise UserError(
            f"{flag} {text!r}: no device {name!r}; the cluster has {', '.join(devices)}"
        )
    return name, int(step)


def parse_list(flag: str, text: str | None) -> list[str]:
    """The items of a comma-separated ``DEVICE@STEP,...`` (none for None), or one line
    naming an empty item."""
    if not text:
        return []
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise UserError(f"{flag} {text!r}: an empty item; give DEVICE@STEP[,DEVICE@STEP...]")
    return items


class AtStep:
    """Something done once, from the first step report at or after ``step``."""

    def __init__(self, run_dir: Path, device: str, step: int, say: Callable[[str], None]) -> None:
        self.run_dir, self.device, self.step, self.say = run_dir, device, step, say
        self.done = False

    def on_step(self, step: int) -> None:
        if not self.done and step >= self.step:
            self.done = self.act(step)

    def act(self, step: int) -> bool:
        """Do it; whether it was done (False: try again at the next step)."""
        raise NotImplementedError

    def running(self, table: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The device's row of ``devices.json`` (``table``: as already read) while its
        worker runs, else None."""
        table = read_devices(self.run_dir) if table is None else table
        for row in table.get("devices", []):
            if row.get("name") == self.device and isinstance(row.get("pid"), int):
                return row  # type: ignore[no-any-return]
        return None


class Disturb(AtStep):
    """Starts another program on the device (:class:`~xronos.emulation.intruder.Intruder`)."""

    def __init__(self, run_dir: Path, device: str, step: int, say: Callable[[str], None]) -> None:
        super().__init__(run_dir, device, step, say)
        self.intruder = Intruder(device, say)
        self.worker: int | None = None
        """The device's worker when the program last started."""
        self.off = False

    def act(self, step: int) -> bool:
        row = self.running()
        if row is None:
            return False
        self.intruder.start(f"step {step}", row.get("cpus", []), row.get("cgroups", []))
        self.worker = row["pid"]
        return True

    def follow(self) -> None:
        """Once started: when the device runs a new worker (the run started again, its
        limits made anew, the program killed with the old ones), start the program again
        inside the new limits; when the run loses the device, end it for good."""
        if not self.done or self.off:
            return
        table = read_devices(self.run_dir)
        if self.device in table.get("lost", []):
            self.off = True  # switched off or lost: its programs end with it
            self.intruder.stop()
            return
        row = self.running(table)
        if row is None or row["pid"] == self.worker:
            return
        self.worker = row["pid"]
        self.intruder.stop()  # where the old limits did not take it with them
        cpus, cgroups = row.get("cpus", []), row.get("cgroups", [])
        self.intruder.start("new worker, the same device", cpus, cgroups)


class Leave(AtStep):
    """Kills the device's worker (SIGKILL), as a power cut would."""

    def act(self, step: int) -> bool:
        row = self.running()
        if row is None:
            return False
        self.say(f"step {step}: '{self.device}' switched off (worker {row['pid']} killed)")
        with contextlib.suppress(ProcessLookupError):  # it died by itself
            os.kill(row["pid"], signal.SIGKILL)
        return True


class Rejoin(AtStep):
    """Asks for the device back, once the run has lost it."""

    def act(self, step: int) -> bool:
        if self.device not in read_devices(self.run_dir).get("lost", []):
            return False
        request_join(self.run_dir, self.device)
        self.say(f"step {step}: '{self.device}' is back and asks to join")
        return True


class Script:
    """The scripted happenings of a run (``on_step`` for the monitor's step hooks)."""

    def __init__(
        self, cfg: RunConfig, run_dir: Path, devices: list[str], say: Callable[[str], None]
    ):
        self.hooks: list[Callable[[int], None]] = []
        self.disturb = [
            Disturb(run_dir, *parse_at("--disturb", item, devices), say)
            for item in parse_list("--disturb", cfg.disturb)
        ]
        self.hooks += [d.on_step for d in self.disturb]
        if cfg.leave:
            self.hooks.append(Leave(run_dir, *parse_at("--leave", cfg.leave, devices), say).on_step)
        if cfg.rejoin:
            if not cfg.elastic:
                raise UserError("--rejoin needs an elastic run; drop --no-elastic")
            name, step = parse_at("--rejoin", cfg.rejoin, devices)
            self.hooks.append(Rejoin(run_dir, name, step, say).on_step)

        self._halt = threading.Event()
        self._follower: threading.Thread | None = None
        if self.disturb:
            self._follower = threading.Thread(target=self._follow, daemon=True)
            self._follower.start()

    def _follow(self) -> None:
        while not self._halt.wait(FOLLOW_S):
            for d in self.disturb:
                with contextlib.suppress(OSError):  # a worker that ended meanwhile
                    d.follow()

    def on_step(self, step: int) -> None:
        for hook in self.hooks:
            hook(step)

    def stop(self) -> None:
        self._halt.set()
        if self._follower is not None:
            self._follower.join()
        for d in self.disturb:
            d.intruder.stop()
