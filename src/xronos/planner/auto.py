"""The ``auto`` strategy: predict every way to run the step, pick the fastest that fits.

Collaboration pays only when the compute it saves exceeds the communication it adds, so
:func:`plan_auto` predicts, from the profiles alone (a pure function, no processes):

=========  ===============================================================================
single     each device alone with the whole model (infeasible when it does not fit)
xronos     heterogeneous TP over the best *subset* of two or more devices: a device whose
           compute saving is below the collectives it adds leaves entirely
tp-even    Megatron's even split over every device (the baseline, for the table)
pp-1f1b    the best pipeline: devices, order (so where the LM head lands), layer split and
           micro-batch count searched (:mod:`xronos.planner.pipesearch`)
hybrid     TP inside a group of fast links, pipeline stages across the slow ones
           (:mod:`xronos.planner.hybrid`)
=========  ===============================================================================

Every prediction is for one optimizer step of ``grad_accum`` batches; the TP step is
:func:`~xronos.planner.solve.predict` (barriers + collectives, :mod:`xronos.planner.comm`)
per batch. The fastest feasible candidate wins; on a tie the simpler strategy (earlier in
the table above) does.

A candidate is feasible only if what each of its devices must hold fits the memory usable
there (:mod:`xronos.planner.memory`): the heterogeneous split is planned within it, and
the even split and the pipeline's stages (a tied embedding's copy on the first stage
included) are checked after planning; an infeasible candidate says what it needs and
where.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.planner.hybrid import HybridPlan, plan_hybrids
from xronos.planner.memory import fits_alone, stage_need, tp_need
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.pipesearch import activation_bytes, device_stages, search_pipeline
from xronos.planner.plan import (
    SEGMENTS,
    Plan,
    default_mlp_chunk,
    default_vocab_chunk,
    segment_units,
)
from xronos.planner.profile import DeviceProfile
from xronos.planner.solve import _check_profiles, plan_even, plan_tp, predict

AnyPlan = Plan | PipelinePlan | HybridPlan


@dataclass(frozen=True)
class Candidate:
    """One way to run the step, with its prediction."""

    strategy: str
    """``single``, ``xronos``, ``tp-even``, ``pp-1f1b`` or ``hybrid``."""
    devices: tuple[int, ...]
    """Ranks taking part (in stage order for pipelines and hybrids)."""
    predicted_step_s: float
    """Seconds per optimizer step (inf when infeasible)."""
    plan: AnyPlan | None
    """What to run (None when infeasible)."""
    feasible: bool
    why: str
    """How the prediction is made up, or why it is infeasible."""
    compute_s: float | None = None
    """Of ``predicted_step_s``: barriers (TP) or compute (single); None for pipelines,
    whose compute and sends overlap across stages."""
    transfer_s: float | None = None
    """Of ``predicted_step_s``: collectives (TP), 0 (single); None for pipelines."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "compute_s": self.compute_s,
            "transfer_s": self.transfer_s,
            "strategy": self.strategy,
            "devices": list(self.devices),
            "predicted_step_s": self.predicted_step_s if self.feasible else None,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "feasible": self.feasible,
            "why": self.why,
        }


