"""``--network/--no-network``, ``--bandwidth`` and ``--latency``: parsing, the RunConfig
fields, ``ClusterSpec.with_link``, the report's link lines, and the one-line errors."""

from __future__ import annotations

import pytest

from xronos.cli import build_parser, main
from xronos.emulation import ClusterSpec, DeviceSpec, Emulator, load_cluster
from xronos.emulation import netns as netns_mod
from xronos.emulation.cluster import LinkRequest, link_from_flags
from xronos.emulation.netns import NetworkPlan
from xronos.emulation.report import ReportInput, emulator_report, link_text, links_in_force
from xronos.errors import UserError
from xronos.run.launch import run_on_cluster
from xronos.runconfig import build_config, field_docs


def test_flags_parse_in_the_cluster_files_units() -> None:
    assert link_from_flags("200Mbit", "2ms") == (pytest.approx(2e8), pytest.approx(0.002))
    assert link_from_flags("1Gbit", None) == (pytest.approx(1e9), None)
    assert link_from_flags(None, "500us") == (None, pytest.approx(5e-4))
    assert link_from_flags(None, None) == (None, None)


@pytest.mark.parametrize(
    ("bandwidth", "latency", "message"),
    [
        ("fast", None, "--bandwidth: cannot read 'fast'"),
        ("100Mbps", None, "--bandwidth: 'Mbps' in '100Mbps' is ambiguous"),
        ("10bit", None, "--bandwidth 10bit: below 1kbit/s"),
        (None, "2", "--latency: '2' has no unit"),
        ("1Gbit", "2 parsecs", "--latency: unknown unit"),
        (None, "11s", "--latency 11s: outside [0, 10 s]"),
    ],
)
def test_bad_flag_values_get_one_line_naming_the_flag(
    bandwidth: str | None, latency: str | None, message: str
) -> None:
    with pytest.raises(UserError) as e:
        link_from_flags(bandwidth, latency)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_with_link_gives_every_device_the_link_and_keeps_the_rest() -> None:
    cluster = load_cluster("edge-4dev")
    both = cluster.with_link(2e8, 0.001)
    assert [(d.bandwidth_bps, d.latency_s) for d in both.devices] == [(2e8, 0.001)] * 4
    assert [d.cpu_quota for d in both.devices] == [d.cpu_quota for d in cluster.devices]
    assert both.name == cluster.name
    # a None keeps each device's own value of that quantity
    only_latency = cluster.with_link(None, 0.01)
    assert [d.bandwidth_bps for d in only_latency.devices] == [1e9, 1e9, 1e8, 1e8]
    assert {d.latency_s for d in only_latency.devices} == {0.01}


def test_has_links() -> None:
    assert not load_cluster("ci-2dev").has_links
    assert load_cluster("edge-3dev").has_links  # latencies only
    assert load_cluster("ci-2dev").with_link(1e9, None).has_links


def test_link_request() -> None:
    assert LinkRequest.from_flags(None, None, None) == LinkRequest(None)
    assert LinkRequest.from_flags(False, None, None) == LinkRequest(False)
    # a link given on the command line turns the network on, and it must then work
    assert LinkRequest.from_flags(None, "1Gbit", None) == LinkRequest(True, 1e9, None)
    with pytest.raises(UserError, match="--no-network switches links off"):
        LinkRequest.from_flags(False, None, "1ms")
    cluster = load_cluster("ci-2dev")
    assert LinkRequest(None).apply(cluster) is cluster


# ----------------------------------------------------------------------------- RunConfig


def test_runconfig_fields_are_flags_with_help() -> None:
    docs = field_docs()
    assert {"network", "bandwidth", "latency"} <= docs.keys()
    args = build_parser().parse_args(
        ["finetune", "--no-network", "--bandwidth", "200Mbit", "--latency", "1ms"]
    )
    assert (args.network, args.bandwidth, args.latency) == (False, "200Mbit", "1ms")
    assert build_parser().parse_args(["finetune"]).network is None


def test_runconfig_link() -> None:
    cfg = build_config({}, {"bandwidth": "200Mbit", "latency": "2ms"})
    assert cfg.link() == LinkRequest(True, 2e8, 0.002)
    assert build_config({}, {}).link() == LinkRequest(None)
    assert build_config({"network": False}, {}).link() == LinkRequest(False)


@pytest.mark.parametrize(
    ("toml", "flags", "message"),
    [
        ({}, {"bandwidth": "lots"}, "--bandwidth: cannot read 'lots'"),
        ({"network": False}, {"latency": "2ms"}, "--bandwidth/--latency give every device"),
        ({}, {"network": True, "emulate": False}, "--network, --bandwidth and --latency need"),
    ],
)
def test_runconfig_rejects_bad_link_settings(
    toml: dict[str, object], flags: dict[str, object], message: str
) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        build_config(toml, flags)


def test_bench_flags() -> None:
    args = build_parser().parse_args(
        ["bench", "--bandwidth", "1Gbit", "--latency", "2ms", "--no-network"]
    )
    assert (args.bandwidth, args.latency, args.no_network) == ("1Gbit", "2ms", True)
    assert build_parser().parse_args(["bench"]).no_network is False


