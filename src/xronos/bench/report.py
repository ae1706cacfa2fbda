"""From the workers' logs to ``bench.json`` (docs/cli.md), the table and ``bench.png``.

Every strategy asked for has an entry; one that could not fit the devices' memory has
only ``infeasible`` (why: its predicted resident memory against the cap, MiB), its
``predicted_memory_mb`` and no measurements. ``peak_rss_mb`` is per device, the strategy's
own peak; ``predicted_memory_mb`` is the memory model's figure for the same processes;
``memory`` says how both were obtained (runtime, caps requested and enforced, schedule).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from xronos.bench.scenarios import Scenario
from xronos.bench.spread import against_best_other, speedup_interval
from xronos.bench.worker import BenchOutput, StrategyLog
from xronos.config import ModelConfig
from xronos.emulation import ClusterSpec
from xronos.metrics import (
    analyze_pipeline_step,
    analyze_step,
    efficiency,
    ideal_step_time,
    is_pipeline,
    loss_agreement,
    stall_ratio,
    summarize,
    write_trace,
)
from xronos.planner.profile import DeviceProfile
from xronos.train.session import Strategy
from xronos.utils import atomic_write_text


def strategy_entry(name: Strategy, log: StrategyLog) -> dict[str, Any]:
    # what ran decides (auto may have run a pipeline)
    steps = [
        analyze_pipeline_step(recs) if is_pipeline(recs) else analyze_step(recs)
        for recs in log.records
    ]
    run = summarize(steps, skip_warmup=log.warmup)
    try:
        stall = stall_ratio(log.observed, log.isolated)
    except ValueError:
        stall = float("nan")
    counted = log.losses[log.warmup :]
    return {
        **run.to_dict(),
        "tokens_per_s": log.tokens / run.step_time_s,
        "stall_ratio": stall,
        "final_loss": counted[-1] if counted else float("nan"),
        "losses": log.losses,
        "rebalanced": log.moves,
        "warmup_steps": log.warmup,
    }


def build_report(
    out: BenchOutput,
    scenario: Scenario,
    cluster: ClusterSpec,
    cfg: ModelConfig,
    fastest: int,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """``bench.json`` (docs/cli.md) from rank 0's logs."""
    result: dict[str, Any] = {
        "scenario": scenario.name,
        "model": scenario.model,
        "devices": [d.to_dict() for d in cluster.devices],
        "ideal_step_time_s": 0.0,
        "strategies": {},
    }
    for name in out.strategies or tuple(out.logs):
        log = out.logs.get(name)
        if log is None:  # infeasible: never opened
            entry = {
                "feasible": False,
                "infeasible": out.infeasible.get(name, "not run"),
                "plan": None,
            }
        else:
            entry = {"feasible": True, **strategy_entry(name, log), "plan": log.plan}
        entry["peak_rss_mb"] = out.strategy_peak_mb.get(name) if log is not None else None
        entry["start_rss_mb"] = out.strategy_start_mb.get(name) if log is not None else None
        entry["predicted_memory_mb"] = out.predicted_memory_mb.get(name)
        entry["predicted_step_time_s"] = out.predicted_step_time_s.get(name)
        if name is Strategy.AUTO and out.auto is not None:
            entry["chosen"] = out.auto["chosen_strategy"]
            entry["auto"] = out.auto
            released = [m for m in log.moves if m.get("why") == "release"] if log else []
            if released:  # the warm-up's check went on with fewer devices
                entry["chosen"] = released[-1]["plan"]["strategy"]
        result["strategies"][name.value] = entry
    result["memory"] = {**out.memory, "process_peak_rss_mb": out.peak_rss_mb}
    result["io_threads_restored"] = {
        d.name: when for d, when in zip(cluster.devices, out.io_restored, strict=False)
    }
    result["links_measured"] = [measured_link(p) for p in out.measured]
    solo = out.solo_step_time_s
    result["solo_step_time_s"] = {d.name: t for d, t in zip(cluster.devices, solo, strict=True)}
    result["solo_speed"] = solo_speeds(cluster, solo)
    single = result["strategies"].get("single", {}).get("step_time_s") or solo[fastest]
    single_steps = result["strategies"].get("single", {}).get("step_time_s_all") or []
    known = [t for t in solo if t]
    # the compute bound (docs/architecture.md, Measurement), from every device's measured
    # solo step; no transfer term
    ideal = ideal_step_time(known) if len(known) == len(solo) else None
    result["ideal_step_time_s"] = ideal
    for entry in result["strategies"].values():
        step = entry.get("step_time_s")
        if step is None:
            continue
        entry["efficiency"] = efficiency(ideal, step) if ideal else None
        entry["speedup_vs_single"] = single / step if single else None
        # a 95 % interval over the counted rounds resampled (xronos.bench.spread)
        entry["speedup_vs_single_interval"] = speedup_interval(
            single_steps, entry.get("step_time_s_all") or []
        )
    result["auto_vs_best_other"] = auto_against_best(result["strategies"])
    together_bound(result, cluster, solo, out.solo_together_step_time_s)
    loss_agreement(result["strategies"])
    result.update(meta)
    return result


