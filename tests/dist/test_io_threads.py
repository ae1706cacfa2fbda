"""Gloo's I/O threads run in SCHED_IDLE on every worker, for the world group and for every
group made later, and collectives still deliver the right sums through them; when another
program takes a device's CPU, they go back to the normal class (the guard's behaviour is
tests/e2e/test_rebalance.py's: without it that run outlasts its timeout)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests.dist.world import WorkerContext, run_world
from xronos.comm.groups import new_group
from xronos.comm.iothreads import IO_THREAD, starved, window_deltas


def _io_policies() -> list[int]:
    out = []
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == IO_THREAD:
                out.append(os.sched_getscheduler(int(task.name)))
        except OSError:
            continue
    return out


def _check(ctx: WorkerContext, _: Any) -> dict[str, Any]:
    world = _io_policies()
    pg = new_group(range(ctx.world_size), 30.0)
    after = _io_policies()
    x = torch.full((1000,), float(ctx.rank + 1))
    torch.distributed.all_reduce(x, group=pg)
    return {"world": world, "after": after, "sum": x.unique().tolist()}


def test_gloo_io_threads_are_demoted_and_collectives_work() -> None:
    results = run_world(_check, 2)
    for r in results:
        assert r["world"], "the world group's I/O thread was not found by its name"
        assert set(r["world"]) == {os.SCHED_IDLE}
        # a new group brings a new I/O thread, which is demoted as well
        assert len(r["after"]) > len(r["world"])
        assert set(r["after"]) == {os.SCHED_IDLE}
        assert r["sum"] == [3.0]


def test_a_slower_cpu_is_not_another_program() -> None:
    window = 20_000_000
    # an I/O thread waiting 92 % of a window behind a competing load, nothing of ours running
    assert not starved(int(0.92 * window), 0, window)
    # waiting the whole window while our threads compute: our own work, not another program
    assert not starved(window, window, window)
    assert starved(window, 0, window)


def test_a_window_counts_our_other_threads_and_the_longest_io_wait() -> None:
    ms = 1_000_000
    # thread 7 waited 40 ms for the CPU and ran 5 ms; thread 9 appeared during the window
    # (its whole life counts: 12 ms waiting, 3 ms running); the process's threads other
    # than the guard used 100 ms of CPU, so ours ran 100 - 5 - 3 ms
    last = ({7: (20 * ms, 10 * ms)}, 500 * ms)
    now = ({7: (25 * ms, 50 * ms), 9: (3 * ms, 12 * ms)}, 600 * ms)
    assert window_deltas(last, now) == (40 * ms, 92 * ms)
    # a thread that ended is left out of both terms (its run stays in the process's)
    assert window_deltas(now, ({9: (3 * ms, 12 * ms)}, 600 * ms)) == (0, 0)
