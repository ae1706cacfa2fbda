"""Cluster specs: TOML parsing and its error messages, units, presets, CPU assignment."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from xronos.emulation import ClusterSpec, DeviceSpec, list_presets, load_cluster
from xronos.emulation.cluster import default_cluster
from xronos.emulation.slot import assign_cpus
from xronos.emulation.units import parse_bandwidth, parse_bytes, parse_duration
from xronos.errors import UserError

GOOD = """
name = "lab"

[[device]]
name = "hub"
cores = 1
cpu_quota = 0.4
memory = "2GiB"
bandwidth = "100Mbit"
latency = "2ms"

[[device]]
name = "nuc"
cores = 2
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return str(path)


def test_toml_file_parses_to_base_units(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, GOOD))
    assert cluster.name == "lab"
    hub, nuc = cluster.devices
    assert hub == DeviceSpec("hub", 1, 0.4, 2 * 1024**3, 100e6, 0.002)
    # Omitted fields take the defaults: full quota, no cap, unshaped link.
    assert nuc == DeviceSpec("nuc", 2, 1.0, None, None, None)
    assert nuc.capacity == 2.0 and hub.capacity == pytest.approx(0.4)


def test_to_dict_round_trips(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, GOOD))
    assert ClusterSpec.from_dict(cluster.to_dict()) == cluster
    assert cluster.to_dict()["devices"][0]["memory_bytes"] == 2 * 1024**3


def test_cluster_name_defaults_to_file_stem(tmp_path: Path) -> None:
    path = tmp_path / "garage.toml"
    path.write_text('[[device]]\nname = "pi"\n')
    assert load_cluster(str(path)).name == "garage"


# Each bad input: (the offending TOML, fragments the one-line message must contain: the
# field, what is wrong, and the fix).
BAD = {
    "unknown device key": (
        '[[device]]\nname = "hub"\ncpu_qouta = 0.5\n',
        ["device 'hub'", "unknown key 'cpu_qouta'", "did you mean 'cpu_quota'"],
    ),
    "unknown top-level key": (
        '[[devices]]\nname = "hub"\n',
        ["unknown key 'devices'", "did you mean 'device'"],
    ),
    "quota above 1": (
        '[[device]]\nname = "hub"\ncpu_quota = 1.5\n',
        ["device 'hub'.cpu_quota", "1.5 is outside (0, 1]", "e.g. 0.4"],
    ),
    "quota zero": (
        '[[device]]\nname = "hub"\ncpu_quota = 0\n',
        ["device 'hub'.cpu_quota", "outside (0, 1]"],
    ),
    "cores zero": (
        '[[device]]\nname = "hub"\ncores = 0\n',
        ["device 'hub'.cores", "not a whole number ≥ 1"],
    ),
    "cores fractional": (
        '[[device]]\nname = "hub"\ncores = 1.5\n',
        ["device 'hub'.cores", "1.5"],
    ),
    "memory unit": (
        '[[device]]\nname = "hub"\nmemory = "2 gigs"\n',
        ["device 'hub'.memory", "unknown unit 'gigs'", "2GiB"],
    ),
    "memory too small": (
        '[[device]]\nname = "hub"\nmemory = "1MiB"\n',
        ["device 'hub'.memory", "too small", "16MiB"],
    ),
    "ambiguous bandwidth": (
        '[[device]]\nname = "hub"\nbandwidth = "100Mbps"\n',
        ["device 'hub'.bandwidth", "ambiguous", "100Mbit"],
    ),
    "latency without unit": (
        '[[device]]\nname = "hub"\nlatency = 5\n',
        ["device 'hub'.latency", "has no unit", "2ms"],
    ),
    "duplicate names": (
        '[[device]]\nname = "hub"\n[[device]]\nname = "hub"\n',
        ["'hub' appears twice", "unique name"],
    ),
    "missing name": (
        '[[device]]\nname = "hub"\n[[device]]\ncores = 2\n',
        ["device #2.name", "missing", 'name = "hub"'],
    ),
    "bad name": (
        '[[device]]\nname = "my hub"\n',
        ["'my hub'", "not a valid name", "letters, digits"],
    ),
    "no devices": ('name = "x"\n', ["no devices", "[[device]]"]),
    "syntax": ('[[device]\nname = "hub"\n', ["not valid TOML", "line 1"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_toml_gives_one_line_naming_file_field_and_fix(tmp_path: Path, case: str) -> None:
    text, fragments = BAD[case]
    path = write(tmp_path, text)
    with pytest.raises(UserError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in message


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(UserError, match=r"no such preset or file; use one of ci-2dev, .*\.toml"):
        load_cluster("edge-99dev")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000), (4096, 4096)],
)
def test_parse_bytes(text: object, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("100Mbit", 1e8), ("1Gbit", 1e9), ("500kbit", 5e5), ("12.5MB/s", 1e8), ("10Mb/s", 1e7)],
)
def test_parse_bandwidth(text: str, expected: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "expected"), [("2ms", 2e-3), ("500us", 5e-4), ("0.1s", 0.1), ("3 ms", 3e-3)]
)
def test_parse_duration(text: str, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)


