"""The duty-cycle fallback: a helper process SIGSTOPs/SIGCONTs a worker to give it a share of
its CPU where cgroups cannot be written. Runs without root too (the busy child then keeps
nice 0 and competes with other load, which only lowers its share)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from xronos.emulation import ClusterSpec, DeviceSlot, DeviceSpec, Emulator
from xronos.emulation.dutycycle import DutyCycle

SPAWN = mp.get_context("spawn")


def busy_child(slot: DeviceSlot, seconds: float, out: Any) -> None:
    # nice -20 (root only) makes the share depend on the throttle, not on other host load.
    with contextlib.suppress(PermissionError):
        os.nice(-20)
    slot.enter(configure_torch=False)
    wall0, cpu0 = time.monotonic(), time.process_time()
    while time.monotonic() - wall0 < seconds:
        pass
    out.put((time.process_time() - cpu0, time.monotonic() - wall0))


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
def test_duty_cycle_limits_a_busy_workers_cpu_share(tmp_path: Path) -> None:
    cluster = ClusterSpec("c", (DeviceSpec("pi", 1, 0.3),))
    out = SPAWN.Queue()
    with Emulator(
        cluster,
        f"t{uuid.uuid4().hex[:8]}",
        mechanism="duty-cycle",
        state_dir=tmp_path,
        check_speed=False,  # the duty is the spec's, not a calibrated one
    ) as emu:
        assert emu.cpu_mechanism == ["duty-cycle"]
        report = emu.report()
        proc = SPAWN.Process(target=busy_child, args=(emu.slot(0), 0.6, out))
        proc.start()
        emu.attach(0, proc.pid)  # type: ignore[arg-type]
        helpers = len(emu._throttles.helpers)
        cpu, wall = out.get(timeout=60)
        proc.join(timeout=10)
    assert any(line.startswith("cpu limit: duty-cycle fallback") for line in report)
    assert any(line.startswith("memory cap: none requested") for line in report)
    # The helper runs the child 3 ms of every 10 ms. Its wake-ups are late by at most a
    # scheduler tick or so (it runs SCHED_FIFO where allowed), so the share may exceed 0.3 by a
    # few hundredths; 0.45 allows that and is still far below the 1.0 of an unthrottled loop.
    assert cpu / wall <= 0.45
    assert proc.exitcode == 0  # throttled, not left stopped: it finished its loop
    # one helper while attached, none after close
    assert helpers == 1 and emu._throttles.helpers == {}


def test_helper_always_leaves_its_target_running() -> None:
    target = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        helper = DutyCycle(target.pid, 0.2, 0.01)
        stopped_seen = False
        deadline = time.monotonic() + 10
        while not stopped_seen and time.monotonic() < deadline:
            stopped_seen = state_of(target.pid) == "T"
            time.sleep(0.001)
        assert stopped_seen, "the helper never stopped its target"
        # Even a helper killed outright (no chance to clean up) must not leave it stopped:
        # stop() continues the target itself.
        helper.process.send_signal(signal.SIGKILL)
        helper.process.wait(timeout=5)
        helper.stop()
        time.sleep(0.05)
        assert state_of(target.pid) in ("R", "S")
        # A helper asked to stop continues its target before it exits.
        helper = DutyCycle(target.pid, 0.2, 0.01)
        time.sleep(0.3)
        helper.process.terminate()
        assert helper.process.wait(timeout=5) == 0
        time.sleep(0.05)
        assert state_of(target.pid) in ("R", "S")
    finally:
        target.kill()
        target.wait()


def test_helper_exits_when_its_target_is_gone() -> None:
    target = subprocess.Popen(["sleep", "30"])
    helper = DutyCycle(target.pid, 0.5, 0.01)
    target.kill()
    target.wait()
    assert helper.process.wait(timeout=5) == 0
