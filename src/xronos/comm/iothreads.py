"""The scheduling class of gloo's I/O threads.

Every gloo process group runs a thread of its own, ``gloo_tcp_loop``, that waits on the
group's sockets with ``epoll`` and moves the bytes of messages in flight. While an
operation is in flight it comes back to ``epoll_wait`` again and again, using CPU. On a
device whose CPUs are all busy -- one CPU and one compute thread, the common case of the
emulated devices and of small boards -- it then competes with the thread that runs the
step. A kernel that does not preempt a running thread when another wakes
(``PREEMPT_NONE``, the usual server setting) lets the loop thread run to the end of its
tick, 4 ms at 250 Hz, before the step thread, woken because its data has arrived, gets the
CPU back. Measured on two one-CPU devices: a 512 KB all-reduce took a median 3.5 ms
(p90 4.0 ms); with the loop threads in ``SCHED_IDLE`` 0.35 ms (p99 0.5 ms), and a
point-to-point exchange 4.0 ms against 0.15 ms.

``SCHED_IDLE`` gives a thread the CPU only when no other thread on that CPU wants it. The
loop thread is needed exactly when the step thread is blocked waiting for a message. Data
that arrives while the step thread computes waits in the kernel's socket buffers, and
every send starts from the sending thread itself. Lowering one's own threads' priority
needs no privilege.

The catch: another program busy on the same CPU would get the CPU instead of the loop
thread, and the device's messages would crawl (a ``--disturb`` program made a 110-step
test run for minutes). A guard thread therefore watches the loop threads' scheduling
statistics; when they wait for the CPU through :data:`GUARD_WINDOWS` windows in a row
while this process's other threads hardly run -- the CPU is going to another program --
it puts them back to the normal class for the rest of the process, as before. The
training loop reports that once per device (``io_threads_restored`` in ``metrics.jsonl``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

IO_THREAD = "gloo_tcp_loop"
GUARD_THREAD = "xronos-io-guard"
GUARD_WINDOW_S = 0.25
"""How often the guard samples the I/O threads' scheduling statistics. Each wake-up costs
its device the sample and the caches it disturbs: sampling every thread of the process
every 50 ms took 0.8 % of each ``ci-2dev`` device's time (0.9 s of CPU in a 107 s run);
every 250 ms, reading only the I/O threads, it reacts to another program within half a
second."""
STARVED = 0.95
"""A window in which a loop thread waited for the CPU at least this share of the time is
a starved one. A competing load emulating a slow device takes up to ``1 − speed`` of the
CPU (at most 0.92): that is a slower device, not another program."""
OURS_IDLE = 0.2
"""...while this process's other threads ran less than this share of it."""
GUARD_WINDOWS = 2
"""Starved windows in a row before the loop threads go back to the normal class."""

_TASKS = Path("/proc/self/task")
_state = {"guarding": False, "restored": False}
_DEMOTED: set[int] = set()
"""The I/O threads this process has put in ``SCHED_IDLE`` (their ids), which the guard
watches."""


def demote_io_threads() -> int:
    """Put this process's gloo I/O threads not yet demoted into ``SCHED_IDLE`` and start
    the guard (once); returns how many threads it moved. Threads that end or refuse are
    skipped; after the guard has restored the normal class, nothing is moved. Only where
    the guard can watch (Linux with per-thread scheduling statistics); elsewhere 0."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None or _state["restored"] or not _watchable():
        return 0
    moved = 0
    for tid in _io_threads():
        try:
            if os.sched_getscheduler(tid) != policy:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
                moved += 1
            _DEMOTED.add(tid)
        except OSError:  # the thread ended, or the system refused: leave it as it is
            continue
    if moved and not _state["guarding"]:
        _state["guarding"] = True
        threading.Thread(target=_guard, name=GUARD_THREAD, daemon=True).start()
    return moved


def _watchable() -> bool:
    """Whether this system gives each thread's scheduling statistics (the guard's input)."""
    try:
        (_TASKS / str(threading.get_native_id()) / "schedstat").read_text()
    except OSError:
        return False
    return True


def restored() -> bool:
    """Whether the guard has put the I/O threads back to the normal class."""
    return _state["restored"]


def restore_io_threads() -> None:
    """Every gloo I/O thread of this process back to the normal class, for good."""
    _state["restored"] = True
    for tid in _io_threads():
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            continue


def _io_threads() -> list[int]:
    out = []
    for task in _TASKS.iterdir():
        try:
            if (task / "comm").read_text().strip() == IO_THREAD:
                out.append(int(task.name))
        except OSError:  # the thread ended
            continue
    return out


def _sample() -> tuple[dict[int, tuple[int, int]], int]:
    """Each demoted I/O thread's (run, wait for the CPU) and the CPU time of this process's
    other threads (the guard's own left out), in nanoseconds since each started: a few small
    reads, so the guard costs its device next to nothing."""
    io: dict[int, tuple[int, int]] = {}
    for tid in tuple(_DEMOTED):
        try:
            run_ns, wait_ns, _ = (
                int(v) for v in (_TASKS / str(tid) / "schedstat").read_text().split()
            )
        except (OSError, ValueError):  # the thread ended: its id may be reused
            _DEMOTED.discard(tid)
            continue
        io[tid] = (run_ns, wait_ns)
    process = time.clock_gettime_ns(time.CLOCK_PROCESS_CPUTIME_ID)
    return io, process - time.thread_time_ns()


def window_deltas(
    last: tuple[dict[int, tuple[int, int]], int], now: tuple[dict[int, tuple[int, int]], int]
) -> tuple[int, int]:
    """(largest wait for the CPU of any I/O thread, run time of our other threads) between
    two samples; a thread new in ``now`` counts from its start."""
    d_wait, d_io_run = 0, 0
    for tid, (run_ns, wait_ns) in now[0].items():
        run_0, wait_0 = last[0].get(tid, (0, 0))
        d_wait = max(d_wait, wait_ns - wait_0)
        d_io_run += run_ns - run_0
    return d_wait, now[1] - last[1] - d_io_run


def starved(d_wait_ns: int, d_ours_ns: int, window_ns: int) -> bool:
    """Whether one window looks like another program holding the CPU while an I/O thread
    waits for it."""
    return d_wait_ns >= STARVED * window_ns and d_ours_ns < OURS_IDLE * window_ns


def _guard() -> None:
    last, t_last = _sample(), time.monotonic_ns()
    run = 0
    while not _state["restored"]:
        time.sleep(GUARD_WINDOW_S)
        now, t_now = _sample(), time.monotonic_ns()
        run = run + 1 if starved(*window_deltas(last, now), t_now - t_last) else 0
        last, t_last = now, t_now
        if run >= GUARD_WINDOWS:
            restore_io_threads()
