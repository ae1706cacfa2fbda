"""Planning: which share of the model each device holds.

- :func:`plan_tp` — Xronos's heterogeneous tensor-parallel plan, balanced per barrier.
- :func:`plan_even` — Megatron's even split, the TP baseline.
- :func:`plan_pipeline` / :func:`even_pipeline` — pipeline stages, the PP baseline.
- :func:`predict` / :func:`ideal_step_time` — what a plan should cost, and the limit.
"""

from xronos.planner.balance import SegmentSolution, solve_segment
from xronos.planner.pipeline import PipelinePlan, StageCosts, even_pipeline, plan_pipeline
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.solve import (
    DEFAULT_REPLICATED_SHARE,
    annotate,
    ideal_step_time,
    plan_even,
    plan_tp,
    predict,
    transfer_time,
)

__all__ = [
    "DEFAULT_REPLICATED_SHARE",
    "SEGMENTS",
    "PipelinePlan",
    "Plan",
    "SegmentSolution",
    "StageCosts",
    "annotate",
    "even_pipeline",
    "ideal_step_time",
    "plan_even",
    "plan_pipeline",
    "plan_tp",
    "predict",
    "solve_segment",
    "transfer_time",
]
