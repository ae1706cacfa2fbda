"""Bandwidth emulated in the communication layer (the fallback where no network namespaces
can be made): the model's arithmetic with an injected sleep and clock, the queue that
collectives in flight at once and point-to-point messages share, and how the emulator
chooses, reports and records the fallback."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from xronos.comm.links import LinkDelays, allreduce_rounds, ring_delays
from xronos.comm.mappings import TPGroup
from xronos.emulation import ClusterSpec, DeviceSpec, Emulator
from xronos.emulation import netns as netns_mod
from xronos.emulation.netns import NetworkPlan
from xronos.emulation.report import link_text, links_in_force
from xronos.errors import UserError

MB = 1_000_000


class Clock:
    """A clock that moves only when told (and when something sleeps on it)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _links(latency: tuple[float, ...], rates: tuple[float | None, ...], clock: Clock) -> LinkDelays:
    return LinkDelays(latency, sleep=clock.sleep, clock=clock, bandwidth_bps=rates)


def test_two_ranks_pay_every_byte_once_at_the_link_rate() -> None:
    # 2 ranks, 2 rounds of B/2 bytes per link: the ring moves B bytes over each link
    links = _links((0.0, 0.0), (1e8, 1e8), Clock())
    assert links.allreduce_delay(0, 1 * MB) == pytest.approx(8 * MB / 1e8)  # 80 ms


def test_latency_and_rate_add_per_round() -> None:
    # 3 ranks, 4 rounds (2(P-1)); each link carries 2(P-1)/P · B = 4/3 MB in all
    links = _links((0.001,) * 3, (2e8,) * 3, Clock())
    rounds = allreduce_rounds(3, 3 * MB)
    assert rounds == 4
    expected = (2 * 2 / 3) * 8 * 3 * MB / 2e8 + rounds * 2 * 0.001
    assert links.allreduce_delay(1, 3 * MB) == pytest.approx(expected)


def test_the_slower_link_sets_the_rate_of_a_ring() -> None:
    # a message from i to j crosses i's uplink and j's downlink: 1 Gbit/s into 100 Mbit/s
    # streams at 100 Mbit/s, and in a 2-rank ring both directions touch the slow link
    def delay(rank: int) -> float:  # each rank is a process of its own, with its own queue
        return _links((0.0, 0.0), (1e9, 1e8), Clock()).allreduce_delay(rank, MB)

    assert delay(0) == pytest.approx(delay(1)) == pytest.approx(8 * MB / 1e8)
    # a device without a rate does not limit the ring; the other one still does
    assert _links((0.0, 0.0), (None, 1e8), Clock()).allreduce_delay(0, MB) == pytest.approx(
        8 * MB / 1e8
    )


def test_without_rates_the_ring_is_latencys_alone() -> None:
    latency = (0.001, 0.001, 0.002)
    assert ring_delays(latency, 4, +1, bandwidth_bps=None, round_bytes=MB) == ring_delays(
        latency, 4, +1
    )


def test_allgather_moves_every_other_ranks_part_through_each_link() -> None:
    links = _links((0.0,) * 3, (1e8,) * 3, Clock())
    # 3 ranks: 2 rounds, each link forwards one rank's part per round
    assert links.allgather_delay(0, MB) == pytest.approx(2 * 8 * MB / 1e8)


def test_collectives_in_flight_at_once_share_the_link() -> None:
    # two lanes' all-reduces return at the same moment: the second one's bytes wait for
    # the first one's (not side by side, which would double the link's rate)
    clock = Clock()
    links = _links((0.0, 0.0), (1e8, 1e8), clock)
    first = links.allreduce_delay(0, MB)
    second = links.allreduce_delay(0, MB)
    assert first == pytest.approx(0.08) and second == pytest.approx(0.16)
    # one after the other (the first one's wait over): no queue
    clock.sleep(second)
    assert links.allreduce_delay(0, MB) == pytest.approx(0.08)


def test_subgroups_keep_their_members_rates_and_share_the_queue() -> None:
    links = _links((0.0, 0.0, 0.0), (1e9, 5e8, 1e8), Clock())
    sub = links.among([0, 2])
    assert sub.bandwidth_bps == (1e9, 1e8) and sub.wire is links.wire
    assert sub.active and not LinkDelays((0.0, 0.0), bandwidth_bps=(None, None)).active


def test_rates_must_be_positive_and_one_per_rank() -> None:
    with pytest.raises(ValueError, match="rates"):
        LinkDelays((0.0, 0.0), bandwidth_bps=(1e8, 0.0))
    with pytest.raises(ValueError, match="1 link rates for 2"):
        LinkDelays((0.0, 0.0), bandwidth_bps=(1e8,))


