"""Run a worker function on an emulated (or real, local) cluster: limits, launch, teardown."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from xronos.comm.launch import WorkerFn, launch
from xronos.emulation import ClusterSpec, Emulator
from xronos.emulation.competitor import PERIOD_S as LOAD_PERIOD_S
from xronos.emulation.limits import Mechanism
from xronos.emulation.netns import BUCKET_S
from xronos.emulation.slot import assign_cpus, cpu_sharers
from xronos.errors import UserError
from xronos.utils import atomic_write_text

DEFAULT_CPU_PERIOD_US = 10_000
CPU_LIMITS = ("auto", "load", "quota", "duty-cycle")
"""``--cpu-limit`` choices; ``quota`` is the emulator's ``cgroup`` mechanism."""
"""CFS period of an emulated device's CPU quota (see the emulation docs for why 10 ms)."""


def fastest_device(cluster: ClusterSpec) -> int:
    """The index of the device that runs ``single``: the largest compute capacity (cores ×
    CPU quota) of the spec, the first one on a tie."""
    caps = [d.capacity for d in cluster.devices]
    return caps.index(max(caps))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measurement_context(
    cluster: ClusterSpec,
    *,
    emulate: bool,
    cpu_period_us: int,
    cpu_limit: str = "auto",
    network: bool | None = None,
) -> list[dict[str, Any]]:
    """Per device, everything besides the workload that changes what profiling measures:
    its spec (cores, quota, memory, link), the Xronos version, whether and how it is
    emulated (CPU limit and period), the host's CPU model and which other devices share its CPUs.
    A profile is only reused under the same context (it goes into the cache key).

    ``network`` as :func:`run_on_cluster` takes it: where the links are not emulated
    (``False``, or no device emulation) every device's link is loopback, whatever the
    cluster declares, so that a profile measured over loopback is never reused for the
    declared links, nor the other way round."""
    from xronos import __version__

    links = emulate and (cluster.has_links if network is None else network)

    cpus = assign_cpus(
        [d.cores for d in cluster.devices],
        [d.cpu_quota for d in cluster.devices],
        sorted(os.sched_getaffinity(0)),
    )
    out = []
    for d, others in zip(cluster.devices, cpu_sharers(cpus), strict=True):
        sharing = [cluster.devices[j].name for j in others]
        spec = d.to_dict() if links else {**d.to_dict(), "bandwidth_bps": None, "latency_s": None}
        out.append(
            {
                **spec,
                "xronos": __version__,
                "emulated": emulate,
                "cpu_period_us": cpu_period_us if emulate else None,
                "cpu_limit": cpu_limit if emulate else None,
                # the competing load's own period (``cpu_period_us`` is a quota's)
                "load_period_us": round(LOAD_PERIOD_S * 1e6) if emulate else None,
                "cpu_model": _cpu_model(),
                "shares_cpus_with": sorted(sharing) if emulate else [],
                # a shaped link's bucket decides what a message costs (earlier: 2 ms)
                "link_bucket_s": BUCKET_S if spec["bandwidth_bps"] is not None else None,
            }
        )
    return out


def new_run_id(prefix: str = "run") -> str:
    return f"{prefix}-{os.getpid()}-{int(time.time() * 1000) % 10**8}"


