"""The pipeline's cost model: per-stage costs from the devices' tensor-parallel profiles.

The model itself is the planner's (:mod:`xronos.planner.pipesearch`); this is its use for a
pipeline in rank order.
"""

from __future__ import annotations

from xronos.config import ModelConfig
from xronos.planner.pipeline import StageCosts
from xronos.planner.pipesearch import activation_bytes, device_stages, stage_costs_for
from xronos.planner.profile import DeviceProfile


def stage_costs(
    profiles: list[DeviceProfile], cfg: ModelConfig, microbatches: int
) -> list[StageCosts]:
    """Per-micro-batch stage costs of the devices in rank order (costs scale with tokens;
    sends priced by the measured links, or by the old all-reduce figure without them)."""
    fraction = 1.0 / microbatches
    return stage_costs_for(
        device_stages(profiles, cfg), fraction=fraction, act_bytes=activation_bytes(profiles)
    )


def pipeline_microbatches(batch_size: int, stages: int, requested: int | None) -> int:
    """2 × stages (enough to fill the pipeline), at most one sequence per micro-batch."""
    return requested or max(1, min(2 * stages, batch_size))
