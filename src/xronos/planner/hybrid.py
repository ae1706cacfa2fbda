"""Hybrids: tensor parallelism inside a well-connected group, pipeline stages across.

Over a slow link, four all-reduces of the activation per layer cost more than they save,
but a pipeline sends one activation per micro-batch per stage boundary. So devices with
fast links are grouped (every device whose link bandwidth is at least some threshold,
for each threshold that leaves at least two devices in the group and one outside), the
group runs one pipeline stage as heterogeneous TP, and the devices outside are further
stages::

    [fast0 ═ fast1] ──p2p── slow2          (═ TP all-reduces, ── one message)

The group as a stage (:func:`tp_stage`): its per-layer time is what :func:`predict`
gives the group's TP plan for the attention and MLP barriers (with their all-reduces)
divided by the layers, and its head the vocabulary barrier, its collectives and the
per-step ones. What each micro-batch pays however few its tokens is, per barrier, the
slowest member's profiled split cost for its units plus the collectives' latency (the
same prediction with zero-byte messages). Its link to the other stages is its worst
member's (the stage's input must reach every member). Memory: the group must hold the
whole model's TP shards (as :func:`plan_tp` checks), which is stricter than a stage of
some layers needs — so a hybrid may be missed when memory is tight, never proposed when
it does not fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.planner.comm import LinkModel, slowest
from xronos.planner.pipeline import PipelinePlan, StageCosts
from xronos.planner.pipesearch import StageDevice, device_stages, search_pipeline
from xronos.planner.plan import Plan
from xronos.planner.profile import DeviceProfile
from xronos.planner.solve import plan_tp, predict

NO_HYBRID = "a hybrid needs two devices on faster links than a third's"
"""Why a cluster has no hybrid candidate at all."""


@dataclass(frozen=True)
class HybridPlan:
    """Pipeline stages, one of them a tensor-parallel group."""

    groups: tuple[tuple[int, ...], ...]
    """Per pipeline stage, the cluster ranks that run it (TP among them when several)."""
    pipeline: PipelinePlan
    """The stages' layers and micro-batches (``ranks[j]`` = ``groups[j][0]``)."""
    tp: Plan
    """The tensor-parallel plan inside the group (its devices in ``groups``' order)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": [list(g) for g in self.groups],
            "pipeline": self.pipeline.to_dict(),
            "tp": self.tp.to_dict(),
        }

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device that runs a stage, in stage order (a TP stage's in its order)."""
        out: list[str] = []
        for j, g in enumerate(self.groups):
            out += list(self.tp.devices) if len(g) > 1 else [self.pipeline.devices[j]]
        return tuple(out)

    def table(self) -> str:
        """The stages' table, then the tensor-parallel stage's plan."""
        j = next(j for j, g in enumerate(self.groups) if len(g) > 1)
        return (
            f"{self.pipeline.table()}\nstage {j}, tensor-parallel over "
            f"{', '.join(self.tp.devices)}:\n{self.tp.table()}"
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HybridPlan:
        return cls(
            tuple(tuple(int(r) for r in g) for g in d["groups"]),
            PipelinePlan.from_dict(dict(d["pipeline"])),
            Plan.from_dict(dict(d["tp"])),
        )


def fast_groups(links: Sequence[LinkModel]) -> list[tuple[int, ...]]:
    """Rank groups of fast links: for each bandwidth threshold, the ranks at or above it,
    when that leaves at least two in and one out."""
    out = []
    for bw in sorted({x.bandwidth_bps for x in links}, reverse=True):
        group = tuple(i for i, x in enumerate(links) if x.bandwidth_bps >= bw)
        if 2 <= len(group) < len(links):
            out.append(group)
    return out


def tp_stage(
    cfg: ModelConfig,
    profiles: Sequence[DeviceProfile],
    group: tuple[int, ...],
    tp_kwargs: Mapping[str, Any],
) -> tuple[StageDevice, Plan]:
    """The TP group ``group`` as one stage device (see the top); UserError if it has no plan."""
    members = [profiles[i] for i in group]
    plan = plan_tp(cfg, members, **tp_kwargs)
    share = tp_kwargs.get("replicated_share")
    pred = predict(plan, members, replicated_share=share)
    seg = pred["segments"]
    latency = predict(plan, [_zero_bytes(p) for p in members], replicated_share=share)
    fixed = {s: _split(members, plan, s) + latency["segments"][s]["transfer_s"] for s in seg}
    layer = sum(seg[s]["barrier_s"] + seg[s]["transfer_s"] for s in ("attn", "mlp"))
    step_transfer = pred["transfer_s"] - sum(v["transfer_s"] for v in seg.values())
    head = seg["vocab"]["barrier_s"] + seg["vocab"]["transfer_s"] + step_transfer
    links = [p.link for p in members]
    link = (
        None
        if any(x is None for x in links)
        else slowest(
            [x for x in links if x is not None], max(x.latency_s for x in links if x is not None)
        )
    )
    costs = StageCosts(
        name="+".join(p.name for p in members),
        layer_s=layer / cfg.num_layers,
        head_s=head,
        layer_split_s=(fixed["attn"] + fixed["mlp"]) / cfg.num_layers,
        head_split_s=fixed["vocab"],
    )
    legacy = max(p.allreduce_s for p in members)
    return StageDevice(costs, link, group, legacy_send_s=legacy), plan


def _zero_bytes(p: DeviceProfile) -> DeviceProfile:
    """``p`` whose collectives carry no bytes: what they cost is their latency alone."""
    return replace(p, traffic={k: [(n, 0) for n, _ in v] for k, v in p.traffic.items()})


def _split(members: Sequence[DeviceProfile], plan: Plan, seg: str) -> float:
    """The slowest member's profiled cost of one more micro-batch in ``seg`` for the units
    it holds (the profile's is for all of them)."""
    total = max(sum(plan.split(seg)), 1)
    return max(
        (p.split_s or {}).get(seg, 0.0) * u / total
        for p, u in zip(members, plan.split(seg), strict=True)
    )


def plan_hybrids(
    cfg: ModelConfig,
    profiles: Sequence[DeviceProfile],
    *,
    batch_size: int,
    grad_accum: int,
    act_bytes: float,
    tp_kwargs: Mapping[str, Any],
    max_permuted: int = 5,
    tied_bytes: float = 0.0,
) -> list[tuple[HybridPlan | None, str]]:
    """Per fast group: the best hybrid (None, with the reason, when there is none);
    ``tied_bytes`` as for :func:`~xronos.planner.pipesearch.search_pipeline`."""
    links = [p.link for p in profiles]
    if any(x is None for x in links):
        return []
    chunks = {k: tp_kwargs.get(k) for k in ("mlp_chunk", "vocab_chunk")}
    singles = device_stages(profiles, cfg, **chunks)
    out: list[tuple[HybridPlan | None, str]] = []
    for group in fast_groups([x for x in links if x is not None]):
        names = "[" + ", ".join(profiles[i].name for i in group) + "]"
        try:
            stage, tp = tp_stage(cfg, profiles, group, tp_kwargs)
        except UserError as e:
            out.append((None, f"tp group {names}: {e}"))
            continue
        rest = [d for i, d in enumerate(singles) if i not in group]
        pplan = search_pipeline(
            cfg.num_layers,
            [stage, *rest],
            batch_size=batch_size,
            grad_accum=grad_accum,
            act_bytes=act_bytes,
            max_permuted=max_permuted,
            must=0,
            tied_bytes=tied_bytes,
        )
        if pplan is None or not math.isfinite(pplan.predicted_step_s):
            out.append((None, f"tp group {names}: no stage split fits in memory"))
            continue
        by_rank = {d.ranks[0]: d.ranks for d in [stage, *rest]}
        groups = tuple(by_rank[r] for r in pplan.stage_ranks)
        out.append((HybridPlan(groups, pplan, tp), ""))
    return out