def run_on_cluster(
    fn: WorkerFn,
    args: Sequence[Any],
    cluster: ClusterSpec,
    *,
    emulate: bool = True,
    network: bool | None = None,
    timeout_s: float = 300.0,
    cpu_period_us: int = DEFAULT_CPU_PERIOD_US,
    cpu_limit: str = "auto",
    on_event: Callable[[int, dict[str, Any]], None] | None = None,
    stop_signal: int | None = None,
    stop_when: Callable[[], bool] | None = None,
    report: Callable[[str], None] | None = None,
    emulation: dict[str, Any] | None = None,
    devices_file: Path | None = None,
    lost: Sequence[str] = (),
) -> list[Any]:
    """``fn(ctx, args[rank])`` on one process per device of ``cluster``.

    With ``emulate`` each worker runs inside its device's limits (cgroups, or the
    duty-cycle fallback); the emulator's report is passed to ``report`` line by line, and
    what it measured (each device's effective speed) is stored in ``emulation`` when given.
    All emulation state is removed on every exit path.

    ``network``: True emulates every device's link (namespaces, ``tc``; latency by netem
    or the communication layer); None does so when the cluster declares links; False
    talks over loopback. Where namespaces cannot be made, rate and latency are emulated in
    the communication layer instead (reported).
    ``devices_file`` (a run's ``devices.json``) lists, for operators and for tests that
    load or kill a device from outside, each device's name, rank, worker pid, CPUs and
    cgroup directories (empty when not emulated), and under ``lost`` the devices the run
    lost (that ``xronos join`` may bring back); it is rewritten as each worker starts.
    ``stop_signal`` and ``stop_when``: see :func:`xronos.comm.launch.launch`.
    """
    devices = [d.name for d in cluster.devices]
    say = report or (lambda line: print(line, file=sys.stderr))
    table = DevicesFile(devices_file, devices, lost)
    if not emulate:
        if network:
            raise UserError(
                "network emulation needs device emulation; turn emulation on, or drop "
                "--bandwidth/--latency/--network"
            )
        if cluster.has_links:
            say("network: not emulated (device emulation is off); declared links ignored")
        return launch(
            fn,
            args,
            devices,
            timeout_s=timeout_s,
            on_start=table.started,
            on_event=on_event,
            stop_signal=stop_signal,
            stop_when=stop_when,
        )
    wanted = cluster.has_links if network is None else network
    with Emulator(
        cluster,
        new_run_id(),
        network=wanted,
        require_network=bool(network),
        comm_fallback=True,
        period_us=cpu_period_us,
        mechanism="cgroup" if cpu_limit == "quota" else cast(Mechanism, cpu_limit),
    ) as emu:
        for line in emu.report():
            say(line)
        if emulation is not None:
            emulation["speeds"] = [s.to_dict() for s in emu.speeds]
            emulation["effective_speed"] = emu.effective_speeds()
            emulation["links"] = emu.links.in_force(cluster)
        host = emu.bridge_ip or "127.0.0.1"
        # a worker forked from a server with torch loaded would not be charged for
        # torch's pages: under a memory cap each imports it itself, as a real device does
        capped = any(d.memory_bytes for d in cluster.devices)
        return launch(
            fn,
            args,
            devices,
            forked=not capped,
            slots=[emu.slot(r) for r in range(cluster.world_size)],
            timeout_s=timeout_s,
            host=host,
            on_start=table.watching(emu),
            on_event=on_event,
            stop_signal=stop_signal,
            stop_when=stop_when,
            latency_s=emu.comm_latencies(),
            bandwidth_bps=emu.links.comm_bandwidths(),
        )


class DevicesFile:
    """``devices.json``: ``{"devices": [{"name", "rank", "pid", "cpus", "cgroups"}, …],
    "lost": [names]}``, written atomically each time a worker starts (nothing when no path
    is given)."""

    def __init__(self, path: Path | None, names: Sequence[str], lost: Sequence[str] = ()) -> None:
        self.path, self.lost = path, list(lost)
        self.rows: list[dict[str, Any]] = [
            {"name": n, "rank": r, "pid": None, "cpus": [], "cgroups": []}
            for r, n in enumerate(names)
        ]

    def started(self, rank: int, pid: int) -> None:
        self.rows[rank]["pid"] = pid
        if not self.rows[rank]["cpus"]:
            self.rows[rank]["cpus"] = sorted(os.sched_getaffinity(pid))
        self._write()

    def watching(self, emu: Emulator) -> Callable[[int, int], None]:
        """``on_start`` for an emulated run: join the device's limits, then record it."""

        def on_start(rank: int, pid: int) -> None:
            emu.attach(rank, pid)
            group = emu.groups[rank]
            self.rows[rank]["cpus"] = list(emu.cpus[rank])
            self.rows[rank]["cgroups"] = [str(d) for d in group.dirs] if group else []
            self.started(rank, pid)

        return on_start

    def _write(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(
                self.path, json.dumps({"devices": self.rows, "lost": self.lost}, indent=2)
            )
