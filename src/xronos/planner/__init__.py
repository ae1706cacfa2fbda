"""Planning: which share of the model each device holds.

- :func:`plan_tp` — Xronos's heterogeneous tensor-parallel plan, balanced per barrier.
- :func:`plan_even` — Megatron's even split, the TP baseline.
- :func:`plan_pipeline` / :func:`even_pipeline` — pipeline stages, the PP baseline.
- :func:`predict` / :func:`ideal_step_time` — what a plan should cost, and the limit.
- :func:`plan_auto` — every strategy predicted, communication included; the fastest wins.
- :class:`LinkModel` — a link as latency + bytes / bandwidth (:mod:`xronos.planner.comm`).
"""

from xronos.planner.auto import AutoChoice, Candidate, plan_auto
from xronos.planner.balance import SegmentSolution, solve_segment
from xronos.planner.comm import LinkModel
from xronos.planner.hybrid import HybridPlan
from xronos.planner.pipeline import PipelinePlan, StageCosts, even_pipeline, plan_pipeline
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.solve import (
    DEFAULT_REPLICATED_SHARE,
    annotate,
    ideal_step_time,
    plan_even,
    plan_tp,
    predict,
    transfer_by_segment,
    transfer_time,
)

__all__ = [
    "DEFAULT_REPLICATED_SHARE",
    "SEGMENTS",
    "AutoChoice",
    "Candidate",
    "HybridPlan",
    "LinkModel",
    "PipelinePlan",
    "Plan",
    "SegmentSolution",
    "StageCosts",
    "annotate",
    "even_pipeline",
    "ideal_step_time",
    "plan_auto",
    "plan_even",
    "plan_pipeline",
    "plan_tp",
    "predict",
    "solve_segment",
    "transfer_by_segment",
    "transfer_time",
]