def test_point_to_point_messages_queue_on_the_senders_uplink() -> None:
    clock = Clock()
    links = _links((0.001, 0.002), (1e8, 1e9), clock)
    due: list[float] = []
    links.sender.call_at = lambda at, fn: due.append(at)  # type: ignore[method-assign,assignment,return-value]
    links.send_later(0, 1, lambda: None, nbytes=MB)
    links.send_later(0, 1, lambda: None, nbytes=MB)  # issued at once: behind the first
    hop, transfer = 0.003, 8 * MB / 1e8
    assert due == [pytest.approx(100 + transfer + hop), pytest.approx(100 + 2 * transfer + hop)]
    assert links.message_delay(0, 1, MB) == pytest.approx(hop + transfer)


def test_a_message_without_its_size_is_refused_where_rates_are_emulated() -> None:
    links = LinkDelays((0.0, 0.0), bandwidth_bps=(1e8, 1e8))
    with pytest.raises(ValueError, match="nbytes"):
        links.send_later(0, 1, lambda: None)


def test_tp_group_waits_latency_and_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    clock = Clock()
    group = TPGroup(0, 2, None, links=_links((0.002, 0.002), (1e8, 1e8), clock))
    group.all_reduce(torch.zeros(MB // 4), "x")  # 1 MB of fp32
    # two ranks exchange their whole tensors: the ring's bytes, one hop of latency
    assert clock.slept == [pytest.approx(8 * MB / 1e8 + 0.004)]


def test_concurrent_waits_from_two_threads_are_serialised() -> None:
    # the queue is shared by threads (lanes) of one process; bookings never overlap
    links = LinkDelays((0.0, 0.0), bandwidth_bps=(1e8, 1e8))
    got: list[float] = []
    threads = [
        threading.Thread(target=lambda: got.append(links.allreduce_delay(0, MB))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # four bookings of 80 ms made within a few ms of each other: 80, 160, 240, 320 ms
    assert sorted(round(g / 0.08) for g in got) == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- emulator


def _no_namespaces(run_id: str, world_size: int) -> NetworkPlan:
    raise netns_mod.NetworkUnavailable("`ip netns add` failed: Operation not permitted")


def _emulator(cluster: ClusterSpec, tmp_path: Path, **kw: object) -> Emulator:
    return Emulator(
        cluster,
        "t-fallback",
        network=True,
        mechanism="none",
        hierarchy=None,
        check_speed=False,
        state_dir=str(tmp_path),
        **kw,  # type: ignore[arg-type]
    )


CLUSTER = ClusterSpec(
    "c", (DeviceSpec("a", bandwidth_bps=2e8, latency_s=0.001), DeviceSpec("b", bandwidth_bps=2e8))
)


def test_without_namespaces_the_links_fall_back_to_the_communication_layer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(netns_mod, "plan_network", _no_namespaces)
    with _emulator(CLUSTER, tmp_path, require_network=True, comm_fallback=True) as emu:
        lines = emu.report()
        assert emu.net is None and emu.bridge_ip is None  # loopback, no namespace
        assert emu.links.comm_bandwidths() == (2e8, 2e8)
        assert emu.comm_latencies() == (0.001, 0.0)
        record = emu.links.in_force(CLUSTER)
    network = [line for line in lines if line.startswith("network:")]
    assert network == [
        "network: bandwidth and latency emulated in the communication layer (no network "
        "namespaces here: `ip netns add` failed: Operation not permitted); devices talk "
        "over loopback"
    ]
    assert any(
        "a: cpus" in line
        and line.endswith("link: 200 Mbit/s, 1 ms (bandwidth + latency in the communication layer)")
        for line in lines
    ), lines
    assert record[0]["emulated"] and record[0]["bandwidth_by"] == "communication layer"
    assert record[0]["latency_by"] == "communication layer"
    assert record[1]["link"] == "200 Mbit/s (bandwidth in the communication layer)"


def test_without_the_fallback_an_explicit_request_still_stops(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(netns_mod, "plan_network", _no_namespaces)
    with pytest.raises(UserError, match=r"^network emulation: `ip netns add` failed"):
        _emulator(CLUSTER, tmp_path, require_network=True).start()


def test_namespaces_keep_the_rate_in_the_kernel() -> None:
    # where the kernel shapes the rate, the communication layer adds none
    record = links_in_force(CLUSTER, emulated=True, netem=False)
    assert [r["bandwidth_by"] for r in record] == ["tbf", "tbf"]
    assert link_text(2e8, None, emulated=True, netem=False) == "200 Mbit/s (tbf)"
