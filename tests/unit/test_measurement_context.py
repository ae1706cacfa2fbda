"""What a cached profile is keyed on: everything besides the workload that changes what
profiling measures (docs/architecture.md, Measurement) — here, how a slow device is emulated."""

from __future__ import annotations

import pytest

from xronos.emulation import ClusterSpec, DeviceSpec
from xronos.emulation.competitor import PERIOD_S
from xronos.run import launch
from xronos.run.launch import measurement_context

CLUSTER = ClusterSpec("pair", (DeviceSpec("fast"), DeviceSpec("slow", cpu_quota=0.4)))


def test_the_competing_load_period_is_part_of_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # A profile measured behind a load of one period must not be reused behind another: the
    # period moves how long a message to the slow device waits.
    before = measurement_context(CLUSTER, emulate=True, cpu_period_us=10_000)
    monkeypatch.setattr(launch, "LOAD_PERIOD_S", PERIOD_S / 4)
    after = measurement_context(CLUSTER, emulate=True, cpu_period_us=10_000)
    assert [d["load_period_us"] for d in before] == [round(PERIOD_S * 1e6)] * 2
    assert [d["load_period_us"] for d in after] == [round(PERIOD_S / 4 * 1e6)] * 2
    # nothing else moved: only the period tells the two keys apart
    assert [{**d, "load_period_us": 0} for d in before] == [
        {**d, "load_period_us": 0} for d in after
    ]


def test_an_unemulated_run_has_no_emulation_in_its_key() -> None:
    ctx = measurement_context(CLUSTER, emulate=False, cpu_period_us=10_000)
    assert all(
        d["load_period_us"] is None and d["cpu_period_us"] is None and d["cpu_limit"] is None
        for d in ctx
    )
    # the quota's period and the CPU limit are in the key only when emulating
    emulated = measurement_context(CLUSTER, emulate=True, cpu_period_us=2_500, cpu_limit="quota")
    assert [(d["cpu_period_us"], d["cpu_limit"]) for d in emulated] == [(2500, "quota")] * 2


LINKED = CLUSTER.with_link(200e6, 0.002)  # both devices declare a 200 Mbit/s, 2 ms link


def test_links_are_in_the_key_only_where_they_are_emulated() -> None:
    # A profile measures the links its run talks over: one measured over loopback
    # (`--no-network`, a sweep's loopback run, no device emulation) must never plan a run
    # on the declared links, nor the other way round.
    on = measurement_context(LINKED, emulate=True, cpu_period_us=10_000)  # declared: on
    asked = measurement_context(LINKED, emulate=True, cpu_period_us=10_000, network=True)
    off = measurement_context(LINKED, emulate=True, cpu_period_us=10_000, network=False)
    bare = measurement_context(CLUSTER, emulate=True, cpu_period_us=10_000)
    assert on == asked
    assert [(d["bandwidth_bps"], d["latency_s"]) for d in on] == [(200e6, 0.002)] * 2
    assert all(d["link_bucket_s"] is not None for d in on)
    assert off != on
    assert off == bare  # loopback is loopback, whatever the cluster declares
    unemulated = measurement_context(LINKED, emulate=False, cpu_period_us=10_000)
    assert unemulated == measurement_context(CLUSTER, emulate=False, cpu_period_us=10_000)
