"""The lines an emulator shows the user: which mechanism emulates what (and why a fallback is
in force), each device's limits and the link in force (``link: 1 Gbit/s, 2 ms (tbf +
latency in the communication layer)``, ``link: 200 Mbit/s (bandwidth in the communication
layer)`` under the network fallback, or ``link: not emulated``), what each device's speed
measured, and which devices share host CPUs. It works on plain data (:class:`ReportInput`),
not on the emulator itself."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xronos.emulation.cgroups import Group
from xronos.emulation.cluster import ClusterSpec
from xronos.emulation.competitor import MECHANISM as LOAD
from xronos.emulation.competitor import PERIOD_S as LOAD_PERIOD_S
from xronos.emulation.netns import NetworkPlan
from xronos.emulation.speed import SpeedCheck
from xronos.emulation.units import format_bandwidth, format_bytes, format_duration


@dataclass(frozen=True)
class ReportInput:
    """What the report needs to know about one emulator, after its start."""

    cluster: ClusterSpec
    host_cpus: Sequence[int]
    cpus: Sequence[tuple[int, ...]]
    """Per rank: host CPUs of the device."""
    period_us: int
    """CPU quota period requested."""
    cpu_mechanism: Sequence[str]
    """Per rank: ``cgroup v1``, ``cgroup v2``, ``duty-cycle`` or ``none``."""
    notes: Mapping[str, str]
    """Why a mechanism is not in force, keyed ``cgroups``, ``cpu``, ``period``, ``network``;
    ``placement``: where device groups are made, when not below this process's cgroup."""
    hierarchy_version: str | None
    """``v1``, ``v2`` or None without a cgroup hierarchy."""
    groups: Sequence[Group | None]
    network: bool
    """Network emulation requested."""
    net: NetworkPlan | None
    bridge_ip: str | None
    net_notes: Sequence[str] = ()
    speeds: Sequence[SpeedCheck] = ()
    netem: bool = False
    """The kernel delays packets (netem); else latency is added in the communication layer."""
    comm_network: str | None = None
    """Why rate and latency are emulated in the communication layer (the fallback: no
    network namespaces could be made); None where they are not."""


def _periods(emu: ReportInput) -> str:
    """The quota period(s) in force, and the request where it was lengthened."""
    used = {
        s.period_us
        for s in emu.speeds
        if s.measured and s.period_us is not None and s.mechanism != LOAD
    }
    used = used or {emu.period_us}
    text = " / ".join(f"{p / 1000:g} ms" for p in sorted(used))
    if used != {emu.period_us}:
        text += f" ({emu.period_us / 1000:g} ms requested; see speed lines)"
    return text


def emulator_report(emu: ReportInput) -> list[str]:
    """The report's lines, first the mechanisms, then one line per device."""
    devices = emu.cluster.devices
    groups = emu.groups
    plural = "s" if len(devices) != 1 else ""
    lines = [
        f"cluster {emu.cluster.name}: {len(devices)} device{plural} "
        f"on {len(emu.host_cpus)} host CPUs"
    ]
    period = _periods(emu)
    words = {
        "duty-cycle": f"duty-cycle fallback, SIGSTOP/SIGCONT every {emu.period_us / 1000:g} ms",
        "none": "not emulated",
        LOAD: f"competing load (a real-time process per CPU of each slow device leaves the "
        f"device its share of every {LOAD_PERIOD_S * 1000:g} ms; no quota)",
    }
    slow = {
        m
        for m, d, c in zip(emu.cpu_mechanism, emu.cluster.devices, emu.cpus, strict=True)
        if d.capacity < len(c)
    }
    for m in emu.cpu_mechanism:
        words.setdefault(m, f"{m}, period {period}" if m in slow else f"{m}, no quota needed")
    cpu = ", ".join(words[m] for m in sorted(set(emu.cpu_mechanism)))
    why = emu.notes.get("cpu") or emu.notes.get("cgroups")
    if why and any(m in ("duty-cycle", "none") for m in emu.cpu_mechanism):
        cpu += f" ({why})"
    lines.append(f"cpu limit: {cpu}")
    if "load" in emu.notes:
        lines.append(f"cpu limit: competing load not used ({emu.notes['load']})")
    if "period" in emu.notes:
        lines.append(f"cpu limit: {emu.notes['period']}")
    version = emu.hierarchy_version
    cpuset_ok = version is not None and all(g is not None and "cpuset" in g.applied for g in groups)
    cpuset = f"cgroup {version} cpuset + " if cpuset_ok else ""
    lines.append(f"cpu sets: {cpuset}sched_setaffinity")
    if emu.notes.get("placement") and any(g is not None and g.applied for g in groups):
        lines.append(f"cgroups: {emu.notes['placement']}")
    if all(d.memory_bytes is None for d in devices):
        lines.append("memory cap: none requested")
    elif version is not None and all(
        g is not None and "memory" in g.applied
        for g, d in zip(groups, devices, strict=True)
        if d.memory_bytes is not None
    ):
        lines.append(f"memory cap: cgroup {version}")
    else:
        problems = {
            p for g in groups if g is not None for k, p in g.problems.items() if k == "memory"
        }
        reason = "; ".join(sorted(problems)) or emu.notes.get("cgroups", "no memory cgroup")
        lines.append(f"memory cap: not emulated ({reason})")
    if not emu.network:
        lines.append("network: not requested (devices talk over loopback)")
    elif emu.comm_network is not None:
        lines.append(_fallback_line(emu.cluster, emu.comm_network))
    elif emu.net is None:
        lines.append(f"network: not emulated ({emu.notes.get('network', 'unavailable')})")
    else:
        latency = "tc netem" if emu.netem else "the communication layer (this kernel has no netem)"
        lines.append(
            f"network: namespaces + veth + bridge {emu.net.bridge} ({emu.bridge_ip}); "
            f"bandwidth by tc tbf, latency by {latency}"
        )
        lines += [f"network: {note}" for note in emu.net_notes]
    lines += [_device_line(emu, r) for r in range(len(devices))]
    lines += _sharing_lines(emu)
    lines += [s.line() for s in emu.speeds]
    return lines


