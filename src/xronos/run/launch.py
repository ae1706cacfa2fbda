"""Run a worker function on an emulated (or real, local) cluster: limits, launch, teardown."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from xronos.comm.launch import WorkerFn, launch
from xronos.emulation import ClusterSpec, Emulator


def fastest_device(cluster: ClusterSpec) -> int:
    """The index of the device that runs ``single``: the largest compute capacity (cores ×
    CPU quota) of the spec, the first one on a tie."""
    caps = [d.capacity for d in cluster.devices]
    return caps.index(max(caps))


def new_run_id(prefix: str = "run") -> str:
    return f"{prefix}-{os.getpid()}-{int(time.time() * 1000) % 10**8}"


def run_on_cluster(
    fn: WorkerFn,
    args: Sequence[Any],
    cluster: ClusterSpec,
    *,
    emulate: bool = True,
    network: bool = False,
    timeout_s: float = 300.0,
    cpu_period_us: int = 10_000,
    on_event: Callable[[int, dict[str, Any]], None] | None = None,
    stop_signal: int | None = None,
    report: Callable[[str], None] | None = None,
) -> list[Any]:
    """``fn(ctx, args[rank])`` on one process per device of ``cluster``.

    With ``emulate`` each worker runs inside its device's limits (cgroups, or the
    duty-cycle fallback); the emulator's report is passed to ``report`` line by line.
    All emulation state is removed on every exit path.
    """
    devices = [d.name for d in cluster.devices]
    say = report or (lambda line: print(line, file=sys.stderr))
    if not emulate:
        return launch(
            fn, args, devices, timeout_s=timeout_s, on_event=on_event, stop_signal=stop_signal
        )
    with Emulator(cluster, new_run_id(), network=network, period_us=cpu_period_us) as emu:
        for line in emu.report():
            say(line)
        host = emu.bridge_ip if network and emu.bridge_ip else "127.0.0.1"
        return launch(
            fn,
            args,
            devices,
            slots=[emu.slot(r) for r in range(cluster.world_size)],
            timeout_s=timeout_s,
            host=host,
            on_start=emu.attach,
            on_event=on_event,
            stop_signal=stop_signal,
        )
