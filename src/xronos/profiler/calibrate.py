"""Calibration on the devices: time real passes of a plan, refit, plan again.

The profiler times each segment's shard alone, which is quick but not the whole truth
(see :mod:`xronos.planner.calibrate` for what real passes add and how they are fitted).
Here every device runs real forward+backward passes of its planned shard, with the real
collectives and no parameter update, and the devices share what they measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from xronos.comm.mappings import TPGroup
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.model.llama import LlamaForCausalLM
from xronos.model.lora import LoRALinear
from xronos.planner.calibrate import Round, fit, probe_plan, segment_times, settled
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.profile import DeviceProfile

Batch = tuple[torch.Tensor, torch.Tensor]  # input_ids (B, S), labels (B, S)


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
        group.barrier()
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


def plan_with_calibration(
    build: Callable[[Plan], LlamaForCausalLM],
    plan_of: Callable[[list[DeviceProfile], dict[str, int]], Plan],
    profiles: list[DeviceProfile],
    group: TPGroup,
    micro: list[Batch],
    *,
    rounds: int = 5,
) -> tuple[Plan, list[DeviceProfile], LlamaForCausalLM, list[Round]]:
    """Plan from ``profiles`` with ``plan_of`` (profiles, the fewest units per device and
    segment), then up to ``rounds`` times: build the plan's shard with ``build``, measure
    it for real, fit the profiles to every round so far and plan again — until the plan has
    settled (moved by at most a unit) twice in a row. Where the first plan leaves a device
    without units of a segment, the first round measures :func:`probe_plan`'s instead.
    Returns the plan, the calibrated profiles, the model built for the plan and the rounds
    (each round's plan and what every device measured). Every rank gets the same result:
    measurements are shared."""
    plan = plan_of(profiles, {})
    if rounds > 0:  # (one device: no probe, and no rounds)
        plan = probe_plan(plan, lambda least: plan_of(profiles, least)) or plan
    model = build(plan)
    history: list[Round] = []
    fitted, calm = profiles, 0
    for r in range(rounds if group.size > 1 else 0):
        with torch.enable_grad():
            mine = measure_plan(model, group, micro, passes=2 if r == 0 else 1, warmup=int(r == 0))
        history.append(Round(plan, group.gather_object(mine), weight=float(r + 1)))
        fitted = fit(profiles, history)
        new = plan_of(fitted, {})
        calm = calm + 1 if settled(new, plan) else 0
        if any(new.split(s) != plan.split(s) for s in SEGMENTS):
            model = build(new)
        plan = new
        if calm == 2:  # twice in a row: one lucky round is not enough
            break
    return plan, fitted, model, history