def auto_against_best(strategies: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """``auto``'s median step over the best other strategy's of the run (``single``
    included), with that ratio's 95 % interval over the counted rounds resampled
    (:func:`~xronos.bench.spread.against_best_other`); None where ``auto`` did not run or
    nothing else did."""
    auto = strategies.get(Strategy.AUTO.value, {}).get("step_time_s_all")
    others = {
        name: entry["step_time_s_all"]
        for name, entry in strategies.items()
        if name != Strategy.AUTO.value and entry.get("step_time_s_all")
    }
    return against_best_other(auto, others) if auto else None


def measured_link(profile: DeviceProfile) -> dict[str, Any]:
    """A device's link as its profile fitted it (none on one device), the group's wait per
    barrier and what overlapping an all-reduce with computing fails to hide."""
    out: dict[str, Any] = {"name": profile.name}
    if profile.link is not None:
        out |= profile.link.to_dict()
        out["sustained_bps"] = profile.link.sustained_bps
    out["barrier_wait_s"] = profile.sync_s
    out["overlap_loss"] = profile.overlap_loss
    return out


def together_bound(
    result: dict[str, Any],
    cluster: ClusterSpec,
    alone: list[float | None],
    together: list[float | None],
) -> None:
    """Where every device also ran its solo step at the same moment as the others: those
    times, each device's ``contention`` (together ÷ in turn − 1: what the others' work
    costs it on a shared host), the compute bound with every device busy, and each
    strategy's efficiency against that bound (``efficiency`` stays the one against the
    solo steps timed in turn)."""
    if not together or not all(together) or not all(alone):
        return
    names = [d.name for d in cluster.devices]
    result["solo_together_step_time_s"] = dict(zip(names, together, strict=True))
    result["contention"] = {
        n: t / a - 1 for n, t, a in zip(names, together, alone, strict=True) if t and a
    }
    ideal = ideal_step_time([t for t in together if t])
    result["ideal_together_step_time_s"] = ideal
    for entry in result["strategies"].values():
        if entry.get("step_time_s") is not None:
            entry["efficiency_together"] = efficiency(ideal, entry["step_time_s"])


def solo_speeds(cluster: ClusterSpec, solo: list[float | None]) -> dict[str, dict[str, float]]:
    """Each device's speed during the run against the fastest one's — the ratio of their
    solo steps, measured inside their limits between the strategies' steps — next to the
    ratio the cluster asks (``cores × cpu_quota``). The start-up check measures each device
    once, on a fixed kernel; this shows whether the speeds held while the steps ran."""
    known = [(d, t) for d, t in zip(cluster.devices, solo, strict=True) if t]
    if not known:
        return {}
    top = max(d.capacity for d, _ in known)
    best = min(t for _, t in known)
    return {d.name: {"asked": d.capacity / top, "measured": best / t} for d, t in known}


def write_outputs(result: dict[str, Any], out_dir: Path, out: BenchOutput) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    clean = json.loads(json.dumps(result, default=float), parse_constant=lambda _: None)
    atomic_write_text(out_dir / "bench.json", json.dumps(_finite(clean), indent=2))
    from xronos.metrics import plot_bench

    plot_bench(out_dir / "bench.png", result)
    for strategy, log in out.logs.items():
        if log.records:  # xronos: trace.json; the others trace-<strategy>.json
            name = "trace.json" if strategy is Strategy.XRONOS else f"trace-{strategy.value}.json"
            write_trace(out_dir / name, log.records[-3:])


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj
