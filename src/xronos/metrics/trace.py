"""Chrome / Perfetto trace-event JSON of a run (open in ui.perfetto.dev or chrome://tracing).

One process per device (``pid`` = rank, named after the device), three threads:

- ``tid 0`` "steps":  one span per training step;
- ``tid 1`` "phases": compute, idle and transfer, consecutive and non-overlapping, covering
  each step exactly (:func:`xronos.metrics.analysis.step_phases`);
- ``tid 2`` "ops":    the explicit compute spans, if the engine recorded any.

Times are microseconds since the earliest recorded step start.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from xronos.metrics.analysis import TransferEstimate, step_phases
from xronos.metrics.records import StepRecord
from xronos.utils import atomic_write_text

TID_STEPS, TID_PHASES, TID_OPS = 0, 1, 2
_THREADS = {TID_STEPS: "steps", TID_PHASES: "phases", TID_OPS: "ops"}


def _device_names(
    steps: Sequence[Sequence[StepRecord]], device_names: Sequence[str] | None
) -> dict[int, str]:
    ranks = sorted({r.rank for step in steps for r in step})
    if device_names is not None:
        if len(device_names) < len(ranks) or (ranks and ranks[-1] >= len(device_names)):
            raise ValueError(f"{len(device_names)} device names for ranks {ranks}")
        return {rank: device_names[rank] for rank in ranks}
    names = {r.rank: r.device or f"rank{r.rank}" for step in steps for r in step}
    return dict(sorted(names.items()))


def _span(
    pid: int,
    tid: int,
    name: str,
    cat: str,
    t0: float,
    t1: float,
    origin: float,
    args: dict[str, Any],
) -> dict[str, Any]:
    ts = (t0 - origin) * 1e6
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": (t1 - origin) * 1e6 - ts,
        "args": args,
    }


def trace_events(
    steps: Sequence[Sequence[StepRecord]],
    device_names: Sequence[str] | None = None,
    pipeline: bool | None = None,
    transfer_estimate_s: TransferEstimate = 0.0,
) -> dict[str, Any]:
    """The trace as a JSON-able dict (``{"traceEvents": [...], ...}``).

    Args:
        steps: per step, one record per rank (already on one clock).
        device_names: name per rank; default: the names in the records.
        pipeline: analyse as PP / TP / auto (None), as in ``step_phases``.
        transfer_estimate_s: PP transfer estimate for unmatched waits.
    """
    names = _device_names(steps, device_names)
    events: list[dict[str, Any]] = []
    for rank, name in names.items():
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": name}})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}
        )
        for tid, thread in _THREADS.items():
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": rank,
                    "tid": tid,
                    "args": {"name": thread},
                }
            )
    starts = [r.start for step in steps for r in step]
    origin = min(starts) if starts else 0.0
    for records in steps:
        if not records:
            continue
        phases = step_phases(records, pipeline, transfer_estimate_s)
        for rec in records:
            step_args = {"step": rec.step}
            events.append(
                _span(
                    rec.rank,
                    TID_STEPS,
                    f"step {rec.step}",
                    "step",
                    rec.start,
                    rec.end,
                    origin,
                    step_args,
                )
            )
            for ph in phases[rec.rank]:
                events.append(
                    _span(
                        rec.rank,
                        TID_PHASES,
                        ph.kind if ph.kind == "compute" else f"{ph.kind}: {ph.name}",
                        ph.kind,
                        ph.start,
                        ph.end,
                        origin,
                        step_args,
                    )
                )
            for span in rec.computes:
                events.append(
                    _span(
                        rec.rank,
                        TID_OPS,
                        span.name,
                        span.kind,
                        span.start,
                        span.end,
                        origin,
                        step_args,
                    )
                )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(
    path: str | os.PathLike[str],
    steps: Sequence[Sequence[StepRecord]],
    device_names: Sequence[str] | None = None,
    pipeline: bool | None = None,
    transfer_estimate_s: TransferEstimate = 0.0,
) -> None:
    """Write :func:`trace_events` to ``path`` atomically."""
    trace = trace_events(steps, device_names, pipeline, transfer_estimate_s)
    atomic_write_text(path, json.dumps(trace, separators=(",", ":")))
