"""The bench comparison as a table: plain text for files and docs, ``rich`` for the console.

The table leads with the speed-up over ``single`` (the fastest device alone: is
collaborating worth it at all?); ``vs tp-even`` is the change in median step time relative
to Megatron's even split (negative = faster); ratios are shown as percentages; a missing
value is ``-``. ``pred s`` is the planner's prediction of the step (communication
included), next to the measured median. ``peak MiB`` is each device's peak resident
memory during the strategy (devices separated by ``/``). A strategy that could not fit the
devices' memory shows ``infeasible`` and no figures; why is printed under the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from xronos.metrics.agreement import disagreement_note

HEADERS = (
    "strategy",
    "x single",
    "step s",
    "pred s",
    "vs tp-even",
    "tokens/s",
    "idle mean",
    "idle max",
    "stall",
    "peak MiB",
    "efficiency",
    "final loss",
)
BASELINE = "tp-even"


def _num(entry: Mapping[str, Any], key: str) -> float | None:
    v = entry.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _fmt(value: float | None, style: Callable[[float], str]) -> str:
    return "-" if value is None else style(value)


def _peaks(values: Any) -> str:
    """``612/498``: one whole MiB per device; ``-`` when not measured."""
    if not isinstance(values, list) or not values:
        return "-"
    return "/".join("-" if _num({"v": v}, "v") is None else f"{v:.0f}" for v in values)


def notes(bench: Mapping[str, Any]) -> list[str]:
    """Lines under the table: why a strategy could not run, which one's loss left
    ``single``'s, how memory was measured."""
    strategies = bench.get("strategies", {})
    out = [
        f"{name}: infeasible: {entry['infeasible']}"
        for name, entry in strategies.items()
        if entry.get("infeasible")
    ]
    out += [n for n in (disagreement_note(k, e) for k, e in strategies.items()) if n]
    memory = bench.get("memory") or {}
    caps = memory.get("enforced_cap_mb") or memory.get("cap_mb")
    if isinstance(caps, list) and any(c is not None for c in caps):
        shown = "/".join("none" if c is None else f"{c:.0f}" for c in caps)
        out.append(f"memory caps (MiB): {shown}; strategies ran {memory.get('schedule', '?')}")
    return out


def bench_rows(bench: Mapping[str, Any]) -> list[list[str]]:
    """One row of formatted cells per strategy, in the order of ``bench["strategies"]``."""
    strategies: Mapping[str, Mapping[str, Any]] = bench.get("strategies", {})
    base = _num(strategies.get(BASELINE, {}), "step_time_s")
    rows = []
    for name, entry in strategies.items():
        if entry.get("infeasible"):
            rows.append([name, "infeasible"] + ["-"] * (len(HEADERS) - 2))
            continue
        step = _num(entry, "step_time_s")
        change = None if step is None or not base else (step / base - 1.0) * 100.0
        rows.append(
            [
                name,
                _fmt(_num(entry, "speedup_vs_single"), lambda v: f"{v:.2f}x"),
                _fmt(step, lambda v: f"{v:.3f}"),
                _fmt(_num(entry, "predicted_step_time_s"), lambda v: f"{v:.3f}"),
                _fmt(change, lambda v: f"{v:+.1f}%"),
                _fmt(_num(entry, "tokens_per_s"), lambda v: f"{v:.1f}"),
                _fmt(_num(entry, "idle_ratio_mean"), lambda v: f"{100 * v:.1f}%"),
                _fmt(_num(entry, "idle_ratio_max"), lambda v: f"{100 * v:.1f}%"),
                _fmt(_num(entry, "stall_ratio"), lambda v: f"{100 * v:.1f}%"),
                _peaks(entry.get("peak_rss_mb")),
                _fmt(_num(entry, "efficiency"), lambda v: f"{100 * v:.1f}%"),
                _fmt(_num(entry, "final_loss"), lambda v: f"{v:.4f}"),
            ]
        )
    return rows


def format_bench_table(bench: Mapping[str, Any]) -> str:
    """Plain-text table of a ``bench.json`` document (docs/cli.md), ending with a newline."""
    rows = bench_rows(bench)
    widths = [max(len(r[i]) for r in [list(HEADERS), *rows]) for i in range(len(HEADERS))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    out = [line(list(HEADERS)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    ideal = _num(bench, "ideal_step_time_s")
    if ideal:
        out.append(f"ideal step time: {ideal:.3f} s")
    out += notes(bench)
    return "\n".join(out) + "\n"


def print_bench_table(bench: Mapping[str, Any], console: Any = None) -> None:
    """Print the table with ``rich`` when it is installed, else as plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_bench_table(bench), end="")
        return
    table = Table(title=f"xronos bench: {bench.get('scenario', '')}")
    for i, header in enumerate(HEADERS):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in bench_rows(bench):
        table.add_row(*row)
    (console or Console()).print(table)
    ideal = _num(bench, "ideal_step_time_s")
    if ideal:
        (console or Console()).print(f"ideal step time: {ideal:.3f} s")
    for line in notes(bench):
        (console or Console()).print(line, markup=False)
