"""Turn a :class:`ClusterSpec` into real limits on this host, and take them down again.

Used by the launcher (parent process)::

    with Emulator(cluster, run_id) as emu:
        for rank in range(cluster.world_size):
            proc = ctx.Process(target=worker, args=(emu.slot(rank), ...))
            proc.start()
            emu.attach(rank, proc.pid)      # needed for the duty-cycle fallback
        print("\\n".join(emu.report()))
        ...                                 # workers call slot.enter() first thing

Mechanisms, best first: cgroup v1/v2 for CPU set and memory cap; for a slow device's CPU, a
competing real-time load on its own CPUs (:mod:`competitor`), else a CFS quota, else a
duty-cycle helper per worker; ``sched_setaffinity`` where there is no cpuset. A device whose
quota covers its whole CPU set gets no limit at all. At start-up the speed of every
throttled device is measured and its limit calibrated (:mod:`speed`).
``report()`` says which mechanism is in force and what each device really gets. Teardown
(on ``__exit__``, at interpreter exit, on SIGTERM; idempotent) kills any worker left inside
the devices and removes every cgroup, namespace and link; :func:`cleanup_stale` handles runs
that could not tear down.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal

from xronos.emulation import cgroups, hierarchies, netns
from xronos.emulation.cgroups import Group, Hierarchy, Limits
from xronos.emulation.cluster import ClusterSpec
from xronos.emulation.network import Links, start_links
from xronos.emulation.report import ReportInput, emulator_report
from xronos.emulation.slot import DeviceSlot, assign_cpus
from xronos.emulation.speed import SpeedCheck, SpeedChecker
from xronos.emulation.state import PREFIX, RunState, default_state_dir, process_start_time
from xronos.emulation.throttle import LOAD, Throttles, load_ranks
from xronos.errors import UserError

log = logging.getLogger(__name__)

Mechanism = Literal["auto", "load", "cgroup", "duty-cycle", "none"]
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_DETECT: Any = object()


class Emulator:
    """Emulated devices for one run (see the module docstring).

    Args:
        cluster: the devices; device ``i`` is rank ``i``.
        run_id: names the run's cgroups ``xronos-<run_id>-<device>``.
        network: give each device a network namespace with a shaped link (rate by ``tc
            tbf``, latency by ``netem`` or the communication layer; :mod:`network`). Where
            namespaces cannot be made, the report says the links are not emulated and the
            run goes on over loopback.
        require_network: with ``network``, raise a one-line :class:`UserError` instead
            (the user asked for the links explicitly).
        comm_fallback: instead, emulate rate and latency in the communication layer
            (reported); only for a launcher that hands :meth:`comm_latencies` and
            ``links.comm_bandwidths()`` to its workers.
        mechanism: ``auto`` (competing load where a slow device has its CPUs to itself and
            real-time scheduling is allowed, else a cgroup quota, else duty-cycle), ``load``
            (require the competing load), ``cgroup`` (require a cgroup quota),
            ``duty-cycle`` (force the fallback) or ``none`` (CPU sets only, no limit).
        period_us: CPU quota period requested (quota and duty-cycle). Where the measured
            speed misses the spec at this period even after calibration, a longer one is
            used (reported).
        state_dir: where the run's state file goes (see :mod:`state`).
        hierarchy: the cgroup hierarchy to use; detected from the host by default.
        check_speed: at start-up, measure each throttled device's speed and calibrate its
            limit until it matches the spec (a few seconds per device); off: apply the spec's
            quota as it is and report the speeds as not measured.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        run_id: str,
        *,
        network: bool = False,
        require_network: bool = False,
        comm_fallback: bool = False,
        mechanism: Mechanism = "auto",
        period_us: int = 10_000,
        state_dir: str | os.PathLike[str] | None = None,
        hierarchy: Hierarchy | None = _DETECT,
        check_speed: bool = True,
    ) -> None:
        if not RUN_ID_RE.match(run_id):
            raise UserError(
                f"run id {run_id!r}: not usable in cgroup names; use 1-64 letters, digits, "
                "'.', '-' or '_'"
            )
        if mechanism not in ("auto", "load", "cgroup", "duty-cycle", "none"):
            raise UserError(
                f"emulation mechanism {mechanism!r}: unknown; use auto, load, cgroup, "
                "duty-cycle or none"
            )
        self.cluster = cluster
        self.run_id = run_id
        self.network = network
        self.require_network = require_network
        self.comm_fallback = comm_fallback
        self.mechanism: Mechanism = mechanism
        self.period_us = period_us
        self.check_speed = check_speed
        detected = hierarchies.detect() if hierarchy is _DETECT else hierarchy
        self.hierarchy: Hierarchy | None = detected
        self.host_cpus = sorted(os.sched_getaffinity(0))
        devices = cluster.devices
        self.cpus = assign_cpus(
            [d.cores for d in devices], [d.cpu_quota for d in devices], self.host_cpus
        )
        self.groups: list[Group | None] = [None] * len(devices)
        self.cpu_mechanism: list[str] = ["none"] * len(devices)
        """Per rank: ``competing load``, ``cgroup v1``, ``cgroup v2``, ``duty-cycle``, ``none``."""
        self.links = Links(devices)
        """How the links are emulated, and what the communication layer adds (:mod:`network`)."""
        self.net: netns.NetworkPlan | None = None
        self.netem = False
        """Whether the kernel delays packets (netem); else latency is the comm layer's."""
        self.bridge_ip: str | None = None
        """Address in the root namespace that devices reach (None without network)."""
        self.notes: dict[str, str] = {}
        self.problems: list[str] = []
        self.speeds: list[SpeedCheck] = []
        """Per rank, after start(): asked vs measured speed and the limit in force."""
        self._checker = SpeedChecker()
        self._throttles = Throttles()
        self._load: set[int] = set()
        self._attached: dict[int, tuple[int, str | None]] = {}
        self._state_path = Path(state_dir or default_state_dir()) / f"{PREFIX}{run_id}.json"
        self._state: RunState | None = None
        self._owner = os.getpid()
        self._prev_sigterm: Any = None
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Emulator:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Create every limit; on any failure tear down what was made and re-raise."""
        if self._started:
            return
        self._started = True
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.getsignal(signal.SIGTERM)
            if self._prev_sigterm != signal.SIG_IGN:  # a process that ignores it keeps doing so
                signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._state = RunState(self.run_id, self._owner, process_start_time(self._owner))
            asked = [self.asked_speed(r) for r in range(self.cluster.world_size)]
            self._load, why = load_ranks(self.mechanism, asked, self.cpus)
            self.notes.update({"load": why} if why else {})
            self._setup_cgroups()
            self._check_speeds()
            if self.network:
                self._setup_network()
        except BaseException:
            self.close()
            raise

    def _save_state(self) -> None:
        state = self._state
        if state is None or not (state.cgroup_dirs or state.namespaces or state.links):
            return
        try:
            state.save(self._state_path)
        except OSError as e:  # the run goes on; only cleanup after a crash is lost
            log.warning("cannot record emulation state in %s: %s", self._state_path, e)

    def _group_name(self, rank: int) -> str:
        return f"{PREFIX}{self.run_id}-{self.cluster.devices[rank].name}"

    def asked_speed(self, rank: int) -> float:
        """The device's speed as a fraction of its CPU set: ``cores × cpu_quota / CPUs``."""
        return min(1.0, self.cluster.devices[rank].capacity / len(self.cpus[rank]))

    def _limits(self, rank: int) -> Limits:
        device = self.cluster.devices[rank]
        asked = self.asked_speed(rank)
        if asked >= 1.0 or rank in self._load:  # no CFS quota at all
            return Limits(self.cpus[rank], None, self.period_us, device.memory_bytes)
        quota_us, period = cgroups.quota_and_period(asked * len(self.cpus[rank]), self.period_us)
        if period != self.period_us:
            self.notes["period"] = f"period stretched to {period} us for the 1 ms minimum quota"
        return Limits(self.cpus[rank], quota_us, period, device.memory_bytes)

    def _setup_cgroups(self) -> None:
        if self.mechanism in ("duty-cycle", "none"):
            self.notes["cgroups"] = f"cgroups not used: {self.mechanism} requested"
            self._no_cgroups()
            return
        h = self.hierarchy
        if h is None:
            return self._cgroups_unavailable("no cgroup hierarchy is mounted")
        assert self._state is not None
        limits = [self._limits(r) for r in range(self.cluster.world_size)]
        for rank, lim in enumerate(limits):
            self._state.cgroup_dirs += [str(d) for d in h.plan_dirs(self._group_name(rank), lim)]
        self._save_state()
        try:
            for rank, lim in enumerate(limits):
                self.groups[rank] = h.create(self._group_name(rank), lim)
        except OSError as e:
            self.groups = [None] * self.cluster.world_size
            self.problems += cgroups.destroy_dirs([Path(d) for d in self._state.cgroup_dirs])
            self._state.cgroup_dirs = []
            return self._cgroups_unavailable(f"cgroups not writable: {e.strerror or e}")
        for rank, group in enumerate(self.groups):
            assert group is not None
            if rank in self._load:
                self.cpu_mechanism[rank] = LOAD
            elif "cpu" in group.applied:
                self.cpu_mechanism[rank] = f"cgroup {h.version}"
            elif self.mechanism == "cgroup":
                raise UserError(
                    f"cgroup cpu controller: {group.problems.get('cpu', 'unavailable')}; run "
                    "as root with a writable cgroup hierarchy, or choose the duty-cycle fallback"
                )
            else:
                self.notes["cpu"] = group.problems.get("cpu", "cpu controller not available")
                self.cpu_mechanism[rank] = "duty-cycle"

    def _cgroups_unavailable(self, reason: str) -> None:
        if self.mechanism == "cgroup":
            raise UserError(
                f"emulation: {reason}; run as root on a host with cgroups, or use the "
                "duty-cycle fallback"
            )
        self.notes["cgroups"] = reason
        self._no_cgroups()

    def _no_cgroups(self) -> None:
        fallback = "none" if self.mechanism == "none" else "duty-cycle"
        self.cpu_mechanism = [
            LOAD if r in self._load else fallback for r in range(self.cluster.world_size)
        ]
        self._save_state()

    def _check_speeds(self) -> None:
        """Fill :attr:`speeds`; measure and calibrate the throttled devices (see :mod:`speed`)."""
        asked = [self.asked_speed(r) for r in range(self.cluster.world_size)]
        self.speeds = self._checker.run(
            self.cluster.devices, asked, self.cpu_mechanism, self.cpus, self.groups,
            self.hierarchy, self.period_us, measure=self.check_speed,
        )  # fmt: skip
        self._throttles.start(self.speeds, asked, self.cpus)

    def effective_speeds(self) -> list[float | None]:
        """Per rank, the speed each device gets as a fraction of its CPU set: measured for
        throttled devices, 1.0 for devices without a limit, None where not measured."""
        return [s.got for s in self.speeds]

    def _setup_network(self) -> None:
        def record(plan: netns.NetworkPlan) -> None:
            assert self._state is not None
            self._state.namespaces, self._state.links = plan.namespaces, plan.links
            self._save_state()

        self.links, why = start_links(
            self.run_id, self.cluster.devices, record, self.require_network, self.comm_fallback
        )
        self.notes.update({"network": why} if why is not None else {})
        self.net, self.netem = self.links.plan, self.links.netem
        self.bridge_ip = self.net.bridge_ip if self.net is not None else None

    def comm_latencies(self) -> tuple[float, ...] | None:
        """Per rank, the latency (s) the communication layer adds (namespaces without netem,
        or the fallback, whose rates are ``links.comm_bandwidths()``); else None."""
        return self.links.comm_latencies()

    # ------------------------------------------------------------------ workers

    def slot(self, rank: int) -> DeviceSlot:
        """What the worker of ``rank`` passes to :meth:`DeviceSlot.enter`."""
        if not self._started:
            raise RuntimeError("Emulator.slot() before start(): use it inside `with Emulator(...)`")
        device = self.cluster.devices[rank]
        group = self.groups[rank]
        net = self.net
        return DeviceSlot(
            rank=rank,
            device=device.name,
            threads=device.cores,
            cpus=self.cpus[rank],
            cgroup_procs=group.procs_files if group is not None else (),
            netns=net.namespace(rank) if net else None,
            ip=net.ip(rank) if net else None,
            ifname=netns.IFNAME if net else None,
        )

    def attach(self, rank: int, pid: int) -> None:
        """Put a started worker under its device's limits from the outside: joins it to the
        cgroups (the worker's own :meth:`DeviceSlot.enter` does the same) and, under the
        duty-cycle fallback, starts its throttle helper. Call it right after starting."""
        if self._closed or not self._started:
            raise RuntimeError("Emulator.attach() outside of its `with` block")
        self._attached[rank] = (pid, process_start_time(pid))
        group = self.groups[rank]
        if group is not None and self.hierarchy is not None:
            try:
                self.hierarchy.add_pid(group, pid)
            except ProcessLookupError:
                return
        self._throttles.attach(
            rank, pid, self.cpu_mechanism[rank], self.asked_speed(rank), self.period_us / 1e6
        )

    # ------------------------------------------------------------------ teardown

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        prev = self._prev_sigterm
        if prev is signal.default_int_handler and os.getpid() == self._owner:
            prev(signum, frame)  # as Ctrl-C: the ``with`` block tears down on the way out
        self.close()
        if callable(prev):
            prev(signum, frame)
        elif os.getpid() == self._owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _destroy_groups(self) -> None:
        for rank, group in enumerate(self.groups):
            if group is not None and self.hierarchy is not None:
                self.problems += self.hierarchy.destroy(group)
            self.groups[rank] = None

    def close(self) -> None:
        """Tear everything down: stop throttle helpers, kill workers still inside the
        devices, remove cgroups, namespaces and links. Safe to call again, from atexit, from
        the SIGTERM handler; does nothing in a forked child of the owner."""
        if self._closed or not self._started or os.getpid() != self._owner:
            return
        self._closed = True
        self._checker.close()
        self._throttles.stop()
        for pid, born in self._attached.values():
            if born is not None and process_start_time(pid) == born:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._destroy_groups()
        if self._state is not None and (self._state.namespaces or self._state.links):
            self.problems += netns.teardown_network(self._state.namespaces, self._state.links)
        if self.problems:
            log.warning("emulation teardown incomplete: %s", "; ".join(self.problems))
        else:
            self._state_path.unlink(missing_ok=True)
        atexit.unregister(self.close)
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == self._on_sigterm
        ):
            signal.signal(signal.SIGTERM, self._prev_sigterm)

    # ------------------------------------------------------------------ report

    def report(self) -> list[str]:
        """Lines for the user: which mechanism emulates what, and each device's limits."""
        h = self.hierarchy
        return emulator_report(
            ReportInput(
                cluster=self.cluster,
                host_cpus=tuple(self.host_cpus),
                cpus=tuple(self.cpus),
                period_us=self.period_us,
                cpu_mechanism=tuple(self.cpu_mechanism),
                notes={**self.notes, **({"placement": h.placement} if h and h.placement else {})},
                hierarchy_version=h.version if h is not None else None,
                groups=tuple(self.groups),
                network=self.network,
                net=self.net,
                bridge_ip=self.bridge_ip,
                netem=self.netem,
                speeds=tuple(self.speeds),
                comm_network=self.links.comm_network,
            )
        )
