"""Another program on a device: a CPU-bound process that joins the device's cgroups and
CPU set at a given step, as when the owner of a laptop opens something else
(``xronos finetune --disturb DEVICE@STEP``). It shares the device with the worker until the
run ends. The device's cgroups and CPUs come from the run's ``devices.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from xronos.errors import UserError

BUSY = "while True: pass"


class Intruder:
    """Starts the program when the run reaches ``step`` (:meth:`on_step`)."""

    def __init__(
        self, run_dir: str | Path, device: str, step: int, say: Callable[[str], None] = print
    ) -> None:
        self.run_dir, self.device, self.step, self.say = Path(run_dir), device, step, say
        self.proc: subprocess.Popen[bytes] | None = None

    def on_step(self, step: int) -> None:
        if self.proc is None and step >= self.step:
            self.start(step)

    def start(self, step: int) -> None:
        entry = self._entry()
        self.proc = subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True)
        pid = self.proc.pid
        if entry.get("cpus"):
            os.sched_setaffinity(pid, entry["cpus"])
        for cg in entry.get("cgroups", []):
            (Path(cg) / "cgroup.procs").write_text(f"{pid}\n")
        where = f"CPUs {entry.get('cpus')}" + (" and its cgroups" if entry.get("cgroups") else "")
        self.say(f"step {step}: another program (pid {pid}) now runs on '{self.device}' ({where})")

    def _entry(self) -> dict[str, list]:
        path = self.run_dir / "devices.json"
        devices = json.loads(path.read_text())["devices"] if path.is_file() else []
        for d in devices:
            if d.get("name") == self.device:
                return d  # type: ignore[no-any-return]
        raise UserError(f"--disturb: device {self.device!r} is not in {path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
