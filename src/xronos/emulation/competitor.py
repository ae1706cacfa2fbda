"""A competing load: the smooth way to make a CPU slower.

A CFS quota makes a device slow in bursts: at 40 % of a 10 ms period the device runs 4 ms at
full speed and is then frozen for 6 ms, so a message that arrives in the frozen part waits
for it, and every tensor-parallel barrier pays the wait (measured: ~5 ms per all-reduce on
the 0.4 device of ``ci-2dev``). Shorter periods are not enforced as written (the kernel
accounts the quota at tick granularity), and CFS weights against an ordinary busy process
leave a woken worker waiting up to a 4 ms tick behind the competitor.

Here one helper process per CPU of a slow device runs as a real-time (``SCHED_FIFO``) task
pinned to that CPU: in every :data:`PERIOD_S` it spins for ``(1 - speed)`` of the period and
sleeps for the rest (absolute deadlines, so it does not drift). A real-time task preempts
the device's threads the moment it wakes and gives the CPU back the moment it sleeps, so the
device gets ``speed`` of its CPU at millisecond granularity, and a message never waits more
than one busy slice (0.6 ms at speed 0.4). The device itself stays a cgroup (CPU set + CPU
controller, no quota): a program started inside it shares the device's remaining time, as
on a real device. The helper needs the right to use ``SCHED_FIFO`` (root, outside any cgroup
with no real-time budget: where the kernel schedules real-time tasks by group on cgroup v2,
only the root cgroup has one, and the helper moves there); :func:`available` checks that,
and the emulator falls back to a CFS quota where it is missing. The kernel keeps 5 % of
every CPU for ordinary tasks, so speeds below :data:`MIN_SPEED` cannot be made this way.

The helper leaves its CPU when told to stop (SIGTERM/SIGINT) and when the process that
started it is gone. This file runs as a script and imports only the standard library.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

MECHANISM = "competing load"
"""The mechanism's name in reports and ``bench.json``."""
PERIOD_S = 0.001
"""Length of one busy + idle cycle: 1 ms (measured on a 250 Hz kernel: speed 0.38 asked
0.40 before calibration; a woken thread waited at most 0.68 ms, against up to 6 ms frozen
under a 10 ms CFS quota)."""
MIN_SPEED = 0.08
"""The slowest speed made this way; the competitor must stay under the kernel's real-time
budget (95 % of each CPU)."""
CHECK_EVERY_S = 1.0
"""How often the helper checks that the process that started it still exists."""
START_TIMEOUT_S = 10.0


def _spin(busy_s: float, period_s: float, owner: int) -> None:
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    clock = time.perf_counter
    edge = next_check = clock()
    while not stop:
        busy_until = edge + busy_s
        while clock() < busy_until:
            pass
        edge += period_s
        now = clock()
        if edge > now:
            time.sleep(edge - now)
        elif now - edge > period_s:  # fell behind (preempted by the kernel): resynchronise
            edge = now
        if now >= next_check:
            next_check = now + CHECK_EVERY_S
            if os.getppid() != owner:
                break


MOUNTS = "/proc/mounts"


def _become_realtime(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        # With real-time group scheduling on cgroup v2, only the root cgroup has real-time
        # time; a helper started in a child cgroup runs from the root where it may move.
        if not _join_v2_root():
            raise
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))


def _join_v2_root() -> bool:
    """Move this process into the root of the unified cgroup hierarchy; False where there
    is none or the move is refused."""
    try:
        with open(MOUNTS) as f:
            roots = [p[1] for p in map(str.split, f) if len(p) > 2 and p[2] == "cgroup2"]
        if not roots:
            return False
        with open(os.path.join(roots[0], "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
        return True
    except OSError:
        return False


def available() -> str | None:
    """None where a competitor can run on this host, else why not (one phrase)."""
    try:
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "check"],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot start the competing load: {e}"
    if done.returncode != 0:
        return done.stderr.strip() or f"competing load check exited {done.returncode}"
    return None


class Competitor:
    """Parent-side handle: one helper per CPU, each taking ``1 - speed`` of its CPU."""

    def __init__(self, cpus: Sequence[int], speed: float, period_s: float = PERIOD_S) -> None:
        if not MIN_SPEED <= speed < 1.0:
            raise ValueError(f"speed must be in [{MIN_SPEED}, 1), got {speed}")
        self.cpus, self.speed, self.period_s = tuple(cpus), speed, period_s
        busy, period, owner = repr((1.0 - speed) * period_s), repr(period_s), str(os.getpid())
        self.processes = [
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "run", str(cpu), busy, period, owner],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                close_fds=True,
            )
            for cpu in self.cpus
        ]
        for p in self.processes:  # each says "ready" once it is real-time on its CPU
            assert p.stdout is not None and p.stderr is not None
            if p.stdout.readline().strip() != "ready":
                why = p.stderr.read().strip()
                self.stop()
                raise OSError(why or "the competing load did not start")

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop every helper (idempotent)."""
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        for p in self.processes:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for stream in (p.stdout, p.stderr):
                with contextlib.suppress(OSError):
                    if stream is not None:
                        stream.close()


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["check"]:
            _become_realtime(sorted(os.sched_getaffinity(0))[0])
            return 0
        if len(argv) != 5 or argv[0] != "run":
            print("usage: competitor.py check | run CPU BUSY_S PERIOD_S OWNER_PID", file=sys.stderr)
            return 2
        _become_realtime(int(argv[1]))
    except OSError as e:
        why = e.strerror or e
        print(f"no real-time scheduling for the competing load ({why})", file=sys.stderr)
        return 1
    print("ready", flush=True)
    _spin(float(argv[2]), float(argv[3]), int(argv[4]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
