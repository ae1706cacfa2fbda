"""The pipeline's cost model: per-stage costs from the devices' tensor-parallel profiles."""

from __future__ import annotations

from xronos.config import ModelConfig
from xronos.planner.pipeline import StageCosts
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.profile import DeviceProfile


def stage_costs(
    profiles: list[DeviceProfile], cfg: ModelConfig, microbatches: int
) -> list[StageCosts]:
    """Per-micro-batch stage costs from the TP profiles (costs scale with tokens)."""
    plan = Plan.single(cfg)
    units = {s: sum(plan.split(s)) for s in SEGMENTS}
    layers, m = cfg.num_layers, microbatches
    out = []
    for p in profiles:
        per_layer = (p.segments["attn"](units["attn"]) + p.segments["mlp"](units["mlp"])) / layers
        ub = p.unit_bytes or {}
        out.append(
            StageCosts(
                name=p.name,
                layer_s=(per_layer + p.replicated_s / layers) / m,
                head_s=p.segments["vocab"](units["vocab"]) / m,
                send_s=p.allreduce_s / m,
                layer_bytes=(ub.get("attn", 0) * units["attn"] + ub.get("mlp", 0) * units["mlp"])
                // layers,
                head_bytes=ub.get("vocab", 0) * units["vocab"],
                memory_bytes=max(0, p.memory_bytes - p.base_bytes) if p.memory_bytes else 0,
            )
        )
    return out


def pipeline_microbatches(batch_size: int, stages: int, requested: int | None) -> int:
    """2 × stages (enough to fill the pipeline), at most one sequence per micro-batch."""
    return requested or max(1, min(2 * stages, batch_size))
