"""Bandwidth emulated in the communication layer, on real gloo ranks: an all-reduce over
links of a given rate takes at least its bytes' transfer time longer than the same
all-reduce on unshaped links (and not twice that), its result is unchanged, and the
launcher hands the rates to every worker when no network namespaces can be made."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from tests.dist.world import WorkerContext, run_world
from xronos.comm.links import LinkDelays
from xronos.emulation import ClusterSpec, DeviceSpec
from xronos.emulation import netns as netns_mod
from xronos.emulation.netns import NetworkPlan
from xronos.run.launch import run_on_cluster

RATE_BPS = 1e8  # 100 Mbit/s on both links
NUMEL = 625_000  # 2.5 MB of fp32: below 2P MiB, so gloo's ring runs 2 rounds of B/2
NBYTES = 4 * NUMEL
CHARGE_S = 8 * NBYTES / RATE_BPS  # each link carries B bytes in all: 0.2 s
REPEATS = 5
# The charge is a sleep, so a shaped all-reduce lasts at least CHARGE_S plus the real
# collective; the comparison with the unshaped one is between two real collectives of the
# same size, interleaved, medians of 5. Their difference in the real part is the jitter of a
# 2.5 MB loopback all-reduce on a shared host (a few ms; 50 ms allowed, a quarter of the
# charge). Counting the bytes on both links of a message (uplink + downlink in series)
# would add another 0.2 s, far outside it.
TOLERANCE_S = 0.05


def _timed(ctx: WorkerContext, _: Any) -> dict[str, Any]:
    plain = ctx.group
    shaped = replace(plain, links=LinkDelays((0.0, 0.0), bandwidth_bps=(RATE_BPS, RATE_BPS)))
    x = torch.arange(NUMEL, dtype=torch.float32) * (ctx.rank + 1)
    times: dict[str, list[float]] = {"plain": [], "shaped": []}
    results = {}
    for _ in range(REPEATS):
        for name, group in (("plain", plain), ("shaped", shaped)):
            y = x.clone()
            plain.barrier()
            t0 = time.perf_counter()
            group.all_reduce(y, name)
            times[name].append(time.perf_counter() - t0)
            results[name] = y
    return {"times": times, "equal": torch.equal(results["plain"], results["shaped"])}


def test_a_shaped_allreduce_takes_its_bytes_over_the_rate_longer() -> None:
    for rank, out in enumerate(run_world(_timed, 2)):
        plain, shaped = out["times"]["plain"], out["times"]["shaped"]
        assert out["equal"], rank  # the wait moves no data
        assert min(shaped) >= CHARGE_S, (rank, shaped)  # a sleep never ends early
        extra = statistics.median(shaped) - statistics.median(plain)
        assert CHARGE_S - TOLERANCE_S <= extra <= CHARGE_S + TOLERANCE_S, (rank, plain, shaped)


def _links_of_worker(ctx: WorkerContext, _: Any) -> tuple[Any, Any]:
    links = ctx.group.links
    return (links.bandwidth_bps, links.latency_s) if links is not None else (None, None)


def _no_namespaces(run_id: str, world_size: int) -> NetworkPlan:
    raise netns_mod.NetworkUnavailable("`ip netns add` failed: Operation not permitted")


@pytest.mark.slow
def test_the_launcher_hands_the_rates_to_the_workers_without_namespaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(netns_mod, "plan_network", _no_namespaces)  # the parent's emulator
    cluster = ClusterSpec("c", (DeviceSpec("a"), DeviceSpec("b"))).with_link(2e8, 0.001)
    lines: list[str] = []
    emulation: dict[str, Any] = {}
    got = run_on_cluster(
        _links_of_worker,
        [None, None],
        cluster,
        network=True,
        report=lines.append,
        emulation=emulation,
    )
    assert got == [((2e8, 2e8), (0.001, 0.001))] * 2
    assert any(line.startswith("network: bandwidth and latency emulated in the") for line in lines)
    assert [link["bandwidth_by"] for link in emulation["links"]] == ["communication layer"] * 2
