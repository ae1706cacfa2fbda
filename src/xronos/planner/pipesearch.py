"""The best pipeline: which devices, in which order, how many micro-batches.

:func:`~xronos.planner.pipeline.plan_pipeline` splits the layers of a *given* device order
exactly. This module searches around it, all of it pure:

- **Stage costs per micro-batch** (:func:`device_stages`, :func:`stage_costs_for`): a
  device's profile is measured on the whole batch; a micro-batch of ``B/k`` of the ``B``
  profiled sequences costs ``1/k`` of it plus ``(1 − 1/k)`` of the profile's ``split_s``
  (what each extra pass costs however few its tokens: the weights are read and their
  gradients written once per pass), so that ``k`` micro-batches cost the whole batch plus
  ``(k − 1)`` passes — on a CPU, cutting a small batch is far from free. A stage
  that is not last also pays, per micro-batch, its activations sent to the next stage and
  their gradients coming back: ``2 · p2p(B/k·S·H·4 bytes)`` over the pair's link
  (:mod:`xronos.planner.comm`), priced in full: the stage's own CPU moves those bytes,
  so no compute is counted as hiding them.
- **Orders** (:func:`search_pipeline`): with at most ``max_permuted`` devices, every
  ordered choice of two or more of them — so a device may hold no stage, and the LM head
  (always on the last stage) may land on any device; with more, the given order only.
- **Micro-batches**: a step of ``grad_accum`` batches of ``B`` sequences is cut into
  ``m = grad_accum · k`` micro-batches, ``1 ≤ k ≤ B`` (the pipeline's micro-batch split
  needs ``m`` a multiple of ``grad_accum`` and no empty part); more micro-batches shrink the
  bubble ``(m − 1) · max_j t_j / m`` but pay each message's latency more often.

For each order and ``m`` the layer split minimises GPipe/1F1B's closed form
``Σ_j t_j + (m − 1) · max_j t_j`` (``plan_pipeline(..., exact_step=True)``); the step
(one optimizer step, ``grad_accum`` batches) is then predicted by running the 1F1B schedule
with each micro-batch's own cost (:func:`schedule_s`: ``B`` sequences cut in ``k`` parts
need not be equal), and the orders and ``m`` compete on that. With a tied embedding that trains,
the last stage sends the first the rows of the step's tokens before the schedule and gets
their gradient back after it (:mod:`xronos.pipeline.tied`): two messages of
``tied_bytes`` over their pair's link, one after the other, added to the step
(``step_extra_s``). Then every stage updates its own
parameters, once: the profiled update (:attr:`DeviceProfile.update_s`) leaves the
micro-batches' costs and the slowest stage's update is added to the step (``update_s``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import permutations

from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.planner.comm import LinkModel, pair
from xronos.planner.pipeline import PipelinePlan, StageCosts, plan_pipeline
from xronos.planner.plan import default_mlp_chunk, default_vocab_chunk, segment_units
from xronos.planner.profile import DeviceProfile
from xronos.planner.schedules import makespan, microbatch_sizes


@dataclass(frozen=True)
class StageDevice:
    """Something that can run a pipeline stage: one device, or a tensor-parallel group."""

    costs: StageCosts
    """Its costs for the *whole profiled batch* (``send_s`` unused: links price it)."""
    link: LinkModel | None
    """Its link for point-to-point messages; None: priced by ``legacy_send_s``."""
    ranks: tuple[int, ...]
    """The cluster ranks it stands for (the first one runs the stage's messages)."""
    legacy_send_s: float = 0.0
    """Send cost per whole batch when links were not measured (old profiles)."""


def device_stages(
    profiles: Sequence[DeviceProfile],
    cfg: ModelConfig,
    *,
    mlp_chunk: int | None = None,
    vocab_chunk: int | None = None,
) -> list[StageDevice]:
    """One :class:`StageDevice` per profile (rank order), costs for the whole batch.

    ``mlp_chunk`` / ``vocab_chunk`` must be the profiled unit sizes (default: the model's
    defaults)."""
    units = segment_units(
        cfg,
        mlp_chunk or default_mlp_chunk(cfg.intermediate_size),
        vocab_chunk or default_vocab_chunk(cfg.vocab_size),
    )
    layers = cfg.num_layers
    out = []
    for r, p in enumerate(profiles):
        per_layer = p.segments["attn"](units["attn"]) + p.segments["mlp"](units["mlp"])
        ub = p.unit_bytes or {}
        layer_bytes = ub.get("attn", 0) * units["attn"] + ub.get("mlp", 0) * units["mlp"]
        split = p.split_s or {}
        upd = p.update_s or {}
        layer_s = (per_layer + p.replicated_s) / layers
        head_s = p.segments["vocab"](units["vocab"])
        # the update leaves the micro-batches for the step's end (no more than was timed)
        lu = min(upd.get("layer", 0.0), layer_s)
        hu = min(upd.get("head", 0.0), head_s)
        eu = min(upd.get("embed", 0.0), p.embed_s)
        costs = StageCosts(
            name=p.name,
            layer_s=layer_s - lu,
            head_s=head_s - hu,
            layer_split_s=(split.get("attn", 0.0) + split.get("mlp", 0.0)) / layers,
            head_split_s=split.get("vocab", 0.0),
            embed_s=p.embed_s - eu,
            embed_split_s=p.embed_split_s,
            layer_update_s=lu,
            # a trained tied matrix is the last stage's to update (its head's update)
            embed_update_s=0.0 if p.tied_grad_bytes else eu,
            head_update_s=hu,
            layer_bytes=layer_bytes // layers,
            head_bytes=ub.get("vocab", 0) * units["vocab"],
            memory_bytes=max(0, p.memory_bytes - p.base_bytes) if p.memory_bytes else 0,
        )
        out.append(StageDevice(costs, p.link, (r,), legacy_send_s=p.allreduce_s))
    return out


def send_s(a: StageDevice, b: StageDevice, nbytes: float, fraction: float) -> float:
    """Activations ``a`` → ``b`` and their gradients back, for one micro-batch."""
    if a.link is None or b.link is None:
        return max(a.legacy_send_s, b.legacy_send_s) * fraction
    return 2 * pair(a.link, b.link).p2p_s(nbytes)


def stage_costs_for(
    order: Sequence[StageDevice], *, fraction: float, act_bytes: float
) -> list[StageCosts]:
    """Per-micro-batch costs of ``order`` as consecutive stages.

    Args:
        order: the stages' devices, first to last.
        fraction: a micro-batch's share of the profiled batch (``1/k``).
        act_bytes: bytes of the profiled batch's activation ``(B, S, H)`` fp32.
    """
    out = []
    for j, d in enumerate(order):
        c = d.costs
        nxt = order[j + 1] if j + 1 < len(order) else None
        out.append(
            replace(
                c,
                layer_s=c.layer_s * fraction + c.layer_split_s * (1.0 - fraction),
                embed_s=c.embed_s * fraction + c.embed_split_s * (1.0 - fraction),
                head_s=c.head_s * fraction + c.head_split_s * (1.0 - fraction),
                send_s=0.0 if nxt is None else send_s(d, nxt, act_bytes * fraction, fraction),
            )
        )
    return out


def microbatch_counts(batch_size: int) -> list[int]:
    """The ``k`` (micro-batches per accumulation batch) worth trying: 1 .. B."""
    return list(range(1, max(1, batch_size) + 1))


def orders(n: int, max_permuted: int, *, must: int | None = None) -> Iterator[tuple[int, ...]]:
    """Device orders to try: every ordered choice of 2+ of ``n`` (or just ``0..n-1``)."""
    if n > max_permuted:
        yield tuple(range(n))
        return
    for size in range(2, n + 1):
        for order in permutations(range(n), size):
            if must is None or must in order:
                yield order


def search_pipeline(
    num_layers: int,
    devices: Sequence[StageDevice],
    *,
    batch_size: int,
    grad_accum: int,
    act_bytes: float,
    max_permuted: int = 5,
    must: int | None = None,
    tied_bytes: float = 0.0,
) -> PipelinePlan | None:
    """The fastest pipeline over orders and micro-batch counts (see the module docstring).

    Args:
        num_layers: decoder layers.
        devices: candidates for stages; ``must`` (an index into them) must take a stage.
        batch_size: ``B``, sequences per accumulation batch (the profiled batch).
        grad_accum: accumulation batches per optimizer step.
        act_bytes: bytes of one batch's activation ``(B, S, H)`` fp32.
        max_permuted: above this many devices, only the given order is tried.
        tied_bytes: the tied embedding's rows of one step's tokens, which the end stages
            send each way every step (0: untied, or the embedding does not train).

    Returns:
        The plan with the least predicted step (``ranks`` from ``devices``), or None if
        no order fits in memory.
    """
    best: PipelinePlan | None = None
    for order in orders(len(devices), max_permuted, must=must):
        if len(order) > num_layers:
            continue
        staged = [devices[i] for i in order]
        tied = send_s(staged[0], staged[-1], tied_bytes, 1.0) if tied_bytes else 0.0
        for k in microbatch_counts(batch_size):
            costs = stage_costs_for(staged, fraction=1.0 / k, act_bytes=act_bytes)
            bound = lower_bound(num_layers, costs, grad_accum * k) + tied
            if best is not None and bound >= best.predicted_step_s:
                continue
            try:
                plan = plan_pipeline(
                    num_layers,
                    costs,
                    grad_accum * k,
                    ranks=[d.ranks[0] for d in staged],
                    exact_step=True,
                )
            except UserError:
                break  # memory does not depend on k: no k fits this order
            plan = replace(
                plan,
                step_extra_s=tied,
                update_s=update_s(plan, costs),
                schedule_s=schedule_s(plan, staged, batch_size, grad_accum, act_bytes),
            )
            if best is None or plan.predicted_step_s < best.predicted_step_s - 1e-12:
                best = plan
    return best


def priced(
    plan: PipelinePlan,
    devices: Sequence[StageDevice],
    *,
    batch_size: int,
    grad_accum: int,
    act_bytes: float,
    tied_bytes: float = 0.0,
) -> float:
    """The step :func:`search_pipeline` predicts for ``plan`` (its order, layer split and
    micro-batches kept) on ``devices``, which name its stages' devices (other costs than
    those it was planned with: a device that slowed, say)."""
    staged = _staged(plan, devices)
    tied = send_s(staged[0], staged[-1], tied_bytes, 1.0) if tied_bytes else 0.0
    update = update_s(plan, [d.costs for d in staged])  # once a step, whatever the cut
    return schedule_s(plan, staged, batch_size, grad_accum, act_bytes) + tied + update


def stage_compute_s(
    plan: PipelinePlan, devices: Sequence[StageDevice], *, batch_size: int, grad_accum: int
) -> dict[str, float]:
    """Per stage device (by name): its predicted forward and backward seconds in a step of
    ``plan``, every micro-batch at its own size, without sends or the update — what the
    runtime records as the stage's compute."""
    staged = _staged(plan, devices)
    sizes = microbatch_sizes(batch_size, plan.num_microbatches // grad_accum, grad_accum)
    last = len(staged) - 1
    out = {name: 0.0 for name in plan.devices}
    for b in sizes:
        costs = stage_costs_for(staged, fraction=b / batch_size, act_bytes=0.0)  # no sends
        for j, (c, (lo, hi)) in enumerate(zip(costs, plan.layer_ranges, strict=True)):
            out[plan.devices[j]] += c.stage_s(hi - lo, first=j == 0, last=j == last) - (
                0.0 if j == last else c.send_s
            )
    return out


def _staged(plan: PipelinePlan, devices: Sequence[StageDevice]) -> list[StageDevice]:
    """``plan``'s stages' devices, first to last, found by name among ``devices``."""
    by_name = {d.costs.name: d for d in devices}
    return [by_name[name] for name in plan.devices]


def schedule_s(
    plan: PipelinePlan,
    staged: Sequence[StageDevice],
    batch_size: int,
    grad_accum: int,
    act_bytes: float,
) -> float:
    """``plan``'s 1F1B schedule simulated with each micro-batch's own cost: the batch cut as the
    runtime cuts it (``k`` parts of ``B`` need not be equal), each part costing its share
    of the profiled batch plus a pass's fixed cost, as :func:`stage_costs_for` prices it."""
    parts = plan.num_microbatches // grad_accum
    sizes = microbatch_sizes(batch_size, parts, grad_accum)
    n = len(staged)
    by_size = {
        b: stage_costs_for(staged, fraction=b / batch_size, act_bytes=act_bytes) for b in set(sizes)
    }
    table = [
        [by_size[b][j].stage_s(hi - lo, first=j == 0, last=j == n - 1) for b in sizes]
        for j, (lo, hi) in enumerate(plan.layer_ranges)
    ]
    return makespan("pp-1f1b", table)


def update_s(plan: PipelinePlan, costs: Sequence[StageCosts]) -> float:
    """The slowest stage's step-end update under ``plan``'s layer split."""
    n = len(costs)
    return max(
        (
            c.update_s(b - a, first=j == 0, last=j == n - 1)
            for j, (c, (a, b)) in enumerate(zip(costs, plan.layer_ranges, strict=True))
        ),
        default=0.0,
    )


def lower_bound(num_layers: int, costs: Sequence[StageCosts], m: int) -> float:
    """A step no split of these stages (in this order) can beat, memory ignored: every layer
    costs at least the cheapest stage's layer and every stage holds one layer or more, so
    the ``m`` micro-batches' work is at least ``m`` times that least fill; the busiest stage
    does at least its share of it, and at least ``m`` one-layer micro-batches."""
    n = len(costs)
    one = [c.stage_s(1, first=j == 0, last=j == n - 1) for j, c in enumerate(costs)]
    fill = sum(one) + (num_layers - n) * min(c.layer_s for c in costs)
    return m * max(fill / n, *one)


def activation_bytes(profiles: Sequence[DeviceProfile]) -> float:
    """Bytes of the profiled batch's activation, from the profiled traffic (0 if unknown)."""
    attn = profiles[0].traffic.get("attn", []) if profiles else []
    return float(attn[0][1]) if attn else 0.0
