"""Per-device network namespaces joined by a bridge, with shaped links.

::

      root namespace                         namespace xr-<tag>-<i>
    ┌──────────────────────────────┐        ┌───────────────────────────┐
    │ bridge xrb<tag> 10.213.S.1   │        │ eth0  10.213.S.(10+i)/24  │
    │   └─ xrv<tag><i> ──── veth ──┼────────┼─ (egress: tbf + netem)    │
    │      (egress: tbf + netem)   │        │ lo                        │
    └──────────────────────────────┘        └───────────────────────────┘

Each device gets its own namespace and a veth pair into a bridge in the root namespace; the
rendezvous store can listen on the bridge's address. A device's ``bandwidth`` and
``latency`` shape both directions of its link (``tbf`` for the rate, ``netem`` for the
delay): traffic from device A to device B crosses A's uplink and B's downlink, like two
machines on one switch. Where the kernel has no ``netem`` qdisc (``tc qdisc add ... netem``
fails), only the rate is shaped here and :func:`setup_network` says so; the launcher then
adds the latency in the communication layer (:mod:`xronos.comm.links`), which charges
every message ``l_A + l_B`` one way — the same model. Where namespaces cannot be made at
all (:class:`NetworkUnavailable`), the launcher emulates the rate there too
(:mod:`xronos.emulation.network`). The /24 is picked per run among ``10.213.0.0/16``
subnets that are not in use on the host, and only traffic between these namespaces and the
bridge is touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

from xronos.emulation.cluster import DeviceSpec

SUBNET_PREFIX = "10.213"
IFNAME = "eth0"
"""Name of the device's interface inside its namespace."""
CLONE_NEWNET = 0x40000000
NETNS_DIRS = ("/var/run/netns", "/run/netns")


class NetworkUnavailable(RuntimeError):
    """Namespaces cannot be made here (no iproute2, no permission, ...)."""


@dataclass(frozen=True)
class NetworkPlan:
    """Names and addresses of one run's network; deterministic from the run id."""

    tag: str
    subnet: int
    """Third octet of the run's /24."""
    world_size: int

    @property
    def bridge(self) -> str:
        return f"xrb{self.tag}"

    @property
    def bridge_ip(self) -> str:
        return f"{SUBNET_PREFIX}.{self.subnet}.1"

    def namespace(self, i: int) -> str:
        return f"xr-{self.tag}-{i}"

    def host_veth(self, i: int) -> str:
        return f"xrv{self.tag}{i}"

    def ip(self, i: int) -> str:
        return f"{SUBNET_PREFIX}.{self.subnet}.{10 + i}"

    @property
    def namespaces(self) -> list[str]:
        return [self.namespace(i) for i in range(self.world_size)]

    @property
    def links(self) -> list[str]:
        return [self.host_veth(i) for i in range(self.world_size)] + [self.bridge]