def test_profile_takes_the_link_flags_and_refuses_contradictions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `xronos profile` measures the links a run would talk over, so it takes the same flags
    args = build_parser().parse_args(["profile", "--bandwidth", "200Mbit", "--latency", "2ms"])
    assert (args.bandwidth, args.latency, args.no_network) == ("200Mbit", "2ms", False)
    # contradictions stop before anything is measured: one line, non-zero exit
    for argv, needle in (
        (["--bandwidth", "1Gbit", "--no-network"], "--no-network switches links off"),
        (["--latency", "2ms", "--no-emulation"], "drop --no-emulation"),
        (["--bandwidth", "fast"], "--bandwidth: cannot read 'fast'"),
    ):
        assert main(["profile", "--model", "tiny", *argv]) != 0
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err


# ----------------------------------------------------------------------------- report


def test_link_text() -> None:
    assert link_text(1e9, 0.002, emulated=True, netem=False) == (
        "1 Gbit/s, 2 ms (tbf + latency in the communication layer)"
    )
    assert link_text(1e9, 0.002, emulated=True, netem=True) == "1 Gbit/s, 2 ms (tbf + netem)"
    assert link_text(None, 0.002, emulated=True, netem=False) == (
        "2 ms (latency in the communication layer)"
    )
    assert link_text(2e8, None, emulated=True, netem=False) == "200 Mbit/s (tbf)"
    assert link_text(None, None, emulated=True, netem=False) == "unshaped"
    assert link_text(1e9, 0.002, emulated=False, netem=False) == (
        "not emulated (declared 1 Gbit/s, 2 ms)"
    )
    assert link_text(None, None, emulated=False, netem=False) == ""


def _report(cluster: ClusterSpec, network: bool, net: NetworkPlan | None) -> list[str]:
    n = cluster.world_size
    return emulator_report(
        ReportInput(
            cluster=cluster,
            host_cpus=(0, 1),
            cpus=((0,),) * n,
            period_us=10_000,
            cpu_mechanism=("none",) * n,
            notes={"network": "iproute2 (`ip`, `tc`) is not installed"} if net is None else {},
            hierarchy_version=None,
            groups=(None,) * n,
            network=network,
            net=net,
            bridge_ip=net.bridge_ip if net else None,
            net_notes=(),
        )
    )


def test_report_states_each_devices_link() -> None:
    cluster = ClusterSpec(
        "c", (DeviceSpec("a", latency_s=0.002, bandwidth_bps=1e9), DeviceSpec("b"))
    )
    lines = "\n".join(_report(cluster, True, NetworkPlan("abc123", 7, 2)))
    assert "latency by the communication layer (this kernel has no netem)" in lines
    assert "a: cpus 0" in lines
    assert "ip 10.213.7.10, link: 1 Gbit/s, 2 ms (tbf + latency in the communication layer)" in (
        lines
    )
    assert "ip 10.213.7.11, link: unshaped" in lines

    unshaped = "\n".join(_report(cluster, True, None))
    assert "network: not emulated (iproute2" in unshaped
    assert "link: not emulated (declared 1 Gbit/s, 2 ms)" in unshaped
    off = "\n".join(_report(cluster, False, None))
    assert "network: not requested" in off and "link: not emulated" in off


def test_links_in_force_for_bench_json() -> None:
    cluster = ClusterSpec("c", (DeviceSpec("a", latency_s=0.002), DeviceSpec("b")))
    got = links_in_force(cluster, emulated=True, netem=False)
    assert got[0]["latency_by"] == "communication layer" and got[0]["emulated"]
    assert got[1]["link"] == "unshaped" and got[1]["latency_by"] is None
    assert links_in_force(cluster, emulated=False, netem=False)[0]["link"].startswith(
        "not emulated"
    )


# ----------------------------------------------------------------------------- no network


def _no_iproute2(run_id: str, world_size: int) -> NetworkPlan:
    raise netns_mod.NetworkUnavailable("iproute2 (`ip`, `tc`) is not installed")


def test_asked_for_network_without_iproute2_stops_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setattr(netns_mod, "plan_network", _no_iproute2)
    cluster = ClusterSpec("c", (DeviceSpec("a", latency_s=0.002),))
    emu = Emulator(
        cluster,
        "t-net-required",
        network=True,
        require_network=True,
        mechanism="none",
        hierarchy=None,
        check_speed=False,
        state_dir=str(tmp_path),
    )
    with pytest.raises(UserError) as e:
        emu.start()
    assert str(e.value).startswith("network emulation: iproute2")
    assert "--no-network" in str(e.value) and "\n" not in str(e.value)


def test_declared_links_without_iproute2_run_unshaped_and_say_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setattr(netns_mod, "plan_network", _no_iproute2)
    cluster = ClusterSpec("c", (DeviceSpec("a", latency_s=0.002),))
    with Emulator(
        cluster,
        "t-net-default",
        network=True,
        mechanism="none",
        hierarchy=None,
        check_speed=False,
        state_dir=str(tmp_path),
    ) as emu:
        report = "\n".join(emu.report())
        assert emu.net is None and emu.comm_latencies() is None  # no half-emulated links
    assert "link: not emulated (declared 2 ms)" in report


def test_network_without_device_emulation_is_a_user_error() -> None:
    with pytest.raises(UserError, match="network emulation needs device emulation"):
        run_on_cluster(print, [None], load_cluster("ci-2dev").with_link(1e9, None), emulate=False,
                       network=True)  # fmt: skip
