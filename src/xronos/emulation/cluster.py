"""Cluster specs: which devices an emulated (or real) cluster has and how fast each one is.

A spec is a TOML file, one ``[[device]]`` table per device::

    name = "my-cluster"

    [[device]]
    name = "hub"
    cores = 1              # CPU set size = torch threads
    cpu_quota = 0.4        # fraction of those cores the device may use
    memory = "2GiB"        # cap (optional)
    bandwidth = "100Mbit"  # link shaping (optional)
    latency = "2ms"        # one-way latency of the device's link (optional)

or the name of a preset (``ci-2dev``, ``ci-2dev-mem``, ``edge-3dev``, ``edge-4dev``,
``default``). A device's compute capacity is ``cores × cpu_quota`` CPUs. Every mistake is
reported as one line of the form ``<file>: <field>: <what is wrong>; <the fix>``.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from xronos.emulation.units import parse_bandwidth, parse_bytes, parse_duration
from xronos.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
NAME_RULE = "1-32 letters, digits, '-' or '_', starting with a letter or digit"
MIN_MEMORY_BYTES = 16 * 1024**2
DEVICE_KEYS = ("name", "cores", "cpu_quota", "memory", "bandwidth", "latency")
CLUSTER_KEYS = ("name", "device")


@dataclass(frozen=True)
class DeviceSpec:
    """One emulated device. Its compute capacity is ``cores × cpu_quota`` CPUs."""

    name: str
    """Unique within the cluster; used in cgroup names, so :data:`NAME_RULE` applies."""
    cores: int = 1
    """Size of the device's CPU set, and the number of torch threads its worker uses."""
    cpu_quota: float = 1.0
    """Fraction of those cores the device may use, in (0, 1]."""
    memory_bytes: int | None = None
    """Memory cap, or None for no cap."""
    bandwidth_bps: float | None = None
    """Bandwidth of the device's link in bits per second, or None for unshaped."""
    latency_s: float | None = None
    """One-way latency of the device's link in seconds, or None for none added."""

    def __post_init__(self) -> None:
        where = f"device {self.name!r}" if isinstance(self.name, str) else "device"
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise UserError(f"{where}.name: {self.name!r} is not a valid name; use {NAME_RULE}")
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1:
            raise UserError(f"{where}.cores: {self.cores!r} is not a whole number ≥ 1; e.g. 2")
        quota = self.cpu_quota
        if isinstance(quota, bool) or not isinstance(quota, (int, float)) or not 0 < quota <= 1:
            raise UserError(
                f"{where}.cpu_quota: {quota!r} is outside (0, 1]; give the fraction of the "
                "device's cores it may use, e.g. 0.4 (add cores for a faster device)"
            )
        object.__setattr__(self, "cpu_quota", float(quota))
        if self.memory_bytes is not None and self.memory_bytes < MIN_MEMORY_BYTES:
            raise UserError(
                f"{where}.memory: {self.memory_bytes} bytes is too small for a worker; "
                'give at least 16MiB, e.g. memory = "2GiB", or leave it out for no cap'
            )
        if self.bandwidth_bps is not None and self.bandwidth_bps < 1000:
            raise UserError(
                f"{where}.bandwidth: {self.bandwidth_bps:g} bit/s is too low; give at least "
                '1kbit, e.g. bandwidth = "100Mbit", or leave it out for an unshaped link'
            )
        if self.latency_s is not None and not 0 <= self.latency_s <= 10:
            raise UserError(
                f"{where}.latency: {self.latency_s:g} s is outside [0, 10 s]; "
                'e.g. latency = "2ms", or leave it out'
            )

    @property
    def capacity(self) -> float:
        """CPUs' worth of compute the device has: ``cores × cpu_quota``."""
        return self.cores * self.cpu_quota

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ClusterSpec:
    """A named, ordered set of devices; device ``i`` becomes rank ``i``."""

    name: str
    devices: tuple[DeviceSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices:
            raise UserError(
                f"cluster {self.name!r}: it has no devices; add at least one [[device]] table"
            )
        seen: set[str] = set()
        for device in self.devices:
            if device.name in seen:
                raise UserError(
                    f"cluster {self.name!r}: device name {device.name!r} appears twice; "
                    "give every device a unique name"
                )
            seen.add(device.name)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def has_links(self) -> bool:
        """True when some device declares a bandwidth or a latency for its link."""
        return any(d.bandwidth_bps is not None or d.latency_s for d in self.devices)

    def with_link(self, bandwidth_bps: float | None, latency_s: float | None) -> ClusterSpec:
        """The same cluster with every device on this link (``--bandwidth``/``--latency``).

        A None argument keeps each device's own value for that quantity, so ``--latency``
        alone adds a delay to the links a spec declares without changing their rates.
        Raises :class:`UserError` for values no link can have (see :class:`DeviceSpec`).
        """
        devices = tuple(
            replace(
                d,
                bandwidth_bps=d.bandwidth_bps if bandwidth_bps is None else bandwidth_bps,
                latency_s=d.latency_s if latency_s is None else latency_s,
            )
            for d in self.devices
        )
        return ClusterSpec(self.name, devices)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "devices": [d.to_dict() for d in self.devices]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """Inverse of :meth:`to_dict` (base units: bytes, bit/s, seconds)."""
        return cls(str(data["name"]), tuple(DeviceSpec(**d) for d in data["devices"]))


def link_from_flags(
    bandwidth: str | None, latency: str | None
) -> tuple[float | None, float | None]:
    """``--bandwidth RATE`` and ``--latency T`` (the cluster TOML's units) in bit/s and
    seconds, for :meth:`ClusterSpec.with_link`; None where a flag was not given.

    Raises:
        UserError: one line naming the flag, the value and the accepted forms.
    """
    rate = delay = None
    try:
        if bandwidth is not None:
            rate = parse_bandwidth(bandwidth)
        if latency is not None:
            delay = parse_duration(latency)
    except ValueError as e:
        flag = "--latency" if rate is not None or bandwidth is None else "--bandwidth"
        raise UserError(f"{flag}: {e}") from None
    if rate is not None and rate < 1000:
        raise UserError(f"--bandwidth {bandwidth}: below 1kbit/s; give e.g. 200Mbit or 1Gbit")
    if delay is not None and not 0 <= delay <= 10:
        raise UserError(f"--latency {latency}: outside [0, 10 s]; give e.g. 2ms")
    return rate, delay


@dataclass(frozen=True)
class LinkRequest:
    """What ``--network/--no-network``, ``--bandwidth`` and ``--latency`` ask for."""

    network: bool | None
    """True: emulate the links or stop with an error; None: emulate the links a cluster
    declares where possible; False: loopback."""
    bandwidth_bps: float | None = None
    latency_s: float | None = None

    @classmethod
    def from_flags(
        cls, network: bool | None, bandwidth: str | None, latency: str | None
    ) -> LinkRequest:
        """Parse and check the flags; raises a one-line :class:`UserError`."""
        given = bandwidth is not None or latency is not None
        if network is False and given:
            raise UserError(
                "--bandwidth/--latency give every device a link and --no-network switches "
                "links off; drop one of them"
            )
        rate, delay = link_from_flags(bandwidth, latency)
        return cls(True if given else network, rate, delay)

    def apply(self, cluster: ClusterSpec) -> ClusterSpec:
        """``cluster`` with every device on the requested link (unchanged if none given)."""
        if self.bandwidth_bps is None and self.latency_s is None:
            return cluster
        return cluster.with_link(self.bandwidth_bps, self.latency_s)


# ----------------------------------------------------------------------------- TOML


def _unknown_key(where: str, key: str, known: tuple[str, ...]) -> UserError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return UserError(f"{where}: unknown key {key!r}; {hint}known keys: {', '.join(known)}")


def _device_from_table(table: Any, index: int, source: str) -> DeviceSpec:
    if not isinstance(table, dict):
        raise UserError(f"{source}: device #{index}: must be a table; write [[device]] blocks")
    raw_name = table.get("name")
    if not isinstance(raw_name, str):
        raise UserError(
            f'{source}: device #{index}.name: missing or not a string; add name = "hub"'
        )
    where = f"{source}: device {raw_name!r}"
    for key in table:
        if key not in DEVICE_KEYS:
            raise _unknown_key(where, key, DEVICE_KEYS)
    values: dict[str, Any] = {"name": raw_name}
    if "cores" in table:
        values["cores"] = table["cores"]
    if "cpu_quota" in table:
        values["cpu_quota"] = table["cpu_quota"]
    parsers: dict[str, tuple[str, Callable[[object], Any]]] = {
        "memory": ("memory_bytes", parse_bytes),
        "bandwidth": ("bandwidth_bps", parse_bandwidth),
        "latency": ("latency_s", parse_duration),
    }
    for key, (field, parse) in parsers.items():
        if key in table:
            try:
                values[field] = parse(table[key])
            except ValueError as e:
                raise UserError(f"{where}.{key}: {e}") from None
    try:
        return DeviceSpec(**values)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None


def parse_cluster(data: Mapping[str, Any], source: str, default_name: str) -> ClusterSpec:
    """Build a spec from a parsed TOML document; ``source`` names it in error messages."""
    for key in data:
        if key not in CLUSTER_KEYS:
            raise _unknown_key(source, key, CLUSTER_KEYS)
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name.strip():
        raise UserError(f'{source}: name: {name!r} is not a non-empty string; e.g. name = "lab"')
    tables = data.get("device", [])
    if not isinstance(tables, list) or not tables:
        raise UserError(f"{source}: device: no devices; add at least one [[device]] table")
    devices = tuple(_device_from_table(t, i + 1, source) for i, t in enumerate(tables))
    try:
        return ClusterSpec(name, devices)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None


def load_cluster(spec: str | os.PathLike[str]) -> ClusterSpec:
    """A preset name (see :func:`list_presets`) or the path of a cluster TOML file."""
    text = os.fspath(spec)
    if text in PRESETS:
        return PRESETS[text]()
    path = Path(text)
    if not path.is_file():
        raise UserError(
            f"cluster {text!r}: no such preset or file; use one of {', '.join(PRESETS)} "
            "or the path of a cluster .toml file"
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e}); fix the syntax at that line") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read it ({e}); check the path and permissions") from None
    return parse_cluster(data, str(path), path.stem)


