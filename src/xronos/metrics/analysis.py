"""Recorded spans to compute / transfer / idle per device (docs/architecture.md). Pure.

Every communication span ``c`` on rank ``i`` (``arrive_i(c)`` .. ``leave_i(c)``) is matched
with the same communication on the other ranks and split in two::

    arrive_i            max_j arrive_j                leave_i
       |---- idle_i(c) ----|------ transfer_i(c) ------|

    idle_i(c)     = clamp(max_j arrive_j(c) - arrive_i(c), 0, leave_i - arrive_i)
    transfer_i(c) = (leave_i - arrive_i) - idle_i(c)
    compute_i     = (end_i - start_i) - Σ_c idle_i(c) - Σ_c transfer_i(c)
    idle ratio_i  = Σ_c idle_i(c) / (end_i - start_i)

Each rank's ratios use its own step time ``end_i - start_i``; the step's wall time is
``max_i end_i - min_i start_i``. Spans on one rank must not overlap.

**Tensor parallelism** (:func:`analyze_step`): every rank issues the same collectives in the
same order; the k-th span of every rank is the same collective. Differing counts or names
raise ``ValueError`` — that is a bug in the engine, not a measurement.

**Pipeline parallelism** (:func:`analyze_pipeline_step`): ranks record different events.
Convention for the PP engine:

- Record each blocking point-to-point wait as a collective span named ``recv:<msg>`` on the
  receiver (arrive = the wait starts, leave = the data is there) and, when the sender blocks,
  ``send:<msg>`` on the sender. ``<msg>`` names the message uniquely within the step, e.g.
  ``act/mb3/1->2`` (activations of microbatch 3 from stage 1 to 2) or ``grad/mb3/2->1``.
- A ``send:<msg>``/``recv:<msg>`` pair (k-th occurrence with k-th occurrence) is matched like a
  collective of two, so the receiver's idle is the time until the sender started sending and
  the rest is transfer.
- A wait with no partner on another rank counts as idle except a transfer estimate
  (``transfer_estimate_s``: seconds, or a function of the span; default 0).
- Other collective names (a loss all-reduce) match by name and occurrence across the ranks
  that recorded them.
- Forward/backward of microbatches may be recorded as compute spans (``kind="forward"`` /
  ``"backward"``); they feed :func:`stall_ratio` and the trace, not the arithmetic above.

The bubble ratio of a stage is its idle ratio.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from xronos.errors import UserError
from xronos.metrics.overlap import is_laned, lane_keys, lane_phases, lanes_checked
from xronos.metrics.records import Phase, Span, StepRecord

P2P_PREFIXES = ("send:", "recv:")
"""Name prefixes that mark point-to-point waits in pipeline records."""

TransferEstimate = float | Callable[[Span], float]


@dataclass(frozen=True)
class DeviceMetrics:
    """One device's time split for a step (or the per-step mean over a run)."""

    rank: int
    name: str
    step_time_s: float
    compute_s: float
    transfer_s: float
    idle_s: float

    @property
    def idle_ratio(self) -> float:
        return self.idle_s / self.step_time_s if self.step_time_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "transfer_s": self.transfer_s,
            "idle_s": self.idle_s,
            "idle_ratio": self.idle_ratio,
        }


@dataclass(frozen=True)
class StepMetrics:
    """All devices' split of one step; ``step_time_s`` is the wall time max end − min start."""

    step: int
    step_time_s: float
    devices: tuple[DeviceMetrics, ...]

    @property
    def idle_ratio_mean(self) -> float:
        return statistics.fmean(d.idle_ratio for d in self.devices)

    @property
    def idle_ratio_max(self) -> float:
        return max(d.idle_ratio for d in self.devices)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "step_time_s": self.step_time_s,
            "idle_ratio_mean": self.idle_ratio_mean,
            "idle_ratio_max": self.idle_ratio_max,
            "per_device": [d.to_dict() for d in self.devices],
        }


