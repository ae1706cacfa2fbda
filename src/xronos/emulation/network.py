"""How one run's links are emulated, and what the communication layer must add.

Best first:

* network namespaces joined by a bridge, the rate shaped by ``tc tbf`` and the latency
  delayed by ``netem`` (:mod:`netns`); where the kernel has no ``netem``, the latency is
  added in the communication layer (:mod:`xronos.comm.links`);
* where namespaces cannot be made (no root, no iproute2, a sandbox) and the launcher
  allows it, the **fallback**: rate *and* latency in the communication layer, every model
  message charged its bytes at the slower of its two links' rates after the real transfer
  over loopback — reported as ``network: bandwidth emulated in the communication layer (no
  network namespaces here: <why>)``;
* else the links are not emulated (reported); a run that asked for them explicitly stops
  with one line instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xronos.emulation import netns
from xronos.emulation.cluster import ClusterSpec, DeviceSpec
from xronos.emulation.netns import NetworkPlan
from xronos.emulation.report import links_in_force
from xronos.errors import UserError


@dataclass(frozen=True)
class Links:
    """One run's links as emulated: in namespaces (``plan``), in the communication layer
    (``comm_network``), or not at all (neither)."""

    devices: tuple[DeviceSpec, ...]
    plan: NetworkPlan | None = None
    """The namespaces, veths and bridge (None: none were made)."""
    netem: bool = False
    """The kernel delays packets (netem); else latency is the communication layer's."""
    comm_network: str | None = None
    """Why rate and latency are emulated in the communication layer (the fallback:
    namespaces could not be made); None where they are not."""

    @property
    def emulated(self) -> bool:
        return self.plan is not None or self.comm_network is not None

    def comm_latencies(self) -> tuple[float, ...] | None:
        """Per rank, the latency (s) the communication layer adds: the declared latencies
        where the kernel does not delay packets (namespaces without netem, or the
        fallback); None where nothing is added."""
        if not self.emulated or self.netem or not any(d.latency_s for d in self.devices):
            return None
        return tuple(d.latency_s or 0.0 for d in self.devices)

    def comm_bandwidths(self) -> tuple[float | None, ...] | None:
        """Per rank, the link rate (bit/s) the communication layer emulates: the declared
        rates under the fallback (None for a device that declares none); else None."""
        if self.comm_network is None or not any(d.bandwidth_bps for d in self.devices):
            return None
        return tuple(d.bandwidth_bps for d in self.devices)

    def in_force(self, cluster: ClusterSpec) -> list[dict[str, Any]]:
        """Per device, the link in force and what emulates it (``bench.json``)."""
        return links_in_force(cluster, self.emulated, self.netem, self.comm_network is not None)


def start_links(
    run_id: str,
    devices: tuple[DeviceSpec, ...],
    record: Callable[[NetworkPlan], None],
    require: bool,
    comm_fallback: bool,
) -> tuple[Links, str | None]:
    """Make the run's namespaces and shaped links (``record`` notes the names first, for
    cleanup after a crash). Returns the links and, where namespaces could not be made, why.

    Raises:
        UserError: namespaces cannot be made, ``require`` is set and the fallback is not
            allowed (``comm_fallback``).
    """
    try:
        plan = netns.plan_network(run_id, len(devices))
        record(plan)
        netem = netns.setup_network(plan, devices)
    except netns.NetworkUnavailable as e:
        if comm_fallback:
            return Links(devices, comm_network=str(e)), str(e)
        if require:
            raise UserError(
                f"network emulation: {e}; run as root with iproute2 (`ip`, `tc`), "
                "or pass --no-network to run the devices over loopback"
            ) from None
        return Links(devices), str(e)
    return Links(devices, plan, netem), None