# ----------------------------------------------------------------------------- presets


def ci_2dev() -> ClusterSpec:
    """Two single-core devices for a 2-core host: ``fast`` (quota 1.0) and ``slow`` (0.4)."""
    return ClusterSpec("ci-2dev", (DeviceSpec("fast", 1, 1.0), DeviceSpec("slow", 1, 0.4)))


CI_2DEV_MEM_CAP = 740 * 1024**2  # each ci-2dev-mem device's memory: see ci_2dev_mem


def ci_2dev_mem() -> ClusterSpec:
    """``ci-2dev``'s devices with 740 MiB each: neither can fine-tune ``small`` alone at the
    ``ci-2dev`` workload (batch 4 × 64, full fine-tuning, AdamW); both together can. The
    cap, from resident memory (MiB = 2**20 bytes):

    - the model: 20,976,128 parameters (tied embedding); fp32 weights, gradients and
      AdamW's two moments: 4 × 80 = 320 MiB; the memory model
      (:mod:`xronos.planner.memory`) adds 52 MiB of the units' activations and 76 MiB
      every device needs (12 of activations, 64 for the runtime's growth): 448 MiB;
    - the runtime, measured: a device process (interpreter, torch, gloo) with no model
      alive resides at 326–329 MiB;
    - whole model: 777 MiB predicted, 777–799 measured (peak RSS) — over the cap;
    - under it: ``xronos`` (70–80 % of the units on ``fast``) 638–703 / 480–545 MiB
      predicted, 665–730 / 556–585 measured; ``tp-even`` 591 / 591, 610–622 measured.

    The emulated cap (a memory cgroup) counts only what is charged to the device's group,
    80–100 MiB less than its resident memory (library pages another process read first);
    the kernel alone would let ``single`` run, the planner refuses it."""
    fast, slow = ci_2dev().devices
    cap = CI_2DEV_MEM_CAP
    return ClusterSpec(
        "ci-2dev-mem", (replace(fast, memory_bytes=cap), replace(slow, memory_bytes=cap))
    )


