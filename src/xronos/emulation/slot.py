"""What a worker process needs to become its device: :class:`DeviceSlot`, and the choice of
host CPUs for each device."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

from xronos.emulation.netns import enter_namespace
from xronos.errors import WorkerError


@dataclass(frozen=True)
class DeviceSlot:
    """One device's limits, handed (pickled) to its worker, which calls :meth:`enter` first.

    Everything the worker does afterwards — its torch threads, gloo's communication threads,
    OpenMP pools — is born inside these limits and contends for the same CPU time, as on a
    real device."""

    rank: int
    device: str
    threads: int
    """Torch intra-op threads: the device's ``cores``."""
    cpus: tuple[int, ...]
    """Host CPUs the worker may run on."""
    cgroup_procs: tuple[str, ...] = ()
    """``cgroup.procs`` files to write the worker's pid to (empty without cgroups)."""
    netns: str | None = None
    """Network namespace to enter, or None to stay in the host's."""
    ip: str | None = None
    """The device's address inside its namespace (None without network emulation)."""
    ifname: str | None = None
    """The device's interface inside its namespace, for ``GLOO_SOCKET_IFNAME``."""

    def enter(self, *, configure_torch: bool = True) -> None:
        """Join the device's cgroups, pin to its CPUs, enter its network namespace and size
        the thread pools. Call it first thing in the worker, before torch does any work and
        before any socket is opened. Raises :class:`WorkerError` naming the device."""
        pid = os.getpid()
        for procs in self.cgroup_procs:
            try:
                with open(procs, "w") as f:
                    f.write(str(pid))
            except OSError as e:
                raise WorkerError(f"device {self.device}: cannot join {procs}: {e}") from e
        _pin_all_threads(self.cpus)
        if self.netns is not None:
            try:
                enter_namespace(self.netns)
            except (OSError, RuntimeError) as e:
                raise WorkerError(f"device {self.device}: cannot enter network: {e}") from e
            if self.ifname:
                os.environ["GLOO_SOCKET_IFNAME"] = self.ifname
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(self.threads)
        if configure_torch:
            _size_torch_pools(self.threads)


def _pin_all_threads(cpus: tuple[int, ...]) -> None:
    """``sched_setaffinity`` applies to one thread; pin every thread that already exists
    (threads created later inherit the mask of their creator)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(tid, cpus)


def _size_torch_pools(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != 1:
        # Raises once inter-op work has started in this process; the pool is fixed then.
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)


def cpu_sharers(cpus: Sequence[tuple[int, ...]]) -> list[list[int]]:
    """Per device (index into ``cpus``), the other devices that have a CPU in common with it."""
    return [
        [j for j, other in enumerate(cpus) if j != i and set(mine) & set(other)]
        for i, mine in enumerate(cpus)
    ]


def assign_cpus(
    cores: Sequence[int], quotas: Sequence[float], host_cpus: Sequence[int]
) -> list[tuple[int, ...]]:
    """Host CPUs for each device, in order.

    Round-robin over ``host_cpus``, ``cores[i]`` CPUs for device ``i``, as long as free CPUs
    last. When the host has fewer CPUs than the devices ask for, devices share: each takes the
    CPUs with the least quota already placed on them (ties go round-robin), so that e.g.
    quotas 1.0/0.5/0.25 on two CPUs become {1.0} and {0.5, 0.25}, which fit. A device that
    asks for more cores than the host has gets all of them.
    """
    n = len(host_cpus)
    load = [0.0] * n
    cursor = 0
    result: list[tuple[int, ...]] = []
    for want, quota in zip(cores, quotas, strict=True):
        order = sorted(range(n), key=lambda j: (round(load[j], 9), (j - cursor) % n))
        chosen = sorted(order[: min(want, n)])
        for j in chosen:
            load[j] += quota
        cursor = (order[min(want, n) - 1] + 1) % n
        result.append(tuple(host_cpus[j] for j in chosen))
    return result
