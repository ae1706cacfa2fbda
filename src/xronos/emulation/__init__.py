"""Emulation of a heterogeneous cluster on one Linux host: cluster specs (TOML or presets),
per-device CPU quota, CPU set and memory cap (cgroups, with a duty-cycle fallback), optional
per-device network namespaces with shaped links, and teardown on every exit path."""

from xronos.emulation.cluster import ClusterSpec, DeviceSpec, list_presets, load_cluster
from xronos.emulation.limits import Emulator
from xronos.emulation.slot import DeviceSlot
from xronos.emulation.state import cleanup_stale

__all__ = [
    "ClusterSpec",
    "DeviceSlot",
    "DeviceSpec",
    "Emulator",
    "cleanup_stale",
    "list_presets",
    "load_cluster",
]