def ci_2dev_even() -> ClusterSpec:
    """``ci-2dev`` with both cores at full speed: the control for the benchmark. Two equal
    devices split evenly reach every barrier together but for the host's own noise, so
    their idle ratio is the floor no split can get under on that host."""
    return ClusterSpec("ci-2dev-even", (DeviceSpec("core0", 1, 1.0), DeviceSpec("core1", 1, 1.0)))


def edge_3dev() -> ClusterSpec:
    """Three single-core devices with speeds 1 : 0.5 : 0.25 (a NUC, a gateway, a Pi).

    Fits a 2-core host without contention: ``nuc`` gets one CPU, ``gateway`` and ``pi``
    share the other (0.5 + 0.25 of it)."""
    return ClusterSpec(
        "edge-3dev",
        (
            DeviceSpec("nuc", 1, 1.0, latency_s=0.001),
            DeviceSpec("gateway", 1, 0.5, latency_s=0.001),
            DeviceSpec("pi", 1, 0.25, latency_s=0.002),
        ),
    )


def edge_4dev() -> ClusterSpec:
    """Four devices for a 16-core host: 4/4/2/2 cores at quotas 1.0/0.6/1.0/0.5, two on
    1 Gbit links and two on 100 Mbit links (12 CPUs in total)."""
    gib = 1024**3
    return ClusterSpec(
        "edge-4dev",
        (
            DeviceSpec("nuc", 4, 1.0, 8 * gib, 1e9, 0.0005),
            DeviceSpec("car", 4, 0.6, 8 * gib, 1e9, 0.0005),
            DeviceSpec("gateway", 2, 1.0, 4 * gib, 1e8, 0.002),
            DeviceSpec("hub", 2, 0.5, 2 * gib, 1e8, 0.002),
        ),
    )


