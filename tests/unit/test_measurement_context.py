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