def test_presets_load_and_match_their_description() -> None:
    assert set(list_presets()) >= {"ci-2dev", "edge-3dev", "edge-4dev", "default"}
    ci = load_cluster("ci-2dev")
    assert [(d.name, d.cores, d.cpu_quota) for d in ci.devices] == [
        ("fast", 1, 1.0),
        ("slow", 1, 0.4),
    ]
    even = load_cluster("ci-2dev-even").devices  # the control: same cores, both at full speed
    assert [(d.cores, d.cpu_quota) for d in even] == [(1, 1.0), (1, 1.0)]
    speeds = [d.capacity for d in load_cluster("edge-3dev").devices]
    assert [s / speeds[0] for s in speeds] == pytest.approx([1.0, 0.5, 0.25])
    edge4 = load_cluster("edge-4dev").devices
    assert [d.cores for d in edge4] == [4, 4, 2, 2]
    assert sum(d.cores for d in edge4) <= 16
    assert {d.bandwidth_bps for d in edge4} == {1e9, 1e8}


def cpu_load(cluster: ClusterSpec, host_cpus: int) -> list[float]:
    cpus = assign_cpus(
        [d.cores for d in cluster.devices],
        [d.cpu_quota for d in cluster.devices],
        list(range(host_cpus)),
    )
    load = [0.0] * host_cpus
    for device, assigned in zip(cluster.devices, cpus, strict=True):
        for cpu in assigned:
            load[cpu] += device.cpu_quota
    return load


@pytest.mark.parametrize("host_cpus", [1, 2, 3, 4, 8, 16, 64])
def test_default_preset_fits_the_host_without_contention(host_cpus: int) -> None:
    cluster = default_cluster(host_cpus)
    assert len(cluster.devices) >= 2
    assert len({d.capacity for d in cluster.devices}) == len(cluster.devices)  # heterogeneous
    assert max(cpu_load(cluster, host_cpus)) <= 1.0 + 1e-9


def test_edge_3dev_fits_two_cpus() -> None:
    # 1.0 on one CPU, 0.5 + 0.25 on the other: no device is slowed by another.
    assert max(cpu_load(load_cluster("edge-3dev"), 2)) <= 1.0


def test_assign_cpus_round_robin_when_the_host_is_big_enough() -> None:
    assert assign_cpus([4, 4, 2, 2], [1.0, 0.6, 1.0, 0.5], list(range(16))) == [
        (0, 1, 2, 3),
        (4, 5, 6, 7),
        (8, 9),
        (10, 11),
    ]


def test_assign_cpus_shares_least_loaded_cpus_on_a_small_host() -> None:
    assert assign_cpus([1, 1, 1], [1.0, 0.5, 0.25], [0, 1]) == [(0,), (1,), (1,)]
    # A device that asks for more cores than the host has gets all of them.
    assert assign_cpus([4], [1.0], [2, 5]) == [(2, 5)]


@given(
    st.lists(st.tuples(st.integers(1, 6), st.floats(0.05, 1.0)), min_size=1, max_size=8),
    st.integers(1, 12),
)
def test_assign_cpus_gives_each_device_distinct_host_cpus(
    devices: list[tuple[int, float]], host: int
) -> None:
    host_cpus = [10 + 2 * i for i in range(host)]
    result = assign_cpus([c for c, _ in devices], [q for _, q in devices], host_cpus)
    for (cores, _), cpus in zip(devices, result, strict=True):
        assert len(cpus) == len(set(cpus)) == min(cores, host)
        assert set(cpus) <= set(host_cpus)
    if sum(c for c, _ in devices) <= host:  # enough CPUs: nobody shares
        flat = [c for cpus in result for c in cpus]
        assert len(flat) == len(set(flat))
