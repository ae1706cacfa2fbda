"""`xronos bench` smoke test: the contract of bench.json, not timings (those are in
docs/benchmarks.md, measured by the full scenarios)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_models import make_checkpoint

KEYS = {
    "step_time_s",
    "step_time_s_all",
    "tokens_per_s",
    "idle_ratio_mean",
    "idle_ratio_max",
    "stall_ratio",
    "efficiency",
    "final_loss",
    "peak_rss_mb",
    "plan",
    "per_device",
    "speedup_vs_single",
    "speedup_vs_single_interval",
}
# Same seed, same data, same mathematics: per-step losses agree to fp32 reassociation
# (1.2e-7 relative measured; docs/architecture.md, Exactness).
LOSS_RTOL = 1e-5
EXACT = ["--comm-dtype", "fp32"]  # exact payloads: the losses are compared with single's


def bench_model(path: Path) -> list[str]:
    """Writes the smoke workload's model to ``path``; the flags that bench it. The
    scenario's `small` spends most of a bench in building, profiling and measuring each
    strategy's model, not in its steps: this one is a quarter of its size (hidden 256, 4
    layers, fully fine-tuned) with the same split units (64 MLP, 256 vocabulary), and its
    plan still gives the slow device a share of both (about 10 : 54 and 53 : 203 here). On
    `tiny` the slow device holds nothing, which says little about the split."""
    make_checkpoint(
        path, vocab=4096, hidden=256, intermediate=1024, layers=4, heads=8, kv_heads=8, tied=True
    )
    return ["--model", str(path), "--lora-rank", "0"]


@pytest.mark.slow
def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    args = ["bench", "--scenario", "smoke", *bench_model(tmp_path / "model")]
    # four counted rounds (the scenario's three are too few for a speed-up interval); a
    # process of its own, so that its workers' stderr is its own too (workers start from a
    # fork server, which keeps the stderr of whichever test started it first)
    argv = [*args, "--out", str(out), "--no-cache", "--steps", "4", *EXACT]
    done = subprocess.run(
        [sys.executable, "-m", "xronos", *argv], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # progress came from the first device's process while it worked, once per line
    err = done.stderr
    assert err.count("bench: profiled in ") == 1 and err.count("bench: auto ready, runs ") == 1
    assert err.count("bench: step 5 of 5 (counted)") == 1
    bench = json.loads((out / "bench.json").read_text())
    assert {"scenario", "model", "devices", "ideal_step_time_s", "strategies"} <= bench.keys()
    # uncached: profiling took time, and xronos's planning (calibration) more on top of it
    assert 0 < bench["profiling_s"] < bench["profiling_and_planning_s"]
    # every device ran the whole model alone, and the ideal is their compute bound alone
    solo = bench["solo_step_time_s"]
    assert set(solo) == {"fast", "slow"} and min(solo.values()) > 0
    assert bench["ideal_step_time_s"] == pytest.approx(1 / sum(1 / t for t in solo.values()))
    # the solo steps again, every device's at the same moment: the bound with all busy
    together = bench["solo_together_step_time_s"]
    assert set(together) == {"fast", "slow"} and min(together.values()) > 0
    both = bench["ideal_together_step_time_s"]
    assert both == pytest.approx(1 / sum(1 / t for t in together.values()))
    for name, cost in bench["contention"].items():
        assert cost == pytest.approx(together[name] / solo[name] - 1), name
    # the same solo steps as speeds against the fastest device's, beside what was asked
    speeds = bench["solo_speed"]
    assert speeds["fast"]["asked"] == 1.0 and speeds["slow"]["asked"] == pytest.approx(0.4)
    assert speeds["slow"]["measured"] == pytest.approx(min(solo.values()) / solo["slow"])
    assert max(v["measured"] for v in speeds.values()) == 1.0
    # the profiled wait per barrier is the group's: one median, the same on every device
    waits = {link["barrier_wait_s"] for link in bench["links_measured"]}
    assert len(waits) == 1 and min(waits) >= 0, bench["links_measured"]
    strategies = bench["strategies"]
    assert set(strategies) == {"auto", "xronos", "tp-even", "pp-gpipe", "pp-1f1b", "single"}
    # auto ran what it picked (or, for a hybrid, the best runnable) and says which
    auto = strategies["auto"]
    assert auto["chosen"] in {"single", "xronos", "tp-even", "pp-1f1b", "hybrid"}
    assert auto["auto"]["ran"]["strategy"] in {"single", "xronos", "tp-even", "pp-1f1b"}
    ran = auto["auto"]["ran"]
    if ran["strategy"] != "xronos":  # (xronos: its calibrated plan's; a unit test covers it)
        assert auto["predicted_step_time_s"] == pytest.approx(ran["predicted_step_s"])
    assert auto["predicted_step_time_s"] > 0
    # every shortlisted candidate's timed trial steps, whose median decided
    trials, steps = auto["auto"]["trials"], auto["auto"]["trial_steps"]
    assert trials and set(steps) == set(trials)
    for key, times in steps.items():
        assert len(times) >= 4 and trials[key] == pytest.approx(statistics.median(times)), key
    # the fastest collaboration weighed against the device alone round by round (ci-2dev has
    # no memory caps: the candidates raced in turn), and what ran follows from it
    weighed = auto["auto"]["against_alone"]
    if weighed is not None:
        together, alone = steps[weighed["together"]], steps[weighed["alone"]]
        rounds = [a / b for a, b in zip(together, alone, strict=True)]
        assert weighed["paired"] and weighed["ratio"] == pytest.approx(statistics.median(rounds))
        ran_key = f"{ran['strategy']}:{','.join(map(str, ran['devices']))}"
        assert ran_key == weighed["together" if weighed["wins"] else "alone"]
    # auto against the best other strategy of the run, from the same counted rounds
    against = bench["auto_vs_best_other"]
    medians = {n: e["step_time_s"] for n, e in strategies.items() if n != "auto"}
    assert against["best_other"] == min(medians, key=lambda n: medians[n])
    assert against["ratio"] == pytest.approx(auto["step_time_s"] / min(medians.values()))
    assert against["interval"][0] <= against["interval"][1]
    for name in ("single", "xronos", "tp-even", "pp-1f1b"):
        assert strategies[name]["predicted_step_time_s"] > 0, name
    for name, entry in strategies.items():
        assert entry.keys() >= KEYS, name
        assert entry["efficiency_together"] == pytest.approx(both / entry["step_time_s"]), name
        assert 0 <= entry["idle_ratio_mean"] <= entry["idle_ratio_max"] <= 1, name
        # every strategy ran the same counted rounds as single: each has an interval
        lo, hi = entry["speedup_vs_single_interval"]
        assert 0 < lo <= hi, name
        for dev in entry["per_device"]:
            assert {"name", "compute_s", "transfer_s", "idle_s"} <= dev.keys()
            assert min(dev["compute_s"], dev["transfer_s"], dev["idle_s"]) >= 0
            # the mean is over the counted steps, whose computes are listed one by one
            computes = dev["compute_s_all"]
            assert len(computes) == len(entry["step_time_s_all"]), name
            assert statistics.fmean(computes) == pytest.approx(dev["compute_s"]), name
    # ci-2dev: "fast" at full quota, "slow" at 40 %: the slow device gets fewer units
    plan = strategies["xronos"]["plan"]
    assert plan["devices"] == ["fast", "slow"]
    # The MLP and vocabulary splits (64 and 256 small units) must favour the fast device.
    # Attention is not asserted: at this scenario's 16 tokens a query head's shard takes
    # well under a millisecond, below the 10 ms quota period's bursts, and calibration has
    # been seen to move it either way (e.g. 7 : 9).
    for seg in ("mlp", "vocab"):
        assert plan[seg][1] < plan[seg][0], seg
    # the calibration rounds that made the plan: each covers the model, both devices timed
    assert plan["calibration"], "xronos's plan was calibrated"
    for rnd in plan["calibration"]:
        for seg in ("attn", "mlp", "vocab"):
            assert sum(rnd["units"][seg]) == sum(plan[seg]), seg
        assert len(rnd["measured_s"]) == 2
        assert all(m["mlp"] > 0 for m in rnd["measured_s"])
        # a stray round is named per segment, by the ranks whose fit left it out
        assert set(rnd["left_out"]) <= {"attn", "mlp", "vocab"}
        assert all(set(ranks) <= {0, 1} for ranks in rnd["left_out"].values())
    assert strategies["single"]["speedup_vs_single"] == pytest.approx(1.0)
    # single against its own rounds: every resample's ratio is one
    assert strategies["single"]["speedup_vs_single_interval"] == pytest.approx([1.0, 1.0])
    assert solo["fast"] == pytest.approx(strategies["single"]["step_time_s"])
    ref = strategies["single"]["losses"]
    # the smoke scenario's one warm-up step and 4 counted ones; a warm-up move anywhere
    # lengthens every strategy's warm-up alike (they step in turn)
    moved = any(entry["rebalanced"] for entry in strategies.values())
    (warmup,) = {entry["warmup_steps"] for entry in strategies.values()}
    assert warmup > 1 if moved else warmup == 1
    for name, entry in strategies.items():
        assert len(entry["losses"]) == warmup + 4, name
    for name in ("auto", "xronos", "tp-even", "pp-gpipe", "pp-1f1b"):
        assert strategies[name]["losses"] == pytest.approx(ref, rel=LOSS_RTOL), name
        # the bench's own check agrees, and says so in bench.json
        assert strategies[name]["loss_matches_single"] is True, name
        assert strategies[name]["loss_gap_vs_single"] <= LOSS_RTOL, name
    assert (out / "bench.png").stat().st_size > 0
    # the step boundary is timed like any collective, so an early finisher's wait counts
    spans = json.loads((out / "trace.json").read_text())["traceEvents"]
    ends = [e for e in spans if e.get("name", "").endswith(": step.end")]
    assert {e["pid"] for e in ends} == {0, 1}
