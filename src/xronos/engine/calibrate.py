"""Refine the profile with a couple of real steps, then plan again.

The profiler times each segment's shard alone, which is quick but not the whole truth:
inside a real step a device also pays for cache traffic between segments, for the
Python around the kernels, and for whatever else its host runs. So after planning,
each device runs a few real forward+backward passes of the planned shards (with the
real collectives, no parameter update) and times the compute between collectives. Each
compute span is attributed to the segment whose collective ends it::

    … L3.attn.out.fwd │ norm, SwiGLU │ L3.mlp.out.fwd │ final norm, logits │ vocab.ce …
                       └── mlp ───────┘                └── vocab ───────────┘

and every device's cost curve of that segment is scaled so that it predicts what was
measured. Planning again with the scaled curves is still the exact planner.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from xronos.comm.mappings import TPGroup
from xronos.engine.trainer import Batch
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.metrics.records import StepRecord
from xronos.model.llama import LlamaForCausalLM
from xronos.model.lora import LoRALinear
from xronos.planner.plan import SEGMENTS, Plan
from xronos.profiler.profile import CostCurve, DeviceProfile


def segment_of(collective: str) -> str:
    """The segment whose compute a collective closes (``other`` for the step's tail)."""
    if ".attn." in collective:
        return "attn"
    if ".mlp." in collective:
        return "mlp"
    if collective.startswith(("vocab", "head", "embed")):
        return "vocab"
    return "other"


def segment_times(rec: StepRecord) -> dict[str, float]:
    """Seconds of compute per segment in one recorded step."""
    out = dict.fromkeys((*SEGMENTS, "other"), 0.0)
    t = rec.start
    for c in rec.collectives:
        out[segment_of(c.name)] += max(0.0, c.arrive - t)
        t = c.leave
    out["other"] += max(0.0, rec.end - t)
    return out


def measure_plan(
    model: LlamaForCausalLM, group: TPGroup, micro: list[Batch], steps: int = 1, warmup: int = 1
) -> dict[str, float]:
    """Mean per-step compute per segment of ``steps`` real forward+backward passes after
    ``warmup`` uncounted ones. Parameters and dropout streams are left as they were."""
    gens = [m.dropout_gen for m in model.modules() if isinstance(m, LoRALinear)]
    saved = [g.get_state() for g in gens]
    rec = SpanRecorder(group.rank, enabled=True)
    samples: list[dict[str, float]] = []
    for step in range(warmup + steps):
        if group.size > 1:
            dist.barrier(group=group.pg)
        rec.start_step(step)
        with use_recorder(rec):
            for ids, labels in micro:
                model.loss_sum(ids, labels).backward()
        record = rec.end_step()
        model.zero_grad(set_to_none=True)
        if step >= warmup and record is not None:
            samples.append(segment_times(record))
    for g, s in zip(gens, saved, strict=True):
        g.set_state(s)
    return {k: statistics.fmean(s[k] for s in samples) for k in samples[0]}


def _gather(obj: Any, group: TPGroup) -> list[Any]:
    if group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.pg)
    return out


def rescale(
    profiles: list[DeviceProfile],
    plan: Plan,
    measured: list[dict[str, float]],
    damping: float = 1.0,
) -> list[DeviceProfile]:
    """Profiles that predict the measured compute of ``plan``.

    Each segment a device holds units of gets its own factor (measured / predicted); a
    segment it holds none of, and its replicated work, get the factor of its whole step.

    ``damping`` < 1 applies the factor only part of the way (``f ** damping``): a device
    that waits a lot can look faster than it is (a CPU quota lets it run unthrottled for
    a moment after each wait), so jumping straight to the measured factor overshoots.
    """
    out = []
    for i, (p, m) in enumerate(zip(profiles, measured, strict=True)):
        units = {s: plan.split(s)[i] for s in SEGMENTS}
        predicted = p.step_time(units)
        f = (sum(m.values()) / predicted) ** damping if predicted > 0 else 1.0
        seg_f = {
            s: (m[s] / p.segments[s](u)) ** damping
            for s, u in units.items()
            if u > 0 and p.segments[s](u) > 0 and m[s] > 0
        }
        curves = {
            s: CostCurve(c.a * seg_f.get(s, f), c.b * seg_f.get(s, f))
            for s, c in p.segments.items()
        }
        out.append(
            DeviceProfile(
                name=p.name,
                segments=curves,
                replicated_s=p.replicated_s * f,
                allreduce_s=p.allreduce_s,
                allreduces_per_step=p.allreduces_per_step,
                memory_bytes=p.memory_bytes,
                unit_bytes=p.unit_bytes,
                base_bytes=p.base_bytes,
                key=p.key,
            )
        )
    return out


def imbalance(plan: Plan, measured: list[dict[str, float]]) -> float:
    """The largest relative spread, over segments, of the measured compute of the devices
    that hold units of that segment: 0 = every barrier is reached together."""
    worst = 0.0
    for s in SEGMENTS:
        times = [m[s] for i, m in enumerate(measured) if plan.split(s)[i] > 0]
        if len(times) > 1 and max(times) > 0:
            worst = max(worst, (max(times) - min(times)) / max(times))
    return worst


def calibrated_profiles(
    model: LlamaForCausalLM,
    plan: Plan,
    profiles: list[DeviceProfile],
    group: TPGroup,
    micro: list[Batch],
    steps: int = 1,
    warmup: int = 1,
    damping: float = 1.0,
) -> tuple[list[DeviceProfile], float]:
    """Run ``steps`` real passes of ``plan``; return profiles rescaled to them and the
    measured imbalance (every rank gets the same result: the measurements are shared)."""
    with torch.enable_grad():
        mine = measure_plan(model, group, micro, steps, warmup)
    measured = _gather(mine, group)
    return rescale(profiles, plan, measured, damping), imbalance(plan, measured)


#: Calibration stops once no segment's barrier is reached with a larger spread than this.
BALANCED = 0.04


def plan_with_calibration(
    source: Any,
    profiles: list[DeviceProfile],
    group: TPGroup,
    micro: list[Batch],
    *,
    mlp_chunk: int,
    vocab_chunk: int,
    rounds: int = 5,
) -> tuple[Plan, list[DeviceProfile], LlamaForCausalLM]:
    """Plan from ``profiles``, then up to ``rounds`` times: measure the plan for real,
    rescale the profiles and plan again — until the measured spread at every barrier has
    been within ``BALANCED`` twice in a row. Returns the plan, the calibrated profiles and
    the model built for the plan."""
    from xronos.engine.worker import build_for
    from xronos.planner import plan_tp

    def plan_of(ps: list[DeviceProfile]) -> Plan:
        return plan_tp(source.cfg, ps, mlp_chunk=mlp_chunk, vocab_chunk=vocab_chunk)

    plan = plan_of(profiles)
    model = build_for(source, plan, group)
    balanced = 0
    for r in range(rounds if group.size > 1 else 0):
        profiles, spread = calibrated_profiles(
            model, plan, profiles, group, micro, warmup=1 if r == 0 else 0, damping=0.7
        )
        balanced = balanced + 1 if spread <= BALANCED else 0
        if balanced == 2:  # twice in a row: one lucky measurement is not enough
            break
        new = plan_of(profiles)
        if any(new.split(s) != plan.split(s) for s in SEGMENTS):
            model = build_for(source, new, group)
        plan = new
    return plan, profiles, model