def _run(*args: str) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetworkUnavailable(f"{args[0]}: {e}") from None
    if done.returncode != 0:
        raise NetworkUnavailable(f"`{' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def _used_subnets() -> set[int]:
    used: set[int] = set()
    text = _run("ip", "-o", "-4", "addr", "show") + _run("ip", "-4", "route", "show")
    for word in text.split():
        if word.startswith(SUBNET_PREFIX + "."):
            parts = word.split(".")
            if len(parts) >= 3 and parts[2].isdigit():
                used.add(int(parts[2]))
    return used


def plan_network(run_id: str, world_size: int) -> NetworkPlan:
    """Pick names and a free /24 for a run; raises :class:`NetworkUnavailable`."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetworkUnavailable("iproute2 (`ip`, `tc`) is not installed")
    if world_size > 200:
        raise NetworkUnavailable(f"{world_size} devices do not fit one /24")
    digest = hashlib.sha1(run_id.encode()).hexdigest()
    used = _used_subnets()
    start = int(digest[6:8], 16)
    for k in range(256):
        subnet = (start + k) % 254 + 1
        if subnet not in used:
            return NetworkPlan(digest[:6], subnet, world_size)
    raise NetworkUnavailable(f"every {SUBNET_PREFIX}.x.0/24 subnet is in use on this host")


BUCKET_S = 0.0005
"""tbf's bucket holds this much of the link's traffic: bytes in it leave at once, so a
message sent after a pause passes that many bytes free. A real link has no such allowance:
every byte takes its time on the wire. Measured (two namespaces, both directions shaped,
one 256 KiB exchange every 15 ms, median of 55; the wire's own time for its 274 KB of
frames in brackets): 1 Gbit/s 2.16 ms (2.19), 500 Mbit/s 4.27 (4.38), 200 Mbit/s 11.0
(11.0), 100 Mbit/s 21.5 (21.9). A bucket of 2 ms of traffic, as before, passed the whole
exchange at 1 Gbit/s in 0.50 ms, as fast as no link at all (0.45)."""
MIN_BUCKET = 16 * 1024
"""...but at least this many bytes, so that the rate is reached: at 1 Gbit/s a 16 KiB
bucket (smaller than one offloaded segment of 64 KiB) made the same exchange 3.5 ms."""


def bucket(bandwidth_bps: float) -> int:
    """tbf's bucket in bytes for a link of ``bandwidth_bps`` bits a second (see
    :data:`BUCKET_S`)."""
    return max(int(bandwidth_bps / 8 * BUCKET_S), MIN_BUCKET)


GSO_DEFAULT = 65536
"""Linux's own limit on an offloaded IPv4 packet: buckets that hold it leave it alone."""
FRAME_SHARE = 0.9
"""Share of a bucket that one offloaded packet's payload may fill: tbf counts a packet of
``n`` segments as its bytes plus ``n − 1`` copies of its headers (66 bytes a 1448-byte
segment, 4.6 %), and the rest is margin for TCP options."""


def gso_cap(devices: tuple[DeviceSpec, ...]) -> int | None:
    """The largest offloaded (GSO) packet, in bytes, that every shaped link's bucket holds
    whole; None where no link is shaped.

    TCP hands a link packets of up to 64 KiB and leaves cutting them to the frames the wire
    carries to the network card (TSO on the sender, GRO on the receiver). tbf cuts a packet
    larger than its bucket into single frames itself, and every frame then crosses the
    namespaces' path one by one (qdiscs, veth, bridge, the peer's TCP) on the host's CPUs,
    the devices' own: 256 KiB exchanged at 1 Gbit/s (a 62.5 KB bucket) took each device
    1.8 ms of CPU instead of 0.3 ms. Packets that fit the bucket pass whole, as they do on
    an offloading card, and the rate stays the same. Any packet may cross any device's
    downlink, so the smallest bucket decides."""
    buckets = [bucket(d.bandwidth_bps) for d in devices if d.bandwidth_bps is not None]
    if not buckets:
        return None
    size = int(min(buckets) * FRAME_SHARE) // 1024 * 1024
    return size if size < GSO_DEFAULT else None


def _cap_gso(prefix: list[str], dev: str, size: int | None) -> None:
    """Offloaded packets on ``dev`` of at most ``size`` bytes (see :func:`gso_cap`); an
    ``ip`` without the setting leaves them as they are (the rate is right, the CPU dearer)."""
    if size is not None:
        with contextlib.suppress(NetworkUnavailable):
            _run(*prefix, "link", "set", "dev", dev, "gso_max_size", str(size))


