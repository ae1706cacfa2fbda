"""``xronos bench`` under memory caps (``ci-2dev-mem``): ``single`` is reported infeasible,
with its need against the cap, and never runs; ``xronos`` runs within the caps and reports
its own peak beside the memory model's prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xronos.cli import main
from xronos.emulation import load_cluster

MIB = 2**20


@pytest.mark.slow
def test_bench_reports_an_infeasible_strategy_without_running_it(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    args = ["bench", "--scenario", "ci-2dev-mem", "--strategies", "single,xronos"]
    args += ["--steps", "1", "--warmup", "0", "--out", str(out), "--no-cache"]
    assert main(args) == 0
    bench = json.loads((out / "bench.json").read_text())
    caps = [d.memory_bytes / MIB for d in load_cluster("ci-2dev-mem").devices]
    memory = bench["memory"]
    assert memory["cap_mb"] == caps
    assert memory["schedule"] == "in turn"  # both parts (and a twin) do not fit at once
    single, xronos = bench["strategies"]["single"], bench["strategies"]["xronos"]

    # single: refused before it starts, and says why in MiB
    assert single["feasible"] is False
    assert (
        "MiB on fast" in single["infeasible"] and f"cap {caps[0]:.0f} MiB" in single["infeasible"]
    )
    need = single["predicted_memory_mb"][0]
    assert need > caps[0]
    assert "step_time_s" not in single and single["peak_rss_mb"] is None
    # nobody ran the whole model: no device measured a solo step either
    assert set(bench["solo_step_time_s"].values()) == {None}

    # xronos: ran, every device's predicted memory within its cap
    assert xronos["feasible"] is True and xronos["step_time_s"] > 0
    assert len(xronos["peak_rss_mb"]) == 2 and min(xronos["peak_rss_mb"]) > 0
    assert all(p <= c for p, c in zip(xronos["predicted_memory_mb"], caps, strict=True))
    # its turn began from the runtime, not from a whole model left behind
    assert max(xronos["start_rss_mb"]) < need
    enforced = memory["enforced_cap_mb"]
    if enforced != [None, None]:  # the kernel enforced the caps, and they held
        assert enforced == caps
        charged = memory["cgroup_peak_mb"]
        assert all(p is None or p <= c for p, c in zip(charged, caps, strict=True))
