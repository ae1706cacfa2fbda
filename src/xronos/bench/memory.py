"""Memory in ``xronos bench``: what each strategy is predicted to need on every device,
which strategies cannot run within the devices' caps, and what each one really peaked at.

*Prediction*: a device's process holds its runtime (interpreter, torch, the collectives'
library: measured on the device, with nothing of the model alive) plus what the memory
model (:mod:`xronos.planner.memory`) says its part of the strategy's plan needs. A device
with no part in a strategy is predicted at its runtime.

*Measurement* (:mod:`xronos.metrics.rss`): the kernel's high-water mark of the process's
resident memory, reset before each strategy's turn (or step, interleaved). In turn, freed
memory is handed back before each turn, so a peak is the strategy's own. Interleaved, it is
not: the workers keep what they free (:mod:`xronos.comm.heap`, so that no step pays page
faults for another's), and a strategy's peak is the process's resident memory while it ran,
at most the largest of them all (``memory.peak_scope`` says which).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.metrics.rss import MIB
from xronos.planner.auto import AutoChoice, Candidate, pipeline_needs
from xronos.planner.hybrid import NO_HYBRID, HybridPlan
from xronos.planner.memory import tp_need
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.profile import DeviceProfile
from xronos.train.session import Strategy


@dataclass(frozen=True)
class Verdict:
    """Whether a strategy can run within the caps, and what it is predicted to hold."""

    need_bytes: tuple[int, ...] | None
    """Per device, the model's part (runtime excluded); None where no plan is known."""
    reason: str = ""
    """Why it cannot run ("" when it can)."""

    @property
    def feasible(self) -> bool:
        return not self.reason


def plan_needs(
    cfg: ModelConfig,
    profiles: Sequence[DeviceProfile],
    plan: Plan | PipelinePlan | HybridPlan,
    totals: Mapping[str, int],
) -> list[int]:
    """Per device (rank order): the bytes its part of ``plan`` needs (0: no part; a
    hybrid's TP stage errs high, as its planner does: the whole model's shards)."""
    ranks = {p.name: r for r, p in enumerate(profiles)}
    out = [0] * len(profiles)
    if isinstance(plan, HybridPlan):  # the TP stage's members: their whole-model shards
        pipe = pipeline_needs(cfg, profiles, plan.pipeline, totals)
        for group, need in zip(plan.groups, pipe, strict=True):
            for i, r in enumerate(group):
                split = {s: plan.tp.split(s)[i] for s in SEGMENTS}
                out[r] = need if len(group) == 1 else tp_need(profiles[r], split)
        return out
    if isinstance(plan, PipelinePlan):
        for r, need in zip(
            plan.stage_ranks, pipeline_needs(cfg, profiles, plan, totals), strict=True
        ):
            out[r] = need
        return out
    for i, name in enumerate(plan.devices):
        r = ranks[name]
        out[r] = tp_need(profiles[r], {s: plan.split(s)[i] for s in SEGMENTS})
    return out


def plan_from_dict(d: Mapping[str, Any]) -> Plan | PipelinePlan | HybridPlan | None:
    """A session's described plan (None for anything else)."""
    try:
        if "groups" in d:
            return HybridPlan.from_dict(d)
        return PipelinePlan.from_dict(dict(d)) if "layer_ranges" in d else Plan.from_dict(dict(d))
    except (KeyError, TypeError, ValueError, UserError):  # a description, not a plan
        return None


def _candidate(choice: AutoChoice, s: Strategy, fastest: int) -> Candidate | None:
    """The planner's candidate for what the bench runs as ``s``."""
    n = len(choice.names)
    want = {
        Strategy.SINGLE: ("single", (fastest,)),
        Strategy.XRONOS: ("xronos", tuple(range(n))),
        Strategy.TP_EVEN: ("tp-even", None),
        Strategy.HYBRID: ("hybrid", None),
    }.get(s, ("pp-1f1b", None))
    found = [
        c
        for c in choice.candidates
        if c.strategy == want[0] and (want[1] is None or c.devices == want[1])
    ]
    # the best feasible one (what runs), else the first with its reason
    return min(found, key=lambda c: (not c.feasible, c.predicted_step_s), default=None)


