"""``--disturb``'s program follows its device: started again inside the device's new limits
when the run starts a new worker there, ended when the run loses the device."""

from __future__ import annotations

import json
import os
from pathlib import Path

from xronos.run.scripted import Disturb


def _devices(run: Path, pid: int, lost: list[str]) -> None:
    cpu = min(os.sched_getaffinity(0))
    row = {"name": "slow", "rank": 1, "pid": pid, "cpus": [cpu], "cgroups": []}
    (run / "devices.json").write_text(json.dumps({"devices": [row], "lost": lost}))


def test_the_other_program_follows_its_device_across_a_restart(tmp_path: Path) -> None:
    said: list[str] = []
    disturb = Disturb(tmp_path, "slow", 3, said.append)
    try:
        _devices(tmp_path, 1000, [])
        disturb.follow()  # not started yet: nothing to follow
        assert not disturb.intruder.alive
        disturb.on_step(3)
        first = disturb.intruder.proc
        assert first is not None and disturb.intruder.alive and disturb.worker == 1000
        disturb.follow()  # the same worker: nothing to do
        assert disturb.intruder.proc is first
        # the run starts again: the old limits went with the program, a new worker runs
        first.kill()
        first.wait()
        _devices(tmp_path, 1001, [])
        disturb.follow()
        again = disturb.intruder.proc
        assert again is not None and again is not first and disturb.intruder.alive
        assert disturb.worker == 1001 and "new worker" in said[-1]
        # the device is lost (switched off): its program ends, and stays ended
        _devices(tmp_path, 1001, ["slow"])
        disturb.follow()
        assert not disturb.intruder.alive
        _devices(tmp_path, 1002, [])
        disturb.follow()
        assert not disturb.intruder.alive
    finally:
        disturb.intruder.stop()
