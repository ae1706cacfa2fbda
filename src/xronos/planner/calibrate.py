"""Calibration's arithmetic: fit the profiles to what real passes of a plan measured.

(The passes themselves run in :mod:`xronos.profiler.calibrate`; this module is pure.)

The profiler times each segment's shard alone, which is quick but not the whole truth:
inside a real step a device also pays for cache traffic between segments, for the
Python around the kernels, and for whatever else its host runs. So after planning,
each device runs real forward+backward passes of the planned shards (with the real
collectives, no parameter update) and times the compute between collectives. Each
compute span is attributed to the segment whose collective ends it — every collective of a
segment carries that segment (and its layer) in its span's ``kind``
(:func:`~xronos.planner.plan.segment_kind`)::

    … L3.attn.out.fwd │ norm, SwiGLU │ L3.mlp.out.fwd │ final norm, logits │ vocab.ce …
                       └── mlp ───────┘                └── vocab ───────────┘

**Robust per pass.** A device's time for ``attn`` (``mlp``) in one pass is the number of
layers times the *median* over layers of that layer's forward + backward spans: every
layer does the same work, so one span stretched by a CFS throttle or a hiccup of the host
does not move the estimate. ``vocab`` is the sum of its spans; ``other`` is the rest
(gradient norm, the step's tail), which no split can balance.

**Every segment measured on every device.** A device that the profile gives no units of a
segment would never run it in a calibration pass, and its curve for that segment would
keep the profile's shape, however wrong: two timings a quarter apart put the slow device's
attention intercept anywhere from 20 to 70 ms in four profiles on one host, and a large
one leaves it no head. So where the first plan leaves a device out of a segment, the first
round runs a probe plan instead (:func:`probe_plan`: the same planner, every device at
least one unit of those segments), and every later round plans freely from what it
measured.

**Pooled over rounds.** Device ``i``'s factor for segment ``s`` is what it measured,
summed over every round so far, over what its *profiled* curve (plus its replicated work
before that barrier) predicted for the units it held in each round — later rounds, run
closer to the balanced plan, weigh more. One pass on a shared host is off by ±20 % per
segment; pooling averages that out, and refitting from the profile each round (rather
than compounding corrections) cannot drift. The calibrated curves keep the profiled
shape; planning with them is still the exact planner.

**One stray round left out.** Pooling averages noise but not a hiccup: a host that
stalls one device for one pass can stretch that pass's segment by a third, and with three
to five rounds weighted 1 … 5 the last pass moves the pooled factor by a tenth to a sixth
— a unit or two on the slow device, and a plan that idles. So where three or more rounds
hold a segment, the round whose ratio (measured over predicted) strays farthest from the
median of the device's rounds is left out of that segment's pool when it strays by more
than :data:`OUTLIER` (:func:`pooled`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from xronos.errors import UserError
from xronos.metrics.records import StepRecord
from xronos.planner.plan import SEGMENTS, Plan, parse_segment_kind
from xronos.planner.profile import CostCurve, DeviceProfile
from xronos.planner.solve import DEFAULT_REPLICATED_SHARE

OUTLIER = 0.15
"""How far one round's measured-over-predicted ratio, for one device and segment, may stray
from the median of that device's rounds before the fit leaves it out. Over 139 ``ci-2dev``
runs, a device's most deviant round for a segment strayed a median 4.4 % from its others
and 14.5 % at the 90th percentile; the 8 % of device-segments past 15 % include the rounds
that moved plans out of balance."""


def segment_times(rec: StepRecord) -> dict[str, float]:
    """Seconds of compute per segment in one recorded pass: for ``attn`` and ``mlp`` the
    number of layers times the median layer (forward + backward spans of that layer)."""
    out = dict.fromkeys((*SEGMENTS, "other"), 0.0)
    per_layer: dict[tuple[str, int], float] = defaultdict(float)
    t = rec.start
    for c in rec.collectives:
        seconds, t = max(0.0, c.arrive - t), c.leave
        tag = parse_segment_kind(c.kind)
        if tag is None:
            out["other"] += seconds
        elif tag[1] is not None and tag[0] in ("attn", "mlp"):
            per_layer[tag[0], tag[1]] += seconds
        else:
            out[tag[0]] += seconds
    out["other"] += max(0.0, rec.end - t)
    for seg in ("attn", "mlp"):
        layers = [v for (s, _), v in per_layer.items() if s == seg]
        if layers:
            out[seg] += len(layers) * statistics.median(layers)
    return out


@dataclass(frozen=True)
class Round:
    """One calibration round: the plan that ran and what every device measured."""

    plan: Plan
    measured: list[dict[str, float]]
    weight: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        """The round as a report shows it: the units each device held per segment, and the
        seconds each device measured per segment."""
        return {
            "units": {seg: list(self.plan.split(seg)) for seg in SEGMENTS},
            "measured_s": [dict(m) for m in self.measured],
            "weight": self.weight,
        }


def _pool(
    p: DeviceProfile, i: int, held: Sequence[Round], segs: Sequence[str]
) -> tuple[float | None, list[int]]:
    """Device ``i``'s factor for ``segs`` over the rounds ``held`` (measured over what
    profile ``p`` predicted, pooled by weight; None where nothing was measured), and which
    of those rounds (indices into ``held``) the pool left out (:func:`pooled`)."""
    share = DEFAULT_REPLICATED_SHARE

    def predicted(seg: str, plan: Plan) -> float:
        return p.replicated_before(seg, share) + p.segments[seg](plan.split(seg)[i])

    m = [sum(r.measured[i][s] for s in segs) for r in held]
    pr = [sum(predicted(s, r.plan) for s in segs) for r in held]
    kept = pooled(m, pr)
    mw = sum(held[j].weight * m[j] for j in kept)
    pw = sum(held[j].weight * pr[j] for j in kept)
    return (mw / pw if mw > 0 and pw > 0 else None), sorted(set(range(len(held))) - set(kept))


def _holding(rounds: Sequence[Round], seg: str, i: int) -> list[int]:
    """The rounds (indices) in which device ``i`` held units of ``seg``."""
    return [j for j, r in enumerate(rounds) if r.plan.split(seg)[i] > 0]


def fit(profiles: Sequence[DeviceProfile], rounds: Sequence[Round]) -> list[DeviceProfile]:
    """``profiles`` (as profiled) rescaled, per device and segment, to predict the pooled
    measurements of ``rounds``. A segment a device never held units of gets the factor of
    its whole measured compute."""
    share = DEFAULT_REPLICATED_SHARE
    total_w = sum(r.weight for r in rounds)
    out = []
    for i, p in enumerate(profiles):
        whole = _pool(p, i, rounds, SEGMENTS)[0] or 1.0
        k = {
            s: _pool(p, i, [rounds[j] for j in _holding(rounds, s, i)], [s])[0] or whole
            for s in SEGMENTS
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


def left_out(
    profiles: Sequence[DeviceProfile], rounds: Sequence[Round]
) -> list[dict[str, list[int]]]:
    """Per round: the segments whose pooled factor in :func:`fit` left that round out, and
    for which devices (rank order)."""
    out: list[dict[str, list[int]]] = [{} for _ in rounds]
    for i, p in enumerate(profiles):
        for s in SEGMENTS:
            held = _holding(rounds, s, i)
            for j in _pool(p, i, [rounds[h] for h in held], [s])[1]:
                out[held[j]].setdefault(s, []).append(i)
    return out


def pooled(measured: Sequence[float], predicted: Sequence[float]) -> list[int]:
    """The rounds (indices) whose measurements one device's factor for one segment pools:
    all of them, less the one whose measured-over-predicted ratio strays farthest from
    the median ratio where it strays by more than :data:`OUTLIER` and at least three rounds
    hold the segment."""
    every = list(range(len(measured)))
    pairs = zip(measured, predicted, strict=True)
    q = {j: m / p for j, (m, p) in enumerate(pairs) if m > 0 and p > 0}
    if len(q) < 3:
        return every
    mid = statistics.median(q.values())
    worst = max(q, key=lambda j: abs(q[j] / mid - 1.0))
    if abs(q[worst] / mid - 1.0) <= OUTLIER:
        return every
    return [j for j in every if j != worst]


def typical(rounds: Sequence[Round]) -> list[Round]:
    """Rounds of one plan as a single round of their medians, per device and segment (the
    weights summed), so that a few steps a busy host stretched on one device do not read as
    that device being slower; rounds of several plans are returned as they are (pooling
    them is what tells the curves' shapes apart)."""
    if len(rounds) < 3 or any(r.plan != rounds[0].plan for r in rounds):
        return list(rounds)
    keys = rounds[0].measured[0].keys()
    medians = [
        {k: statistics.median(r.measured[i][k] for r in rounds) for k in keys}
        for i in range(len(rounds[0].measured))
    ]
    return [Round(rounds[0].plan, medians, sum(r.weight for r in rounds))]


def settled(a: Plan, b: Plan) -> bool:
    """Whether two plans differ by at most one unit (or 1 %) per device and segment."""
    for s in SEGMENTS:
        tol = max(1, sum(a.split(s)) // 100)
        if any(abs(x - y) > tol for x, y in zip(a.split(s), b.split(s), strict=True)):
            return False
    return True


def probe_plan(plan: Plan, plan_with: Callable[[dict[str, int]], Plan]) -> Plan | None:
    """The plan a first calibration round runs instead of ``plan`` when ``plan`` leaves a
    device without units of some segment: ``plan_with`` (the planner, given the fewest
    units every device must hold per segment) with one unit of each such segment; None
    when every device holds units of every segment, or when no plan can give them one
    (memory)."""
    if plan.world_size < 2:
        return None
    empty = {s: 1 for s in SEGMENTS if min(plan.split(s)) == 0}
    if not empty:
        return None
    try:
        return plan_with(empty)
    except UserError:
        return None