@dataclass(frozen=True)
class RunMetrics:
    """Summary of the counted steps of a run (the bench.json fields it can fill)."""

    step_time_s: float
    """Median wall time of the counted steps."""
    step_time_s_all: tuple[float, ...]
    """Wall time of every counted step (warm-up excluded), in order."""
    per_device: tuple[DeviceMetrics, ...]
    """Per-step means of each device's own step and its compute / transfer / idle (its sum)."""
    idle_ratio_mean: float
    """Mean over devices of Σ idle / Σ own step time."""
    idle_ratio_max: float
    """Max over devices of the same."""
    compute_s_all: tuple[tuple[float, ...], ...]
    """Per device (as ``per_device``): its compute in every counted step, in order."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "step_time_s_all": list(self.step_time_s_all),
            "idle_ratio_mean": self.idle_ratio_mean,
            "idle_ratio_max": self.idle_ratio_max,
            "per_device": [
                d.to_dict() | {"compute_s_all": list(c)}
                for d, c in zip(self.per_device, self.compute_s_all, strict=True)
            ],
        }


def _checked(records: Sequence[StepRecord]) -> list[StepRecord]:
    """Records sorted by rank, after checking they describe one step consistently."""
    if not records:
        raise ValueError("no records to analyse")
    ordered = sorted(records, key=lambda r: r.rank)
    if len({r.rank for r in ordered}) != len(ordered):
        raise ValueError("two records of the same step come from the same rank")
    if len({r.step for r in ordered}) != 1:
        raise ValueError(f"records mix steps {sorted({r.step for r in ordered})}")
    laned = is_laned(ordered)
    for rec in ordered:
        if rec.end < rec.start:
            raise ValueError(f"rank {rec.rank} step {rec.step} ends before it starts")
        if laned:
            lanes_checked(rec)
            continue
        previous_end = rec.start
        for span in rec.collectives:
            if span.start < previous_end or span.end < span.start or span.end > rec.end:
                raise ValueError(
                    f"rank {rec.rank} step {rec.step}: collective {span.name!r} overlaps "
                    "another span or lies outside the step"
                )
            previous_end = span.end
    return ordered


def is_pipeline(records: Iterable[StepRecord]) -> bool:
    """True when the records hold point-to-point waits (``send:``/``recv:`` spans)."""
    return any(s.name.startswith(P2P_PREFIXES) for r in records for s in r.collectives)


def _tp_keys(records: list[StepRecord]) -> list[list[Hashable]]:
    reference = [s.name for s in records[0].collectives]
    for rec in records[1:]:
        names = [s.name for s in rec.collectives]
        if len(names) != len(reference):
            raise ValueError(
                f"step {rec.step}: rank {records[0].rank} recorded {len(reference)} "
                f"collectives but rank {rec.rank} recorded {len(names)}"
            )
        for k, (a, b) in enumerate(zip(reference, names, strict=True)):
            if a != b:
                raise ValueError(
                    f"step {rec.step}: collective #{k} is {a!r} on rank {records[0].rank} "
                    f"but {b!r} on rank {rec.rank}"
                )
    return [list(range(len(reference))) for _ in records]


def _pp_keys(records: list[StepRecord]) -> list[list[Hashable]]:
    keys = []
    for rec in records:
        seen: dict[tuple[str, str], int] = defaultdict(int)
        rank_keys: list[Hashable] = []
        for span in rec.collectives:
            p2p = span.name.startswith(P2P_PREFIXES)
            base = ("p2p", span.name[5:]) if p2p else ("coll", span.name)
            # A send and a recv of the same message share a key but count separately.
            counter = (span.name[:5] if p2p else "", base[1])
            rank_keys.append((*base, seen[counter]))
            seen[counter] += 1
        keys.append(rank_keys)
    return keys


def _split(
    records: list[StepRecord],
    keys: list[list[Hashable]],
    estimate: TransferEstimate | None,
) -> list[list[tuple[Span, float]]]:
    """Per rank, each collective with the time where its idle part ends and its transfer
    part begins (``start <= mid <= end``).

    ``estimate`` is used for spans that no other rank shares (pipeline only)."""
    latest: dict[Hashable, float] = {}
    members: dict[Hashable, int] = defaultdict(int)
    for rec, rank_keys in zip(records, keys, strict=True):
        for span, key in zip(rec.collectives, rank_keys, strict=True):
            latest[key] = max(latest.get(key, span.start), span.start)
            members[key] += 1
    out = []
    for rec, rank_keys in zip(records, keys, strict=True):
        parts = []
        for span, key in zip(rec.collectives, rank_keys, strict=True):
            if estimate is not None and members[key] == 1:
                t = estimate(span) if callable(estimate) else estimate
                mid = max(span.end - max(t, 0.0), span.start)
            else:
                mid = min(max(latest[key], span.start), span.end)
            parts.append((span, mid))
        out.append(parts)
    return out


def _metrics(records: list[StepRecord], split: list[list[tuple[Span, float]]]) -> StepMetrics:
    devices = []
    laned = is_laned(records)
    for rec, parts in zip(records, split, strict=True):
        if laned:
            spent: dict[str, float] = defaultdict(float)
            for ph in lane_phases(rec, parts):
                spent[ph.kind] += ph.end - ph.start
            idle, transfer = spent["idle"], spent["transfer"]
        else:
            idle = sum(mid - span.start for span, mid in parts)
            transfer = sum(span.end - mid for span, mid in parts)
        step = rec.duration
        compute = max(step - idle - transfer, 0.0)
        devices.append(DeviceMetrics(rec.rank, rec.device, step, compute, transfer, idle))
    wall = max(r.end for r in records) - min(r.start for r in records)
    return StepMetrics(records[0].step, wall, tuple(devices))


def analyze_step(records: Sequence[StepRecord]) -> StepMetrics:
    """Compute / transfer / idle of one tensor-parallel step (one record per rank)."""
    ordered = _checked(records)
    keys = lane_keys(ordered) if is_laned(ordered) else _tp_keys(ordered)
    return _metrics(ordered, _split(ordered, keys, None))


def analyze_pipeline_step(
    records: Sequence[StepRecord], transfer_estimate_s: TransferEstimate = 0.0
) -> StepMetrics:
    """Compute / transfer / idle (bubble) of one pipeline step; see the module docstring."""
    ordered = _checked(records)
    return _metrics(ordered, _split(ordered, _pp_keys(ordered), transfer_estimate_s))


def step_phases(
    records: Sequence[StepRecord],
    pipeline: bool | None = None,
    transfer_estimate_s: TransferEstimate = 0.0,
) -> dict[int, list[Phase]]:
    """Per rank, the step cut into consecutive compute / idle / transfer phases that cover
    ``[start, end]`` without overlap (zero-length pieces dropped).

    Args:
        pipeline: analyse as PP (True), TP (False) or decide by :func:`is_pipeline` (None).
    """
    ordered = _checked(records)
    laned = is_laned(ordered)
    if pipeline is None:
        pipeline = is_pipeline(ordered)
    if pipeline:
        split = _split(ordered, _pp_keys(ordered), transfer_estimate_s)
    else:
        keys = lane_keys(ordered) if laned else _tp_keys(ordered)
        split = _split(ordered, keys, None)
    phases: dict[int, list[Phase]] = {}
    for rec, parts in zip(ordered, split, strict=True):
        if laned:
            phases[rec.rank] = lane_phases(rec, parts)
            continue
        out: list[Phase] = []
        cursor = rec.start
        for span, mid in parts:
            pieces = [
                ("compute", cursor, span.start, "compute"),
                ("idle", span.start, mid, span.name),
                ("transfer", mid, span.end, span.name),
            ]
            out += [Phase(*p) for p in pieces if p[2] > p[1]]
            cursor = span.end
        if rec.end > cursor:
            out.append(Phase("compute", cursor, rec.end, "compute"))
        phases[rec.rank] = out
    return phases


def summarize(steps: Sequence[StepMetrics], skip_warmup: int = 0) -> RunMetrics:
    """Summarise a run, ignoring the first ``skip_warmup`` steps."""
    counted = list(steps)[skip_warmup:]
    if skip_warmup < 0 or not counted:
        raise UserError(
            f"a warm-up of {skip_warmup} steps leaves none of the {len(steps)} recorded steps "
            "to measure; lower the warm-up or run more steps"
        )
    ranks = [d.rank for d in counted[0].devices]
    per_rank: dict[int, list[DeviceMetrics]] = defaultdict(list)
    for sm in counted:
        if [d.rank for d in sm.devices] != ranks:
            raise ValueError(
                f"step {sm.step} has ranks {[d.rank for d in sm.devices]}, not {ranks}"
            )
        for d in sm.devices:
            per_rank[d.rank].append(d)
    means = []
    ratios = []
    for rank in ranks:
        rows = per_rank[rank]
        means.append(
            DeviceMetrics(
                rank=rank,
                name=rows[0].name,
                step_time_s=statistics.fmean(r.step_time_s for r in rows),
                compute_s=statistics.fmean(r.compute_s for r in rows),
                transfer_s=statistics.fmean(r.transfer_s for r in rows),
                idle_s=statistics.fmean(r.idle_s for r in rows),
            )
        )
        total = sum(r.step_time_s for r in rows)
        ratios.append(sum(r.idle_s for r in rows) / total if total > 0 else 0.0)
    times = tuple(sm.step_time_s for sm in counted)
    return RunMetrics(
        step_time_s=statistics.median(times),
        step_time_s_all=times,
        per_device=tuple(means),
        idle_ratio_mean=statistics.fmean(ratios),
        idle_ratio_max=max(ratios),
        compute_s_all=tuple(tuple(r.compute_s for r in per_rank[k]) for k in ranks),
    )


def stall_ratio(observed: Iterable[Span], isolated: Iterable[Span]) -> float:
    """Computation stall ratio ``1 − t_isolated / t_observed`` (docs/architecture.md), in [0, 1).

    ``t_observed`` sums the observed spans whose name has an isolated reference;
    ``t_isolated`` sums, for those same spans, the mean isolated duration of their name.

    Args:
        observed: compute spans measured during the real run (with communication around).
        isolated: the same computations measured with no concurrent communication.
    """
    reference: dict[str, list[float]] = defaultdict(list)
    for span in isolated:
        reference[span.name].append(span.duration)
    t_observed = 0.0
    t_isolated = 0.0
    for span in observed:
        if span.name in reference:
            t_observed += span.duration
            t_isolated += statistics.fmean(reference[span.name])
    if t_observed <= 0.0:
        raise ValueError("no observed compute span has an isolated reference of the same name")
    ratio = 1.0 - t_isolated / t_observed
    return min(max(ratio, 0.0), 1.0 - 1e-12)


def efficiency(ideal_s: float, measured_s: float) -> float:
    """``ideal / measured`` step time (1.0 = at the limit)."""
    if ideal_s <= 0 or measured_s <= 0:
        raise ValueError(f"step times must be positive, got ideal={ideal_s}, measured={measured_s}")
    return ideal_s / measured_s


def ideal_step_time(solo_step_times_s: Sequence[float]) -> float:
    """The compute bound ``1 / Σ_i (1 / T_i^solo)`` (docs/architecture.md, Measurement):
    every device busy all the time on its share, nothing moved. No transfer term: no
    strategy's own communication counts as ideal.

    Args:
        solo_step_times_s: each device's measured time to run the whole step alone.
    """
    if not solo_step_times_s or any(t <= 0 for t in solo_step_times_s):
        raise ValueError("solo step times must be a non-empty list of positive seconds")
    return 1.0 / sum(1.0 / t for t in solo_step_times_s)