def _fallback_line(cluster: ClusterSpec, why: str) -> str:
    """The network line under the fallback: what the communication layer emulates, and why."""
    rate = any(d.bandwidth_bps for d in cluster.devices)
    delay = any(d.latency_s for d in cluster.devices)
    what = " and ".join(w for w, v in (("bandwidth", rate), ("latency", delay)) if v) or "links"
    return (
        f"network: {what} emulated in the communication layer (no network namespaces here: "
        f"{why}); devices talk over loopback"
    )


def _device_line(emu: ReportInput, rank: int) -> str:
    d = emu.cluster.devices[rank]
    cpus = ",".join(map(str, emu.cpus[rank]))
    parts = [
        f"  {d.name}: cpus {cpus}, {d.cores} thread{'s' if d.cores > 1 else ''}, "
        f"quota {d.cpu_quota:.2f} = {d.capacity:.2f} CPU"
    ]
    if d.cores > len(emu.cpus[rank]):
        parts.append(f"{d.cores} threads on {len(emu.cpus[rank])} CPUs (host too small)")
    if d.memory_bytes is not None:
        parts.append(f"memory {format_bytes(d.memory_bytes)}")
    if emu.net is not None:
        parts.append(f"ip {emu.net.ip(rank)}")
    comm = emu.comm_network is not None
    emulated = emu.net is not None or comm
    link = link_text(d.bandwidth_bps, d.latency_s, emulated=emulated, netem=emu.netem, comm=comm)
    if link:
        parts.append(f"link: {link}")
    return ", ".join(parts)


def link_text(
    bandwidth_bps: float | None,
    latency_s: float | None,
    *,
    emulated: bool,
    netem: bool,
    comm: bool = False,
) -> str:
    """One device's link as the report states it: ``1 Gbit/s, 2 ms (tbf + latency in the
    communication layer)``; under the network fallback (``comm``) ``1 Gbit/s, 2 ms
    (bandwidth + latency in the communication layer)``; ``not emulated (declared …)`` when
    the network is not emulated; ``unshaped`` on an emulated network for a device that
    declares nothing; the empty string when there is neither a network nor a declared link."""
    words = [format_bandwidth(bandwidth_bps)] if bandwidth_bps else []
    words += [format_duration(latency_s)] if latency_s else []
    if not emulated:
        return f"not emulated (declared {', '.join(words)})" if words else ""
    if not words:
        return "unshaped"
    if comm:
        what = " + ".join(w for w, v in (("bandwidth", bandwidth_bps), ("latency", latency_s)) if v)
        return f"{', '.join(words)} ({what} in the communication layer)"
    how = ["tbf"] if bandwidth_bps else []
    if latency_s:
        how.append("netem" if netem else "latency in the communication layer")
    return f"{', '.join(words)} ({' + '.join(how)})"


def _sharing_lines(emu: ReportInput) -> list[str]:
    users: dict[int, list[int]] = {}
    for rank, cpus in enumerate(emu.cpus):
        for cpu in cpus:
            users.setdefault(cpu, []).append(rank)
    lines = []
    for cpu, ranks in sorted(users.items()):
        if len(ranks) < 2:
            continue
        names = ", ".join(emu.cluster.devices[r].name for r in ranks)
        load = sum(emu.cluster.devices[r].cpu_quota for r in ranks)
        verdict = "fits" if load <= 1.0 + 1e-9 else "they contend and run slower than specified"
        lines.append(f"cores shared: cpu {cpu} by {names} ({load:.2f} of it requested: {verdict})")
    return lines


def links_in_force(
    cluster: ClusterSpec, emulated: bool, netem: bool, comm: bool = False
) -> list[dict[str, Any]]:
    """Per device, the link a run had: declared rate and latency, whether they were
    emulated, what limited the rate (``tbf``, ``communication layer``) and what delayed
    the packets (``netem``, ``communication layer``), and the report's wording (for
    ``bench.json``). ``comm``: the network fallback (no namespaces; both in the
    communication layer)."""
    out = []
    for d in cluster.devices:
        bandwidth_by = latency_by = None
        if emulated and d.bandwidth_bps:
            bandwidth_by = "communication layer" if comm else "tbf"
        if emulated and d.latency_s:
            latency_by = "netem" if netem and not comm else "communication layer"
        text = link_text(d.bandwidth_bps, d.latency_s, emulated=emulated, netem=netem, comm=comm)
        out.append(
            {
                "name": d.name,
                "bandwidth_bps": d.bandwidth_bps,
                "latency_s": d.latency_s,
                "emulated": emulated,
                "bandwidth_by": bandwidth_by,
                "latency_by": latency_by,
                "link": text or "loopback",
            }
        )
    return out