def verdicts(
    strategies: Sequence[Strategy],
    choice: AutoChoice,
    cfg: ModelConfig,
    profiles: Sequence[DeviceProfile],
    totals: Mapping[str, int],
    caps: Sequence[int | None],
    runtime: Sequence[int],
    fastest: int,
) -> dict[Strategy, Verdict]:
    """Each strategy's predicted need and whether it fits, decided before anything runs.

    ``profiles`` must already give the memory usable by the model
    (:func:`~xronos.planner.memory.within_caps`); a strategy is infeasible where the
    planner found no plan that fits, and the reason names the device, its predicted
    resident memory (runtime included) and its cap, in MiB."""
    out: dict[Strategy, Verdict] = {}
    runnable = [c for c in choice.candidates if c.feasible]
    for s in strategies:
        if s is Strategy.AUTO:
            best = min(runnable, key=lambda c: c.predicted_step_s) if runnable else None
            if best is None:
                out[s] = Verdict(None, "no strategy fits the devices' memory")
            elif isinstance(best.plan, Plan | PipelinePlan | HybridPlan):
                out[s] = Verdict(tuple(plan_needs(cfg, profiles, best.plan, totals)))
            else:
                out[s] = Verdict(None)
            continue
        c = _candidate(choice, s, fastest)
        if c is None and s is Strategy.HYBRID:
            out[s] = Verdict(None, f"no hybrid: {NO_HYBRID}")
            continue
        plan: Plan | PipelinePlan | HybridPlan | None = None
        if c is not None and isinstance(c.plan, Plan | PipelinePlan | HybridPlan):
            plan = c.plan
        elif s is Strategy.SINGLE:
            plan = Plan.single(cfg, profiles[fastest].name)
        elif s is Strategy.TP_EVEN:
            plan = Plan.even(cfg, [p.name for p in profiles])
        need = None if plan is None else tuple(plan_needs(cfg, profiles, plan, totals))
        if c is None or c.feasible:
            out[s] = Verdict(need)
            continue
        out[s] = Verdict(need, _over(need, caps, runtime, profiles) or c.why)
    return out


def _over(
    need: Sequence[int] | None,
    caps: Sequence[int | None],
    runtime: Sequence[int],
    profiles: Sequence[DeviceProfile],
) -> str:
    """Why the first device over its cap cannot run the plan (its predicted resident
    memory, runtime and model, against the cap, MiB); "" if none is or the need is
    unknown."""
    if need is None:
        return ""
    for p, n, cap, rt in zip(profiles, need, caps, runtime, strict=True):
        if cap is not None and n and rt + n > cap:
            return (
                f"needs {(rt + n) / MIB:.0f} MiB on {p.name} (runtime {rt / MIB:.0f} + model "
                f"{n / MIB:.0f}), cap {cap / MIB:.0f} MiB"
            )
    return ""


def take_turns(
    found: Mapping[Strategy, Verdict],
    caps: Sequence[int | None],
    runtime: Sequence[int],
    solo: Sequence[int],
) -> bool:
    """Whether the strategies must run one after another rather than interleaved: some
    capped device could not hold every feasible strategy's part at once (a tensor-parallel
    part twice: the stall measurement builds a twin of it), plus its own whole model for
    the solo time (``solo``: its bytes, 0 where it is not run), on top of its runtime.
    Unknown needs count as not fitting."""
    for i, cap in enumerate(caps):
        if cap is None:
            continue
        total = runtime[i] + solo[i]
        for s, v in found.items():
            if not v.feasible:
                continue
            if v.need_bytes is None:
                return True
            total += v.need_bytes[i] * (1 if s.is_pipeline else 2)
        if total > cap:
            return True
    return False
