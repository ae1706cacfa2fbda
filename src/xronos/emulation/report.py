"""The lines an :class:`~xronos.emulation.limits.Emulator` shows the user: which mechanism
emulates what (and why a fallback is in force), each device's limits, and which devices share
host CPUs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xronos.emulation.units import format_bandwidth, format_bytes, format_duration

if TYPE_CHECKING:
    from xronos.emulation.limits import Emulator


def emulator_report(emu: Emulator) -> list[str]:
    devices = emu.cluster.devices
    h, groups = emu.hierarchy, emu.groups
    plural = "s" if len(devices) != 1 else ""
    lines = [
        f"cluster {emu.cluster.name}: {len(devices)} device{plural} "
        f"on {len(emu.host_cpus)} host CPUs"
    ]
    period = f"{emu.period_us / 1000:g} ms"
    words = {
        "duty-cycle": f"duty-cycle fallback, SIGSTOP/SIGCONT every {period}",
        "none": "not emulated",
    }
    cpu = ", ".join(words.get(m, f"{m}, period {period}") for m in sorted(set(emu.cpu_mechanism)))
    why = emu.notes.get("cpu") or emu.notes.get("cgroups")
    if why and any(m != "cgroup v1" and m != "cgroup v2" for m in emu.cpu_mechanism):
        cpu += f" ({why})"
    lines.append(f"cpu quota: {cpu}")
    if "period" in emu.notes:
        lines.append(f"cpu quota: {emu.notes['period']}")
    cpuset_ok = h is not None and all(g is not None and "cpuset" in g.applied for g in groups)
    cpuset = f"cgroup {h.version} cpuset + " if cpuset_ok and h else ""
    lines.append(f"cpu sets: {cpuset}sched_setaffinity")
    if all(d.memory_bytes is None for d in devices):
        lines.append("memory cap: none requested")
    elif h is not None and all(
        g is not None and "memory" in g.applied
        for g, d in zip(groups, devices, strict=True)
        if d.memory_bytes is not None
    ):
        lines.append(f"memory cap: cgroup {h.version}")
    else:
        problems = {
            p for g in groups if g is not None for k, p in g.problems.items() if k == "memory"
        }
        reason = "; ".join(sorted(problems)) or emu.notes.get("cgroups", "no memory cgroup")
        lines.append(f"memory cap: not emulated ({reason})")
    if not emu.network:
        lines.append("network: not requested (devices talk over loopback)")
    elif emu.net is None:
        lines.append(f"network: not emulated ({emu.notes.get('network', 'unavailable')})")
    else:
        shaping = "tbf" if emu.net_notes else "tbf/netem"
        lines.append(
            f"network: namespaces + veth + bridge {emu.net.bridge} ({emu.bridge_ip}), "
            f"tc {shaping} shaping"
        )
        lines += [f"network: {note}" for note in emu.net_notes]
    lines += [_device_line(emu, r) for r in range(len(devices))]
    lines += _sharing_lines(emu)
    return lines


def _device_line(emu: Emulator, rank: int) -> str:
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
        link = [format_bandwidth(d.bandwidth_bps)] if d.bandwidth_bps else []
        if d.latency_s:
            late = format_duration(d.latency_s)
            link.append(f"{late} (not emulated)" if emu.net_notes else late)
        parts.append(f"ip {emu.net.ip(rank)}" + (f", link {' '.join(link)}" if link else ""))
    return ", ".join(parts)


def _sharing_lines(emu: Emulator) -> list[str]:
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
