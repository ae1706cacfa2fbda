"""Pipeline-parallel (PP) stage planning: the baseline Xronos is compared against.

Stage ``j`` runs on device ``j`` (in the order given) and holds the contiguous decoder
layers ``[start_j, end_j)``; the first stage also holds the embedding, the last the final
norm, the LM head and the loss. With ``m`` micro-batches, GPipe and 1F1B finish a step in
about ``Σ_j t_j + (m − 1) · max_j t_j``, where ``t_j`` is stage ``j``'s forward+backward
time per micro-batch (including sending its activations on, which a CPU cannot overlap with
compute; :mod:`xronos.planner.schedules` times a schedule more closely). For ``m`` well
above the number of stages the bottleneck term dominates, so — as Asteroid and EdgeShard do
— the planner minimises the **bottleneck stage time** ``max_j t_j`` exactly by dynamic
programming over contiguous partitions; among partitions with the least bottleneck it takes
the one with the least ``Σ_j t_j`` (the pipeline's fill time), and among those the one whose
stage boundaries come first.

Every stage gets at least one layer (a device with none would only forward activations); a
stage must fit its device's memory. Which devices take part, in which order (so where the LM
head lands) and how many micro-batches a step has are searched outside, over calls of
:func:`plan_pipeline` (:mod:`xronos.planner.pipesearch`); ``PipelinePlan.ranks`` records
which rank of the profiled cluster runs each stage.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from xronos.errors import UserError
from xronos.planner.plan import proportional_split


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """What one device costs as a pipeline stage, per micro-batch."""

    name: str
    """Device name."""
    layer_s: float
    """Forward+backward time of one decoder layer (seconds per micro-batch)."""
    embed_s: float = 0.0
    """Forward+backward time of the token embedding (first stage only)."""
    head_s: float = 0.0
    """Forward+backward time of the final norm, LM head and loss (last stage only)."""
    layer_split_s: float = 0.0
    """Of a layer's time for the whole profiled batch, what each micro-batch pays however
    few its tokens (weights re-read, gradients written): see :mod:`xronos.planner.pipesearch`."""
    head_split_s: float = 0.0
    """The same for the LM head."""
    embed_split_s: float = 0.0
    """The same for the embedding."""
    send_s: float = 0.0
    """Time to send activations to the next stage and receive their gradients (not last)."""
    layer_update_s: float = 0.0
    """The step-end update of one layer's parameters (once per step, not per micro-batch;
    not in ``layer_s``)."""
    embed_update_s: float = 0.0
    """The same for the embedding (first stage)."""
    head_update_s: float = 0.0
    """The same for the final norm and LM head (last stage)."""
    layer_bytes: int = 0
    """Memory of one layer: weights, gradients, optimizer state, in-flight activations."""
    embed_bytes: int = 0
    """Memory of the embedding (first stage only)."""
    head_bytes: int = 0
    """Memory of the final norm and LM head (last stage only)."""
    memory_bytes: int = 0
    """Memory usable on this device (0 = unbounded)."""

    def stage_s(self, layers: int, *, first: bool, last: bool) -> float:
        """Time per micro-batch of a stage of ``layers`` layers on this device."""
        return (
            layers * self.layer_s
            + (self.embed_s if first else 0.0)
            + (self.head_s if last else 0.0)
            + (0.0 if last else self.send_s)
        )

    def update_s(self, layers: int, *, first: bool, last: bool) -> float:
        """The step-end update of a stage of ``layers`` layers on this device."""
        return (
            layers * self.layer_update_s
            + (self.embed_update_s if first else 0.0)
            + (self.head_update_s if last else 0.0)
        )

    def stage_bytes(self, layers: int, *, first: bool, last: bool) -> int:
        """Memory a stage of ``layers`` layers needs on this device."""
        return (
            layers * self.layer_bytes
            + (self.embed_bytes if first else 0)
            + (self.head_bytes if last else 0)
        )

    def fits(self, layers: int, *, first: bool, last: bool) -> bool:
        need = self.stage_bytes(layers, first=first, last=last)
        return self.memory_bytes <= 0 or need <= self.memory_bytes


@dataclass(frozen=True)
class PipelinePlan:
    """Contiguous layer ranges per device, in stage order."""

    devices: tuple[str, ...]
    """Device names; stage ``j`` runs on ``devices[j]``."""
    layer_ranges: tuple[tuple[int, int], ...]
    """``[start, end)`` decoder layers of each stage; contiguous from 0, none empty."""
    predicted_stage_s: tuple[float, ...]
    """Predicted time per micro-batch of each stage (empty when planned without costs)."""
    num_microbatches: int
    """Micro-batches per training step."""
    ranks: tuple[int, ...] = ()
    """Which rank of the cluster runs stage ``j`` (``ranks[j]``); empty = stage ``j`` on
    rank ``j`` (plans written before the stage order was searched)."""
    step_extra_s: float = 0.0
    """Predicted time once per step outside the schedule: the tied embedding's rows of the
    step's tokens, last stage to first, and their gradient back (:mod:`xronos.pipeline.tied`)."""
    update_s: float = 0.0
    """Predicted step-end update after the schedule: the slowest stage's (every stage waits
    for the gradient norm's all-reduce, then updates its own parameters)."""
    schedule_s: float = 0.0
    """Predicted schedule, first forward to last backward, simulated with each micro-batch's
    own cost (:mod:`xronos.planner.schedules`); 0: the closed form below stands in."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(str(d) for d in self.devices))
        ranges = tuple((int(a), int(b)) for a, b in self.layer_ranges)
        object.__setattr__(self, "layer_ranges", ranges)
        object.__setattr__(self, "predicted_stage_s", tuple(map(float, self.predicted_stage_s)))
        if len(ranges) != len(self.devices) or not ranges:
            raise ValueError(f"pipeline plan: {len(ranges)} ranges for {len(self.devices)} devices")
        if self.predicted_stage_s and len(self.predicted_stage_s) != len(ranges):
            raise ValueError("pipeline plan: predicted_stage_s needs one entry per stage")
        ends = [0] + [b for _, b in ranges]
        if any(a != ends[j] or b <= a for j, (a, b) in enumerate(ranges)):
            raise ValueError(f"pipeline plan: ranges must be contiguous and non-empty: {ranges}")
        if self.num_microbatches < 1:
            raise ValueError(f"pipeline plan: num_microbatches={self.num_microbatches} < 1")
        ranks = tuple(int(r) for r in self.ranks)
        object.__setattr__(self, "ranks", ranks)
        if ranks and (len(ranks) != len(ranges) or len(set(ranks)) != len(ranks) or min(ranks) < 0):
            raise ValueError(f"pipeline plan: ranks {ranks} must name one distinct rank per stage")

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """The rank that runs each stage (``ranks``, or stage ``j`` on rank ``j``)."""
        return self.ranks or tuple(range(len(self.devices)))

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.layer_ranges[-1][1]

    def stage_of(self, layer: int) -> int:
        """The stage that holds decoder layer ``layer``."""
        for j, (a, b) in enumerate(self.layer_ranges):
            if a <= layer < b:
                return j
        raise IndexError(f"layer {layer} not in 0..{self.num_layers - 1}")

    @property
    def bottleneck_s(self) -> float:
        """The slowest stage's time per micro-batch (nan without predictions)."""
        return max(self.predicted_stage_s) if self.predicted_stage_s else math.nan

    @property
    def predicted_step_s(self) -> float:
        """The schedule (``schedule_s``, else ``Σ_j t_j + (m − 1) · max_j t_j``) plus
        ``step_extra_s`` and ``update_s`` (nan without predictions)."""
        if not self.predicted_stage_s:
            return math.nan
        closed = sum(self.predicted_stage_s) + (self.num_microbatches - 1) * self.bottleneck_s
        return (self.schedule_s or closed) + self.step_extra_s + self.update_s

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_ranges"] = [list(r) for r in self.layer_ranges]
        d["ranks"] = list(self.ranks)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PipelinePlan:
        try:
            return cls(
                devices=tuple(d["devices"]),
                layer_ranges=tuple(tuple(r) for r in d["layer_ranges"]),  # type: ignore[misc]
                predicted_stage_s=tuple(d.get("predicted_stage_s", ())),
                num_microbatches=int(d["num_microbatches"]),
                ranks=tuple(d.get("ranks", ())),
                step_extra_s=float(d.get("step_extra_s", 0.0)),
                update_s=float(d.get("update_s", 0.0)),
                schedule_s=float(d.get("schedule_s", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(
                f"pipeline plan: malformed JSON ({e}); regenerate it with `xronos plan`"
            ) from e

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise UserError(f"pipeline plan: invalid JSON at line {e.lineno}: {e.msg}") from e

    def table(self) -> str:
        """A plain-text table: stage, device, layers, predicted time and idle per micro-batch."""
        rows = [("stage", "device", "layers", "pred. s/mb", "pred. idle s/mb")]
        worst = self.bottleneck_s
        for j, (name, (a, b)) in enumerate(zip(self.devices, self.layer_ranges, strict=True)):
            t = self.predicted_stage_s[j] if self.predicted_stage_s else math.nan
            rows.append((str(j), name, f"{a}-{b - 1} ({b - a})", f"{t:.4f}", f"{worst - t:.4f}"))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        return "\n".join(
            "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows
        )


def _check_shape(num_layers: int, n: int) -> None:
    if n == 0:
        raise UserError("pipeline: no devices; list at least one device in the cluster spec")
    if num_layers < n:
        raise UserError(
            f"pipeline: {num_layers} layers cannot fill {n} stages (each device needs at least "
            f"one layer); use at most {num_layers} devices"
        )


def even_pipeline(
    num_layers: int, devices: Sequence[str], num_microbatches: int | None = None
) -> PipelinePlan:
    """Layers split as evenly as possible, the remainder to the first stages."""
    _check_shape(num_layers, len(devices))
    sizes = proportional_split(num_layers, [1.0] * len(devices))
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    return PipelinePlan(
        tuple(devices),
        tuple((s, s + k) for s, k in zip(starts, sizes, strict=True)),
        (),
        num_microbatches or 2 * len(devices),
    )


def _stage_cost(costs: Sequence[StageCosts], j: int, layers: int) -> float:
    """Time of stage ``j`` with ``layers`` layers, or inf if it does not fit in memory."""
    first, last = j == 0, j == len(costs) - 1
    if not costs[j].fits(layers, first=first, last=last):
        return math.inf
    return costs[j].stage_s(layers, first=first, last=last)


def _table(num_layers: int, costs: Sequence[StageCosts]) -> list[list[float]]:
    """``[j][k]``: :func:`_stage_cost` of stage ``j`` with ``k`` layers (k = 0 .. num_layers)."""
    return [[_stage_cost(costs, j, k) for k in range(num_layers + 1)] for j in range(len(costs))]


def _partition(
    num_layers: int,
    costs: Sequence[StageCosts],
    bound: float | None,
    table: list[list[float]] | None = None,
) -> tuple[float, list[int]]:
    """DP over contiguous partitions (each stage >= 1 layer).

    With ``bound`` None: minimise the bottleneck ``max_j t_j``. Otherwise minimise
    ``Σ_j t_j`` over partitions whose every stage is ``<= bound``. Returns the optimum and
    the stage end points; the optimum is inf when nothing is feasible. Ties keep the
    earliest stage boundary (strict improvement only, split points in increasing order).
    """
    n, inf = len(costs), math.inf
    cost = table or _table(num_layers, costs)
    # best[j][k]: optimum for stages 0..j-1 covering layers [0, k); cut[j][k]: start of j-1
    best = [[inf] * (num_layers + 1) for _ in range(n + 1)]
    cut = [[-1] * (num_layers + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for j in range(1, n + 1):
        for k in range(j, num_layers - (n - j) + 1):
            for start in range(j - 1, k):
                prev = best[j - 1][start]
                if prev == inf:
                    continue
                t = cost[j - 1][k - start]
                if bound is None:
                    value = max(prev, t)
                elif t <= bound:
                    value = prev + t
                else:
                    continue
                if value < best[j][k]:
                    best[j][k], cut[j][k] = value, start
    ends, k = [], num_layers
    for j in range(n, 0, -1):
        ends.append(k)
        k = cut[j][k]
    return best[n][num_layers], list(reversed(ends))


def _memory_error(num_layers: int, costs: Sequence[StageCosts]) -> UserError:
    n = len(costs)
    for j, c in enumerate(costs):
        if not c.fits(1, first=j == 0, last=j == n - 1):
            need = c.stage_bytes(1, first=j == 0, last=j == n - 1)
            return UserError(
                f"device '{c.name}' has {c.memory_bytes / 2**20:.1f} MiB but a pipeline stage of "
                f"one layer needs {need / 2**20:.1f} MiB; give it more memory or drop it from "
                "the cluster"
            )
    return UserError(
        f"pipeline: the devices' memory cannot hold all {num_layers} layers; add memory or "
        "devices, or use a smaller model"
    )


def plan_pipeline(
    num_layers: int,
    costs: list[StageCosts],
    num_microbatches: int | None = None,
    *,
    ranks: Sequence[int] = (),
    exact_step: bool = False,
) -> PipelinePlan:
    """The PP plan with the least bottleneck stage time (see the module docstring).

    Args:
        num_layers: decoder layers of the model.
        costs: one per device, in stage order.
        num_microbatches: micro-batches per step (default: 2 × stages).
        ranks: the rank of each stage's device (default: stage ``j`` on rank ``j``).
        exact_step: minimise the whole step ``Σ_j t_j + (m − 1) · max_j t_j`` instead
            (:func:`_least_step`): with few micro-batches a slightly worse bottleneck can
            buy a much shorter fill.

    Raises:
        UserError: fewer layers than devices, a bad cost, or memory admits no partition.
    """
    _check_shape(num_layers, len(costs))
    for c in costs:
        times = (c.layer_s, c.embed_s, c.head_s, c.send_s)
        if not all(math.isfinite(t) and t >= 0 for t in times):
            raise UserError(f"pipeline costs of device '{c.name}' are negative or not finite: {c}")
    table = _table(num_layers, costs)
    bottleneck, _ = _partition(num_layers, costs, None, table)
    if bottleneck == math.inf:
        raise _memory_error(num_layers, costs)
    n = len(costs)
    m = num_microbatches or 2 * n
    if exact_step:
        ends = _least_step(num_layers, costs, bottleneck, m)
    else:
        _, ends = _partition(num_layers, costs, bottleneck, table)
    starts = [0, *ends[:-1]]
    return PipelinePlan(
        tuple(c.name for c in costs),
        tuple(zip(starts, ends, strict=True)),
        tuple(_stage_cost(costs, j, ends[j] - starts[j]) for j in range(n)),
        m,
        tuple(ranks),
    )


def _least_step(
    num_layers: int, costs: Sequence[StageCosts], bottleneck: float, m: int
) -> list[int]:
    """Stage ends minimising ``Σ t + (m − 1) · max t``, exactly.

    For every bound ``b``, the least ``Σ t`` with every stage ``≤ b`` plus ``(m − 1) · b`` is
    at least the step of the partition it finds, and equals the optimum's step at ``b`` = the
    optimum's bottleneck; so the least over the stage times ``b`` is the optimum. Only bounds
    from the least bottleneck up to where ``(m − 1) · b`` alone exceeds the best found can
    win, which keeps the candidates few."""
    table = _table(num_layers, costs)
    fill, ends = _partition(num_layers, costs, bottleneck, table)
    best = fill + (m - 1) * bottleneck
    least_fill, free_ends = _partition(num_layers, costs, math.inf, table)
    if m == 1:
        return free_ends
    n = len(costs)
    bounds = sorted(
        {
            t
            for j in range(n)
            for t in table[j][1 : num_layers - n + 2]
            if bottleneck < t < math.inf and least_fill + (m - 1) * t < best
        }
    )
    for b in bounds:
        if least_fill + (m - 1) * b >= best:
            break
        total, cand = _partition(num_layers, costs, b, table)
        if total + (m - 1) * b < best - 1e-12:
            best, ends = total + (m - 1) * b, cand
    return ends
