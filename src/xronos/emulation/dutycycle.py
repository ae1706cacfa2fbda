"""Software CPU throttle for hosts where cgroups cannot be written.

A helper *process* per throttled worker alternates ``SIGCONT`` (run for ``duty × period``)
and ``SIGSTOP`` (pause for the rest of the period), so the worker gets ``duty`` of the time
of its cores. A thread inside the worker could not do this: stopping the process stops the
thread too. This is coarser than a CFS quota (the whole process pauses at once, and the
helper's own wake-ups need a CPU), so it is always reported as a fallback.

The helper always leaves its target running: it sends ``SIGCONT`` when told to stop
(SIGTERM/SIGINT), when the target exits, and when the process that started it is gone.
This file runs as a script and imports only the standard library.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

CHECK_EVERY_S = 1.0
"""How often the helper checks that its target and its owner still exist."""


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks), or None for a process that
    is gone or a zombie; tells a live target from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)


def throttle(pid: int, duty: float, period_s: float, owner: int) -> None:
    """Run the duty cycle on ``pid`` until told to stop or until ``pid`` or ``owner`` is gone."""
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # Wake up on time even when the throttled workers keep every CPU busy.
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    born = _start_time(pid)
    run_s, pause_s = duty * period_s, (1.0 - duty) * period_s
    next_edge = next_check = time.monotonic()
    try:
        while not stop and born is not None:
            next_edge += run_s
            _sleep_until(next_edge)
            os.kill(pid, signal.SIGSTOP)
            next_edge += pause_s
            _sleep_until(next_edge)
            os.kill(pid, signal.SIGCONT)
            now = time.monotonic()
            if now - next_edge > period_s:  # fell behind (host overloaded): resynchronise
                next_edge = now
            if now >= next_check:
                next_check = now + CHECK_EVERY_S
                if _start_time(pid) != born or os.getppid() != owner:
                    break
    except ProcessLookupError:
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


class DutyCycle:
    """Parent-side handle of one helper process."""

    def __init__(self, pid: int, duty: float, period_s: float) -> None:
        if not 0 < duty < 1:
            raise ValueError(f"duty must be in (0, 1), got {duty}")
        self.pid = pid
        self.duty = duty
        self.period_s = period_s
        self.process = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                str(pid),
                repr(duty),
                repr(period_s),
                str(os.getpid()),
            ],
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the helper and make sure the worker is left running. Idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: dutycycle.py PID DUTY PERIOD_S OWNER_PID", file=sys.stderr)
        return 2
    throttle(int(argv[0]), float(argv[1]), float(argv[2]), int(argv[3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
