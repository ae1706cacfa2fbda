"""Refine the profile with real passes, then plan again.

The profiler times each segment's shard alone, which is quick but not the whole truth:
inside a real step a device also pays for cache traffic between segments, for the
Python around the kernels, and for whatever else its host runs. So after planning,
each device runs real forward+backward passes of the planned shards (with the real
collectives, no parameter update) and times the compute between collectives. Each
compute span is attributed to the segment whose collective ends it::

    … L3.attn.out.fwd │ norm, SwiGLU │ L3.mlp.out.fwd │ final norm, logits │ vocab.ce …
                       └── mlp ───────┘                └── vocab ───────────┘

**Robust per pass.** A device's time for ``attn`` (``mlp``) in one pass is the number of
layers times the *median* over layers of that layer's forward + backward spans: every
layer does the same work, so one span stretched by a CFS throttle or a hiccup of the host
does not move the estimate. ``vocab`` is the sum of its spans; ``other`` is the rest
(gradient norm, the step's tail), which no split can balance.

**Pooled over rounds.** Device ``i``'s factor for segment ``s`` is what it measured,
summed over every round so far, over what its *profiled* curve (plus its replicated work
before that barrier) predicted for the units it held in each round — later rounds, run
closer to the balanced plan, weigh more. One pass on a shared host is off by ±20 % per
segment; pooling averages that out, and refitting from the profile each round (rather
than compounding corrections) cannot drift. The calibrated curves keep the profiled
shape; planning with them is still the exact planner.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
from xronos.planner.solve import DEFAULT_REPLICATED_SHARE
from xronos.planner.profile import CostCurve, DeviceProfile

_LAYER = re.compile(r"^L(\d+)\.")


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
    """Seconds of compute per segment in one recorded pass: for ``attn`` and ``mlp`` the
    number of layers times the median layer (forward + backward spans of that layer)."""
    out = dict.fromkeys((*SEGMENTS, "other"), 0.0)
    per_layer: dict[tuple[str, int], float] = defaultdict(float)
    t = rec.start
    for c in rec.collectives:
        seconds, t = max(0.0, c.arrive - t), c.leave
        seg, layer = segment_of(c.name), _LAYER.match(c.name)
        if layer is not None and seg in ("attn", "mlp"):
            per_layer[seg, int(layer.group(1))] += seconds
        else:
            out[seg] += seconds
    out["other"] += max(0.0, rec.end - t)
    for seg in ("attn", "mlp"):
        layers = [v for (s, _), v in per_layer.items() if s == seg]
        if layers:
            out[seg] += len(layers) * statistics.median(layers)
    return out


def measure_plan(
    model: LlamaForCausalLM, group: TPGroup, micro: list[Batch], passes: int = 1, warmup: int = 1
) -> dict[str, float]:
    """Per-segment compute of ``passes`` real forward+backward passes (the median pass per
    segment) after ``warmup`` uncounted ones. Parameters and dropout streams are left as
    they were."""
    gens = [m.dropout_gen for m in model.modules() if isinstance(m, LoRALinear)]
    saved = [g.get_state() for g in gens]
    rec = SpanRecorder(group.rank, enabled=True)
    samples: list[dict[str, float]] = []
    for step in range(warmup + passes):
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
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


@dataclass(frozen=True)
class Round:
    """One calibration round: the plan that ran and what every device measured."""

    plan: Plan
    measured: list[dict[str, float]]
    weight: float = 1.0


def fit(profiles: Sequence[DeviceProfile], rounds: Sequence[Round]) -> list[DeviceProfile]:
    """``profiles`` (as profiled) rescaled, per device and segment, to predict the pooled
    measurements of ``rounds``. A segment a device never held units of gets the factor of
    its whole measured compute."""
    share = DEFAULT_REPLICATED_SHARE
    total_w = sum(r.weight for r in rounds)
    out = []
    for i, p in enumerate(profiles):

        def predicted(seg: str, plan: Plan, p: DeviceProfile = p, i: int = i) -> float:
            return p.replicated_before(seg, share) + p.segments[seg](plan.split(seg)[i])

        def ratio(held: Sequence[Round], segs: Sequence[str], i: int = i) -> float | None:
            m = sum(r.weight * r.measured[i][s] for r in held for s in segs)
            pr = sum(r.weight * predicted(s, r.plan) for r in held for s in segs)
            return m / pr if m > 0 and pr > 0 else None

        whole = ratio(rounds, SEGMENTS) or 1.0
        k = {
            s: ratio([r for r in rounds if r.plan.split(s)[i] > 0], [s]) or whole for s in SEGMENTS
        }
        split = {s: k[s] * p.replicated_before(s, share) for s in SEGMENTS}
        tail = sum(r.weight * r.measured[i]["other"] for r in rounds) / total_w
        out.append(
            replace(
                p,
                segments={s: CostCurve(c.a * k[s], c.b * k[s]) for s, c in p.segments.items()},
                replicated_s=sum(split.values()) + tail,
                replicated_split=split,
            )
        )
    return out


def settled(a: Plan, b: Plan) -> bool:
    """Whether two plans differ by at most one unit (or 1 %) per device and segment."""
    for s in SEGMENTS:
        tol = max(1, sum(a.split(s)) // 100)
        if any(abs(x - y) > tol for x, y in zip(a.split(s), b.split(s), strict=True)):
            return False
    return True


def _gather(obj: Any, group: TPGroup) -> list[Any]:
    if group.size == 1:
        return [obj]
    out: list[Any] = [None] * group.size
    dist.all_gather_object(out, obj, group=group.pg)
    return out


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
    """Plan from ``profiles``, then up to ``rounds`` times: measure the plan for real, fit
    the profiles to every round so far and plan again — until the plan has settled (moved
    by at most a unit) twice in a row. Returns the plan, the calibrated profiles and the
    model built for the plan. Every rank gets the same result: measurements are shared."""
    from xronos.engine.worker import build_for
    from xronos.planner import plan_tp

    def plan_of(ps: list[DeviceProfile]) -> Plan:
        return plan_tp(source.cfg, ps, mlp_chunk=mlp_chunk, vocab_chunk=vocab_chunk)

    plan = plan_of(profiles)
    model = build_for(source, plan, group)
    history: list[Round] = []
    fitted, calm = profiles, 0
    for r in range(rounds if group.size > 1 else 0):
        with torch.enable_grad():
            mine = measure_plan(model, group, micro, passes=2 if r == 0 else 1, warmup=int(r == 0))
        history.append(Round(plan, _gather(mine, group), weight=float(r + 1)))
        fitted = fit(profiles, history)
        new = plan_of(fitted)
        calm = calm + 1 if settled(new, plan) else 0
        if any(new.split(s) != plan.split(s) for s in SEGMENTS):
            model = build_for(source, new, group)
        plan = new
        if calm == 2:  # twice in a row: one lucky round is not enough
            break
    return plan, fitted, model