@dataclass(frozen=True)
class AutoChoice:
    """Every candidate and the winner (the fastest feasible)."""

    names: tuple[str, ...]
    """Device names, in rank order."""
    candidates: tuple[Candidate, ...]

    @property
    def chosen(self) -> Candidate:
        feasible = [c for c in self.candidates if c.feasible]
        if not feasible:
            raise UserError(
                "auto: no strategy fits the devices' memory; add memory or devices, or use a "
                "smaller model"
            )
        return min(feasible, key=lambda c: c.predicted_step_s)  # first of equals: simplest

    def label(self, c: Candidate) -> str:
        """``c`` as the table names it: ``pp-1f1b [slow -> fast]``."""
        return f"{c.strategy} {_names(self.names, c)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": list(self.names),
            "chosen": self.candidates.index(self.chosen),
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def table(self) -> str:
        """One row per candidate, fastest feasible first; the winner is marked ``*``."""
        best = self.chosen if any(c.feasible for c in self.candidates) else None
        rows = [("", "strategy", "devices", "pred. s/step", "why")]
        order = sorted(self.candidates, key=lambda c: (not c.feasible, c.predicted_step_s))
        for c in order:
            rows.append(
                (
                    "*" if c is best else "",
                    c.strategy,
                    _names(self.names, c),
                    f"{c.predicted_step_s:.4f}" if c.feasible else "infeasible",
                    c.why,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            "  ".join(v.ljust(w) for v, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
            for r in rows
        ]
        return "\n".join(x.rstrip() for x in lines)


def _names(names: Sequence[str], c: Candidate) -> str:
    """``[a, b]`` for TP, ``[a -> b]`` for stages, ``[a -> b+c]`` for a hybrid's stages."""
    if isinstance(c.plan, HybridPlan):
        stages = ["+".join(names[r] for r in g) for g in c.plan.groups]
        return "[" + " -> ".join(stages) + "]"
    sep = " -> " if c.strategy == "pp-1f1b" else ", "
    return "[" + sep.join(names[r] for r in c.devices) + "]"


def _tp_split(pred: Mapping[str, Any], grad_accum: int) -> tuple[float, float]:
    """(compute, transfer) seconds per optimizer step of a TP prediction per batch."""
    step_only = pred["transfer_s"] - sum(v["transfer_s"] for v in pred["segments"].values())
    # a barrier's wait for late arrivals counts with the compute it ends
    compute = (pred["compute_step_s"] + pred.get("sync_s", 0.0)) * grad_accum
    return compute, (pred["transfer_s"] - step_only) * grad_accum + step_only


@dataclass(frozen=True)
class _Job:
    """What every candidate shares."""

    cfg: ModelConfig
    profiles: Sequence[DeviceProfile]
    totals: Mapping[str, int]
    batch_size: int
    grad_accum: int
    act_bytes: float
    tp_kwargs: Mapping[str, Any]
    max_permuted: int
    tied_bytes: float = 0.0
    """A pipeline's end stages send each way, per step, the tied matrix's rows of the
    step's tokens (0: untied or frozen)."""

    def singles(self) -> list[Candidate]:
        out = []
        for r, p in enumerate(self.profiles):
            if not fits_alone(p, self.totals):
                why = _short_of_memory([p], [tp_need(p, self.totals)])
                out.append(Candidate("single", (r,), math.inf, None, False, why))
                continue
            t = p.step_time(dict(self.totals)) * self.grad_accum
            plan = Plan(
                strategy="single",
                devices=(p.name,),
                mlp_chunk=self.tp_kwargs["mlp_chunk"],
                vocab_chunk=self.tp_kwargs["vocab_chunk"],
                attn=(self.totals["attn"],),
                mlp=(self.totals["mlp"],),
                vocab=(self.totals["vocab"],),
            )
            why = f"= {t:.4f} compute, no transfer"
            out.append(Candidate("single", (r,), t, plan, True, why, t, 0.0))
        return out

    def tp(self, ranks: Sequence[int], *, even: bool = False) -> Candidate:
        members = [self.profiles[r] for r in ranks]
        strategy = "tp-even" if even else "xronos"
        share = self.tp_kwargs.get("replicated_share")
        try:
            if even:
                plan = plan_even(self.cfg, members, replicated_share=share)
            else:
                plan = plan_tp(self.cfg, list(members), **self.tp_kwargs)
            pred = predict(plan, members, replicated_share=share)
        except UserError as e:
            return Candidate(strategy, tuple(ranks), math.inf, None, False, str(e))
        short = _short_of_memory(
            members,
            [tp_need(p, {s: plan.split(s)[i] for s in SEGMENTS}) for i, p in enumerate(members)],
        )
        if short:  # the even split ignores memory
            return Candidate(strategy, tuple(ranks), math.inf, None, False, short)
        compute, transfer = _tp_split(pred, self.grad_accum)
        why = f"= {compute:.4f} compute + {transfer:.4f} transfer"
        return Candidate(
            strategy, tuple(ranks), compute + transfer, plan, True, why, compute, transfer
        )

    def best_tp(self) -> list[Candidate]:
        """TP over the best subset, and over all devices when that is not it."""
        n = len(self.profiles)
        everyone = self.tp(range(n))
        subsets = [c for k in range(2, n) for c in combinations(range(n), k)] if n <= 8 else []
        best = everyone
        for ranks in subsets:
            c = self.tp(ranks)
            if c.feasible and (not best.feasible or c.predicted_step_s < best.predicted_step_s):
                best = c
        return [best] if best is everyone else [best, everyone]

    def pipeline(self) -> Candidate:
        chunks = {k: self.tp_kwargs[k] for k in ("mlp_chunk", "vocab_chunk")}
        stages = device_stages(self.profiles, self.cfg, **chunks)
        plan = search_pipeline(
            self.cfg.num_layers,
            stages,
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            act_bytes=self.act_bytes,
            max_permuted=self.max_permuted,
            tied_bytes=self.tied_bytes,
        )
        if plan is None:
            return Candidate("pp-1f1b", (), math.inf, None, False, "no stage split fits memory")
        short = _short_of_memory(
            [self.profiles[r] for r in plan.stage_ranks],
            pipeline_needs(self.cfg, self.profiles, plan, self.totals),
        )
        if short:  # the stage search does not count a tied embedding's first-stage copy
            return Candidate("pp-1f1b", plan.stage_ranks, math.inf, None, False, short)
        return Candidate(
            "pp-1f1b", plan.stage_ranks, plan.predicted_step_s, plan, True, _pp_why(plan)
        )

    def hybrids(self) -> list[Candidate]:
        out = []
        for h, why in plan_hybrids(
            self.cfg,
            self.profiles,
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            act_bytes=self.act_bytes,
            tp_kwargs=self.tp_kwargs,
            max_permuted=self.max_permuted,
            tied_bytes=self.tied_bytes,
        ):
            if h is None:
                out.append(Candidate("hybrid", (), math.inf, None, False, why))
                continue
            ranks = tuple(r for g in h.groups for r in g)
            out.append(
                Candidate(
                    "hybrid",
                    ranks,
                    h.pipeline.predicted_step_s,
                    h,
                    True,
                    _pp_why(h.pipeline),
                )
            )
        return out


def pipeline_needs(
    cfg: ModelConfig,
    profiles: Sequence[DeviceProfile],
    plan: PipelinePlan,
    totals: Mapping[str, int],
) -> list[int]:
    """Bytes each stage of ``plan`` needs on its device (stage order; see
    :func:`~xronos.planner.memory.stage_need`); ``profiles`` in rank order, ``totals``
    the model's units per segment. A tied embedding's exchange between the end stages
    moves only the rows of a step's tokens (:mod:`xronos.pipeline.tied`): no more than the
    activations already counted."""
    last = len(plan.layer_ranges) - 1
    return [
        stage_need(
            profiles[r],
            totals,
            cfg.num_layers,
            b - a,
            first=j == 0,
            last=j == last,
            tied=cfg.tie_word_embeddings,
        )
        for j, (r, (a, b)) in enumerate(zip(plan.stage_ranks, plan.layer_ranges, strict=True))
    ]


def stage_messages(
    cfg: ModelConfig, profiles: Sequence[DeviceProfile], tokens: int, grad_accum: int
) -> tuple[float, float]:
    """What pipeline stages send, in bytes: one batch's activation (the profiled one in its
    wire dtype, as profiles priced :func:`~xronos.planner.profile.on_the_wire` record it;
    fp32 where they record no traffic), and the tied matrix's rows of a step's tokens (at
    most the vocabulary, fp32; 0 when the matrix does not train: untied, or adapters)."""
    act = activation_bytes(profiles) or 4.0 * tokens * cfg.hidden_size
    if not any(p.tied_grad_bytes for p in profiles):
        return act, 0.0
    return act, 4.0 * min(cfg.vocab_size, tokens * grad_accum) * cfg.hidden_size


def _short_of_memory(members: Sequence[DeviceProfile], needs: Sequence[int]) -> str:
    """Why the first device whose need exceeds its usable memory cannot run ("" if none)."""
    for p, need in zip(members, needs, strict=True):
        if 0 < p.memory_bytes < need:
            return (
                f"needs {need / 2**20:.1f} MiB on {p.name}, which has "
                f"{p.memory_bytes / 2**20:.1f} MiB"
            )
    return ""


def _pp_why(plan: PipelinePlan) -> str:
    fill = sum(plan.predicted_stage_s)
    bubble = plan.predicted_step_s - fill - plan.step_extra_s - plan.update_s
    layers = "|".join(f"{a}-{b - 1}" for a, b in plan.layer_ranges)
    tied = f" + {plan.step_extra_s:.4f} tied-embedding rows" if plan.step_extra_s else ""
    upd = f" + {plan.update_s:.4f} update" if plan.update_s else ""
    return (
        f"= {fill:.4f} fill + {bubble:.4f} for {plan.num_microbatches - 1} more micro-batches "
        f"at the bottleneck{tied}{upd}; layers {layers}, m={plan.num_microbatches}"
    )


def plan_auto(
    cfg: ModelConfig,
    profiles: Sequence[DeviceProfile],
    *,
    batch_size: int,
    seq_len: int,
    grad_accum: int = 1,
    mlp_chunk: int | None = None,
    vocab_chunk: int | None = None,
    max_permuted: int = 5,
    replicated_share: Mapping[str, float] | None = None,
) -> AutoChoice:
    """Predict every candidate (see the module docstring); ``.chosen`` is the winner.

    Args:
        cfg: the model.
        profiles: one per device, in rank order, measured at ``batch_size`` × ``seq_len``.
        batch_size, seq_len: the profiled batch shape (sequences per accumulation batch).
        grad_accum: accumulation batches per optimizer step.
        mlp_chunk, vocab_chunk: the profiled unit sizes (default: the model's defaults).
        max_permuted: pipeline orders are searched up to this many devices.
        replicated_share: as for :func:`~xronos.planner.solve.plan_tp`.

    Raises:
        UserError: unusable profiles or arguments.
    """
    _check_profiles(profiles)
    if batch_size < 1 or seq_len < 1 or grad_accum < 1:
        raise UserError(
            f"auto: batch_size={batch_size}, seq_len={seq_len}, grad_accum={grad_accum}; "
            "each must be at least 1"
        )
    chunks = {
        "mlp_chunk": mlp_chunk or default_mlp_chunk(cfg.intermediate_size),
        "vocab_chunk": vocab_chunk or default_vocab_chunk(cfg.vocab_size),
    }
    act_bytes, tied_bytes = stage_messages(cfg, profiles, batch_size * seq_len, grad_accum)
    job = _Job(
        cfg=cfg,
        profiles=profiles,
        totals=segment_units(cfg, chunks["mlp_chunk"], chunks["vocab_chunk"]),
        batch_size=batch_size,
        grad_accum=grad_accum,
        act_bytes=act_bytes,
        tp_kwargs={**chunks, "replicated_share": replicated_share},
        max_permuted=max_permuted,
        tied_bytes=tied_bytes,
    )
    candidates = job.singles()
    if len(profiles) > 1:
        candidates += [*job.best_tp(), job.tp(range(len(profiles)), even=True), job.pipeline()]
        candidates += job.hybrids()
    return AutoChoice(tuple(p.name for p in profiles), tuple(candidates))