def default_cluster(host_cpus: int | None = None) -> ClusterSpec:
    """A heterogeneous cluster sized to this host's usable CPUs, packed without contention.

    1 CPU: two devices at quotas 0.6/0.3 of it; 2–3 CPUs: three single-core devices at
    1.0/0.6/0.3; 4+ CPUs: four devices of ``cpus // 4`` cores at 1.0/0.75/0.5/0.25."""
    n = host_cpus if host_cpus is not None else len(os.sched_getaffinity(0))
    quotas: tuple[float, ...]
    if n <= 1:
        quotas, cores = (0.6, 0.3), 1
    elif n < 4:
        quotas, cores = (1.0, 0.6, 0.3), 1
    else:
        quotas, cores = (1.0, 0.75, 0.5, 0.25), n // 4
    devices = tuple(DeviceSpec(f"dev{i}", cores, q) for i, q in enumerate(quotas))
    return ClusterSpec("default", devices)


PRESETS: dict[str, Callable[[], ClusterSpec]] = {
    "ci-2dev": ci_2dev,
    "ci-2dev-even": ci_2dev_even,
    "ci-2dev-mem": ci_2dev_mem,
    "edge-3dev": edge_3dev,
    "edge-4dev": edge_4dev,
    "default": default_cluster,
}


def list_presets() -> list[str]:
    """Names accepted by :func:`load_cluster` besides file paths."""
    return list(PRESETS)
