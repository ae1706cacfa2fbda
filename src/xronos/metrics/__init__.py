"""Measurement: record spans in each worker, split every step into compute / transfer /
idle per device (docs/architecture.md, Measurement), and write metrics.jsonl, trace.json,
PNGs and the bench table.

``plot_timeline``, ``plot_bench`` and ``plot_losses`` (:mod:`xronos.metrics.plot`) are
imported on first use: matplotlib is slow to import and workers never need it.
"""

from __future__ import annotations

from typing import Any

from xronos.metrics.agreement import loss_agreement
from xronos.metrics.analysis import (
    P2P_PREFIXES,
    DeviceMetrics,
    Phase,
    RunMetrics,
    StepMetrics,
    analyze_pipeline_step,
    analyze_step,
    efficiency,
    ideal_step_time,
    is_pipeline,
    stall_ratio,
    step_phases,
    summarize,
)
from xronos.metrics.clock import ClockOffset, estimate_clock_offset
from xronos.metrics.jsonl import MetricsWriter, read_metrics
from xronos.metrics.recorder import SpanRecorder, current_recorder, use_recorder
from xronos.metrics.records import (
    COLLECTIVE,
    COMPUTE,
    Span,
    StepRecord,
    pack_records,
    packed_size,
    unpack_records,
)
from xronos.metrics.table import format_bench_table, print_bench_table
from xronos.metrics.trace import trace_events, write_trace

__all__ = [
    "COLLECTIVE",
    "COMPUTE",
    "P2P_PREFIXES",
    "ClockOffset",
    "DeviceMetrics",
    "MetricsWriter",
    "Phase",
    "RunMetrics",
    "Span",
    "SpanRecorder",
    "StepMetrics",
    "StepRecord",
    "analyze_pipeline_step",
    "analyze_step",
    "current_recorder",
    "efficiency",
    "estimate_clock_offset",
    "format_bench_table",
    "ideal_step_time",
    "is_pipeline",
    "loss_agreement",
    "pack_records",
    "packed_size",
    "plot_bench",
    "plot_losses",
    "plot_timeline",
    "print_bench_table",
    "read_metrics",
    "stall_ratio",
    "step_phases",
    "summarize",
    "trace_events",
    "unpack_records",
    "use_recorder",
    "write_trace",
]

_LAZY = {"plot_bench", "plot_losses", "plot_timeline"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from xronos.metrics import plot

        return getattr(plot, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
