"""From the workers' logs to ``bench.json`` (DESIGN §7), the table and ``bench.png``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from xronos.emulation import ClusterSpec
from xronos.engine.bench import PP_STRATEGIES, StrategyLog
from xronos.engine.scenarios import Scenario
from xronos.metrics import (
    analyze_pipeline_step,
    analyze_step,
    efficiency,
    ideal_step_time,
    stall_ratio,
    summarize,
    write_trace,
)
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.profile import DeviceProfile
from xronos.utils import atomic_write_text


def solo_times(
    profiles: list[DeviceProfile], plan: Plan, measured_single: float | None, fastest: int
) -> list[float]:
    """Each device's time to run the whole step alone: the profile's prediction, rescaled
    so that the fastest device's equals the measured ``single`` step when there is one."""
    totals = {s: sum(plan.split(s)) for s in SEGMENTS}
    predicted = [p.step_time(totals) for p in profiles]
    if measured_single:
        scale = measured_single / predicted[fastest]
        predicted = [t * scale for t in predicted]
    return predicted


def strategy_entry(name: str, log: StrategyLog, scenario: Scenario, tokens: int) -> dict[str, Any]:
    analyze = analyze_pipeline_step if name in PP_STRATEGIES else analyze_step
    steps = [analyze(recs) for recs in log.records]
    run = summarize(steps, skip_warmup=scenario.warmup)
    try:
        stall = stall_ratio(log.observed, log.isolated)
    except ValueError:
        stall = float("nan")
    counted = log.losses[scenario.warmup :]
    return {
        **run.to_dict(),
        "tokens_per_s": tokens / run.step_time_s,
        "stall_ratio": stall,
        "final_loss": counted[-1] if counted else float("nan"),
        "losses": log.losses,
    }


def build_report(
    out: dict[str, Any],
    scenario: Scenario,
    cluster: ClusterSpec,
    strategies: tuple[str, ...],
    extra: dict[str, Any],
) -> dict[str, Any]:
    profiles = [DeviceProfile.from_dict(d) for d in out["profiles"]]
    plan = Plan.from_dict(out["plan"])
    tokens = scenario.batch_size * scenario.seq_len
    result: dict[str, Any] = {
        "scenario": scenario.name,
        "model": scenario.model,
        "devices": [d.to_dict() for d in cluster.devices],
        "ideal_step_time_s": 0.0,
        "strategies": {},
    }
    for name in strategies:
        entry = strategy_entry(name, out["logs"][name], scenario, tokens)
        entry["peak_rss_mb"] = out["peak_rss_mb"]
        entry["plan"] = _plan_of(name, plan, out, cluster)
        result["strategies"][name] = entry
    single = result["strategies"].get("single", {}).get("step_time_s")
    solo = solo_times(profiles, Plan.single(profiles_cfg(extra)), single, out["fastest"])
    xr = result["strategies"].get("xronos")
    transfer = max(d["transfer_s"] for d in xr["per_device"]) if xr else 0.0
    ideal = ideal_step_time(solo, transfer)
    result["ideal_step_time_s"] = ideal
    for entry in result["strategies"].values():
        entry["efficiency"] = efficiency(ideal, entry["step_time_s"])
    result.update(extra.get("meta", {}))
    return result


def profiles_cfg(extra: dict[str, Any]) -> Any:
    return extra["cfg"]


def _plan_of(name: str, plan: Plan, out: dict[str, Any], cluster: ClusterSpec) -> dict[str, Any]:
    if name == "xronos":
        return plan.to_dict()
    if name == "single":
        return {"strategy": "single", "device": cluster.devices[out["fastest"]].name}
    if name == "tp-even":
        return {"strategy": "tp-even"}
    return out.get("pp_plans", {}).get(name, {"strategy": name})


def write_outputs(result: dict[str, Any], out_dir: Path, out: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    clean = json.loads(json.dumps(result, default=float), parse_constant=lambda _: None)
    atomic_write_text(out_dir / "bench.json", json.dumps(_finite(clean), indent=2))
    from xronos.metrics import plot_bench

    plot_bench(out_dir / "bench.png", result)
    xr = out["logs"].get("xronos")
    if xr is not None and xr.records:
        write_trace(out_dir / "trace.json", xr.records[-3:])


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj
