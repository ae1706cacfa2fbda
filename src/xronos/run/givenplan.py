"""A plan given with ``--plan``: a tensor-parallel plan, a pipeline's or a hybrid's, as
``xronos plan`` writes them; checked against the model and the cluster before anything
starts, and the strategy that runs it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.planner.hybrid import HybridPlan
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.plan import Plan
from xronos.train.session import Strategy

GivenPlan = Plan | PipelinePlan | HybridPlan

_RUNS = {
    HybridPlan: (Strategy.HYBRID,),
    PipelinePlan: (Strategy.PP_1F1B, Strategy.PP_GPIPE),
    Plan: (Strategy.XRONOS, Strategy.TP_EVEN, Strategy.SINGLE),
}
"""The strategies that run each kind of plan (the first when ``auto`` was asked)."""


def read_plan(path: str) -> GivenPlan:
    """The plan in ``path`` (one line of UserError when it is none)."""
    try:
        d = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"--plan {path}: invalid JSON at line {e.lineno}: {e.msg}") from e
    if not isinstance(d, dict):
        raise UserError(f"--plan {path}: not a plan; make one with `xronos plan`")
    try:
        if "groups" in d:
            return HybridPlan.from_dict(d)
        if "layer_ranges" in d:
            return PipelinePlan.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(
            f"--plan {path}: malformed plan ({e}); regenerate it with `xronos plan`"
        ) from e
    return Plan.from_dict(d)


def strategy_for(path: str, plan: GivenPlan, asked: Strategy) -> Strategy:
    """The strategy that runs ``plan``: ``asked``, or for ``auto`` the plan's own kind."""
    runs = _RUNS[type(plan)]
    if asked is Strategy.AUTO:
        return runs[0]
    if asked not in runs:
        names = " or ".join(s.value for s in runs)
        raise UserError(
            f"--plan {path} is a {_kind(plan)} plan, which --strategy {asked} cannot run; "
            f"use --strategy {names} (or auto)"
        )
    return asked


def check_plan(path: str, plan: GivenPlan, cfg: ModelConfig, devices: Sequence[str]) -> None:
    """``plan`` fits the model and names the cluster's devices at their ranks."""
    if isinstance(plan, Plan):
        plan.check(cfg)
        if list(plan.devices) != list(devices):
            raise UserError(
                f"--plan {path} is for devices {list(plan.devices)}, the cluster has "
                f"{list(devices)}; plan again with `xronos plan`"
            )
        return
    pipeline = plan.pipeline if isinstance(plan, HybridPlan) else plan
    if pipeline.num_layers != cfg.num_layers:
        raise UserError(
            f"--plan {path} covers {pipeline.num_layers} layers, the model has "
            f"{cfg.num_layers}; plan again with `xronos plan`"
        )
    if isinstance(plan, HybridPlan):
        plan.tp.check(cfg)
        named = [
            (r, pipeline.devices[j] if len(g) == 1 else plan.tp.devices[k])
            for j, g in enumerate(plan.groups)
            for k, r in enumerate(g)
        ]
    else:
        named = list(zip(pipeline.stage_ranks, pipeline.devices, strict=True))
    for r, name in named:
        if not 0 <= r < len(devices) or devices[r] != name:
            raise UserError(
                f"--plan {path} runs {name!r} as rank {r}, the cluster's devices are "
                f"{list(devices)}; plan again with `xronos plan`"
            )


def _kind(plan: GivenPlan) -> str:
    if isinstance(plan, HybridPlan):
        return "hybrid"
    return "pipeline" if isinstance(plan, PipelinePlan) else "tensor-parallel"
