"""Link latency in the communication layer: the model's arithmetic (rounds × per-hop
latency) with an injected sleep, and that a group without latency never waits."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from xronos.comm.links import (
    DelayedCalls,
    LinkDelays,
    allgather_rounds,
    allreduce_rounds,
    ring_delays,
)
from xronos.comm.mappings import TPGroup
from xronos.metrics.recorder import SpanRecorder, use_recorder

MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("world", "nbytes", "rounds"),
    [
        (1, 4096, 0),  # one rank: no message at all
        (2, 0, 0),  # gloo returns at once for an empty tensor
        (2, 4096, 2),  # reduce-scatter + all-gather, one round each
        (3, 4096, 4),  # 2(P-1)
        (4, 4 * MIB, 6),  # 4 MiB < 2P MiB: still two segments per rank
        (2, 8 * MIB, 4),  # 8 one-MiB segments, 4 per rank, two in flight: 2 rounds a phase
        (3, 9 * MIB, 6),  # 9 segments (3 per rank): ceil(3·2/2) = 3 rounds a phase
    ],
)
def test_allreduce_rounds_follow_gloos_ring(world: int, nbytes: int, rounds: int) -> None:
    assert allreduce_rounds(world, nbytes) == rounds


def test_allgather_rounds() -> None:
    assert [allgather_rounds(p, 64) for p in (1, 2, 3, 5)] == [0, 1, 2, 4]
    assert allgather_rounds(3, 0) == 0


def test_ring_with_equal_links_costs_rounds_times_two_latencies() -> None:
    for step in (+1, -1):
        assert ring_delays([0.002] * 3, 4, step) == pytest.approx((0.016,) * 3)


def test_ring_with_uneven_links_follows_the_slowest_chain() -> None:
    # Latencies 1, 1, 2 ms; rank r receives from r+1: hops into 0, 1, 2 cost 2, 3, 3 ms.
    #   round 1: (2, 3, 3)   round 2: (5, 6, 5)   round 3: (8, 8, 8)   round 4: (10, 11, 11)
    got = ring_delays([0.001, 0.001, 0.002], 4, +1)
    assert got == pytest.approx((0.010, 0.011, 0.011))


def test_hop_is_one_way_through_both_links() -> None:
    links = LinkDelays((0.001, 0.005))
    assert links.hop(0, 1) == links.hop(1, 0) == pytest.approx(0.006)


def test_subgroup_keeps_its_members_latencies() -> None:
    links = LinkDelays((0.001, 0.002, 0.003))
    sub = links.among([0, 2])
    assert sub.latency_s == (0.001, 0.003)
    assert sub.sender is links.sender  # one timer thread per process, not per subgroup


def test_negative_latency_is_rejected() -> None:
    with pytest.raises(ValueError, match="latencies"):
        LinkDelays((0.001, -0.001))


@pytest.fixture
def no_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Collectives that move nothing, so a 2-rank group runs in one process."""
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    monkeypatch.setattr(dist, "all_gather", lambda out, t, **k: [o.copy_(t) for o in out])


def _group(latencies: tuple[float, ...], sleeps: list[float]) -> TPGroup:
    return TPGroup(0, len(latencies), None, links=LinkDelays(latencies, sleep=sleeps.append))


@pytest.mark.usefixtures("no_gloo")
def test_allreduce_waits_the_modelled_latency_inside_its_span() -> None:
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        time.sleep(seconds)

    group = TPGroup(0, 2, None, links=LinkDelays((0.005, 0.005), sleep=sleep))
    rec = SpanRecorder(0, "a")
    rec.start_step(0)
    with use_recorder(rec):
        group.all_reduce(torch.zeros(16), "x")
    record = rec.end_step()
    # 2 ranks exchange their tensors (xronos.comm.exchange): 1 round × (5 ms + 5 ms)
    assert sleeps == [pytest.approx(0.01)]
    assert record is not None and [s.name for s in record.collectives] == ["x"]
    # the wait is part of the collective's span (transfer), not of the compute around it;
    # a lower bound on a sleep, not a speed assertion
    assert record.collectives[0].duration >= 0.01


@pytest.mark.usefixtures("no_gloo")
def test_allreduce_of_three_ranks_waits_the_rings_rounds() -> None:
    sleeps: list[float] = []
    _group((0.001, 0.002, 0.004), sleeps).all_reduce(torch.zeros(16), "x")
    # gloo's ring beyond two ranks: 2(P-1) = 4 rounds, rank 0 receiving from rank 1
    assert sleeps == [pytest.approx(ring_delays((0.001, 0.002, 0.004), 4, +1)[0])]


@pytest.mark.usefixtures("no_gloo")
def test_allgather_waits_one_round_per_peer() -> None:
    sleeps: list[float] = []
    group = _group((0.001, 0.002, 0.004), sleeps)
    out = group.all_gather(torch.ones(4), "g")
    assert len(out) == 3
    # rank 0 receives from rank 2 (all-gather ring runs r-1 -> r): rounds 2, see ring_delays
    assert sleeps == [pytest.approx(ring_delays((0.001, 0.002, 0.004), 2, -1)[0])]
    assert sleeps[0] >= 2 * (0.001 + 0.004) - 1e-12


@pytest.mark.usefixtures("no_gloo")
@pytest.mark.parametrize("links", [None, (0.0, 0.0)])
def test_group_without_latency_never_sleeps(
    links: tuple[float, float] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(seconds: float) -> None:
        raise AssertionError(f"slept {seconds} s on a link without latency")

    monkeypatch.setattr(time, "sleep", fail)
    group = TPGroup(0, 2, None, links=LinkDelays(links, sleep=fail) if links else None)
    assert group.delays() is None
    group.all_reduce(torch.zeros(4), "x")
    group.all_gather(torch.zeros(4), "g")


def test_silent_group_drops_the_links() -> None:
    group = _group((0.02, 0.02), [])
    assert group.delays() is not None
    assert group.silent().links is None and group.silent().delays() is None


def test_delayed_calls_run_in_due_order_and_never_early() -> None:
    calls = DelayedCalls()
    ran: list[tuple[str, float]] = []
    t0 = time.monotonic()
    late = calls.call_at(t0 + 0.04, lambda: ran.append(("late", time.monotonic())) or "L")
    early = calls.call_at(t0 + 0.02, lambda: ran.append(("early", time.monotonic())) or "E")
    assert (early.result(5), late.result(5)) == ("E", "L")
    assert [name for name, _ in ran] == ["early", "late"]
    assert ran[0][1] >= t0 + 0.02 and ran[1][1] >= t0 + 0.04  # lower bounds only


def test_delayed_call_hands_its_exception_to_the_waiter() -> None:
    calls = DelayedCalls()

    def boom() -> Any:
        raise RuntimeError("send failed")

    with pytest.raises(RuntimeError, match="send failed"):
        calls.call_at(time.monotonic(), boom).result(5)


def test_send_later_uses_the_hop_of_its_two_ends() -> None:
    now = [100.0]
    links = LinkDelays((0.001, 0.003), clock=lambda: now[0])
    seen = threading.Event()
    due: list[float] = []
    fut = links.send_later(0, 1, lambda: due.append(now[0]) or seen.set())
    assert not seen.wait(0.05)  # the fake clock stands still: the send is not yet due
    now[0] = 100.004  # l_0 + l_1 later: due (the timer rechecks the clock as it wakes)
    fut.result(5)
    assert due == [100.004]
