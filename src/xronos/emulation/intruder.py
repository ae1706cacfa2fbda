"""Another program on a device: a CPU-bound process that joins the device's cgroups and
CPU set at a given step, as when the owner of a laptop opens something else
(``xronos finetune --disturb DEVICE@STEP``). It shares the device with the worker until the
run ends; when the run starts its workers again (a lost device, one that comes back) the
device's limits are made anew and the program starts again inside them, as the owner's
program keeps running on a real device (:class:`xronos.run.scripted.Disturb`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

BUSY = "while True: pass"


class Intruder:
    """Starts the program on a device's CPUs and in its cgroups (:meth:`start`), and ends
    it (:meth:`stop`)."""

    def __init__(self, device: str, say: Callable[[str], None] = print) -> None:
        self.device, self.say = device, say
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, when: str, cpus: list[int], cgroups: list[str]) -> None:
        """Start it on ``cpus`` and in ``cgroups`` (the device's), saying so ``when``."""
        self.proc = subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True)
        pid = self.proc.pid
        if cpus:
            os.sched_setaffinity(pid, cpus)
        for cg in cgroups:
            (Path(cg) / "cgroup.procs").write_text(f"{pid}\n")
        where = f"CPUs {cpus}" + (" and its cgroups" if cgroups else "")
        self.say(f"{when}: another program (pid {pid}) now runs on '{self.device}' ({where})")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