def _shape(prefix: list[str], dev: str, device: DeviceSpec, netem: bool) -> None:
    """Root qdisc on ``dev``: netem for the delay (when ``netem``), tbf below it for the rate."""
    tc = [*prefix, "qdisc", "add", "dev", dev]
    rate = None
    if device.bandwidth_bps is not None:
        burst = bucket(device.bandwidth_bps)
        rate = ["tbf", "rate", f"{int(device.bandwidth_bps)}bit", "burst", str(burst)]
        rate += ["latency", "50ms"]
    if device.latency_s and netem:
        _run(*tc, "root", "handle", "1:", "netem", "delay", f"{round(device.latency_s * 1e6)}us")
        if rate:
            _run(*tc, "parent", "1:1", "handle", "10:", *rate)
    elif rate:
        _run(*tc, "root", "handle", "1:", *rate)


def _netem_available(prefix: list[str], dev: str) -> bool:
    """Probe for the netem qdisc (often built as a module, sometimes absent)."""
    try:
        _run(*prefix, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1us")
    except NetworkUnavailable as e:
        if "unknown" in str(e).lower():
            return False
        raise
    _run(*prefix, "qdisc", "del", "dev", dev, "root")
    return True


def setup_network(plan: NetworkPlan, devices: tuple[DeviceSpec, ...]) -> bool:
    """Create the bridge, namespaces, veths, addresses and shaping. Returns whether the
    kernel delays packets (netem); False where some device declares a latency and the kernel
    has no netem (the caller then adds latency elsewhere) or where none declares one. On
    failure removes what it made and raises :class:`NetworkUnavailable`."""
    netem = any(d.latency_s for d in devices)
    gso = gso_cap(devices)
    try:
        _run("ip", "link", "add", plan.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{plan.bridge_ip}/24", "dev", plan.bridge)
        _run("ip", "link", "set", plan.bridge, "up")
        for i, device in enumerate(devices):
            ns, host = plan.namespace(i), plan.host_veth(i)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _run("ip", "link", "set", host, "master", plan.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{plan.ip(i)}/24", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if i == 0 and netem:
                netem = _netem_available(["tc"], host)
            _shape(["tc", "-n", ns], IFNAME, device, netem)  # the device's uplink
            _shape(["tc"], host, device, netem)  # and its downlink
            _cap_gso(["ip", "-n", ns], IFNAME, gso)
            _cap_gso(["ip"], host, gso)
    except NetworkUnavailable:
        teardown_network(plan.namespaces, plan.links)
        raise
    return netem


def _namespace_pids(ns: str) -> list[int]:
    try:
        return [int(p) for p in _run("ip", "netns", "pids", ns).split()]
    except NetworkUnavailable:
        return []


def teardown_network(namespaces: list[str], links: list[str]) -> list[str]:
    """Kill processes left in the namespaces, delete them and the root-side links. Missing
    pieces are fine; returns what could not be removed."""
    problems: list[str] = []
    existing = set(list_namespaces())
    for ns in namespaces:
        if ns not in existing:
            continue
        for pid in _namespace_pids(ns):
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        try:
            _run("ip", "netns", "del", ns)
        except NetworkUnavailable as e:
            problems.append(str(e))
    for link in links:
        if os.path.exists(f"/sys/class/net/{link}"):
            try:
                _run("ip", "link", "del", link)
            except NetworkUnavailable as e:
                if os.path.exists(f"/sys/class/net/{link}"):  # a veth may vanish with its peer
                    problems.append(str(e))
    return problems


def list_namespaces() -> list[str]:
    """Names of the named network namespaces on this host."""
    for directory in NETNS_DIRS:
        if os.path.isdir(directory):
            return sorted(os.listdir(directory))
    return []


def enter_namespace(name: str) -> None:
    """Move the calling thread, and every thread it creates afterwards, into namespace
    ``name``. Call it before any socket is opened."""
    for directory in NETNS_DIRS:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            break
    else:
        raise RuntimeError(f"network namespace {name!r} does not exist")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns = getattr(os, "setns", None)  # Python ≥ 3.12
        if setns is not None:
            setns(fd, CLONE_NEWNET)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"setns({name}): {os.strerror(code)}")
    finally:
        os.close(fd)
