"""PNG figures: a per-device timeline, the bench comparison and loss curves.

Figures are built with ``matplotlib.figure.Figure`` on the Agg canvas, never through pyplot,
so nothing here touches a global backend or a display; files are written atomically.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from xronos.metrics.analysis import TransferEstimate, step_phases
from xronos.metrics.records import StepRecord
from xronos.utils import atomic_write_bytes

COLORS = {"compute": "#4c9a2a", "transfer": "#2b6cb0", "idle": "#d64545"}
"""Colour of each phase kind in the timeline."""


def _save(fig: Figure, path: str | os.PathLike[str]) -> None:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())


def plot_timeline(
    path: str | os.PathLike[str],
    steps: Sequence[Sequence[StepRecord]],
    device_names: Sequence[str] | None = None,
    pipeline: bool | None = None,
    transfer_estimate_s: TransferEstimate = 0.0,
) -> None:
    """One lane per device with compute / transfer / idle coloured, seconds on the x axis.

    Args:
        steps: per step, one record per rank (on one clock).
        device_names: name per rank; default: the names in the records.
        pipeline: analyse as PP / TP / auto (None), as in ``step_phases``.
    """
    ranks = sorted({r.rank for step in steps for r in step})
    if not ranks:
        raise ValueError("no step records to plot")
    names = {r.rank: r.device or f"rank{r.rank}" for step in steps for r in step}
    if device_names is not None:
        names = {rank: device_names[rank] for rank in ranks}
    origin = min(r.start for step in steps for r in step)
    lane = {rank: i for i, rank in enumerate(ranks)}
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for records in steps:
        if not records:
            continue
        for rank, phases in step_phases(records, pipeline, transfer_estimate_s).items():
            for ph in phases:
                bars.setdefault((rank, ph.kind), []).append((ph.start - origin, ph.end - ph.start))
    fig = Figure(figsize=(11, 2.4 + 0.5 * len(ranks)))
    ax = fig.add_subplot()
    drawn = {kind for _, kind in bars}
    for (rank, kind), ranges in bars.items():
        ax.broken_barh(ranges, (lane[rank] - 0.4, 0.8), facecolors=COLORS[kind], linewidth=0)
    for records in steps:
        if records:
            ax.axvline(min(r.start for r in records) - origin, color="#888", lw=0.6, ls="--")
    ax.set_yticks(range(len(ranks)), [names[r] for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlabel("time (s)")
    ax.set_title("per-device timeline (dashed: step starts)")
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLORS.items() if k in drawn],
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        frameon=False,
    )
    fig.tight_layout()
    _save(fig, path)


def _value(entry: Mapping[str, Any], key: str) -> float:
    v = entry.get(key)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else math.nan


def plot_bench(path: str | os.PathLike[str], bench: Mapping[str, Any]) -> None:
    """Median step time, idle ratio (mean and max) and stall ratio per strategy, side by side.

    Args:
        bench: a ``bench.json`` document (docs/cli.md).
    """
    strategies: Mapping[str, Mapping[str, Any]] = bench.get("strategies", {})
    if not strategies:
        raise ValueError("bench has no strategies to plot")
    labels = list(strategies)
    x = list(range(len(labels)))
    fig = Figure(figsize=(4 + 2.2 * len(labels), 4))
    ax_t, ax_i, ax_s = fig.subplots(1, 3)
    bars = ax_t.bar(x, [_value(strategies[s], "step_time_s") for s in labels], color="#2b6cb0")
    ax_t.bar_label(bars, fmt="%.3g", fontsize=8)
    ideal = _value(bench, "ideal_step_time_s")
    if ideal > 0:
        ax_t.axhline(ideal, color="#333", ls="--", lw=1, label="ideal")
        ax_t.legend(frameon=False)
    ax_t.set_ylabel("median step time (s)")
    w = 0.38
    ax_i.bar(
        [i - w / 2 for i in x],
        [_value(strategies[s], "idle_ratio_mean") for s in labels],
        w,
        label="mean",
        color="#e08c8c",
    )
    ax_i.bar(
        [i + w / 2 for i in x],
        [_value(strategies[s], "idle_ratio_max") for s in labels],
        w,
        label="max",
        color="#d64545",
    )
    ax_i.set_ylabel("idle ratio")
    ax_i.set_ylim(0, 1)
    ax_i.legend(frameon=False)
    ax_s.bar(x, [_value(strategies[s], "stall_ratio") for s in labels], color="#9c6ade")
    ax_s.set_ylabel("computation stall ratio")
    ax_s.set_ylim(0, 1)
    for ax in (ax_t, ax_i, ax_s):
        ax.set_xticks(x, labels, rotation=30, ha="right")
    fig.suptitle(f"xronos bench: {bench.get('scenario', '')}  model: {bench.get('model', '')}")
    fig.tight_layout()
    _save(fig, path)


def plot_losses(path: str | os.PathLike[str], losses: Mapping[str, Sequence[float]]) -> None:
    """Training loss per step, one line per strategy (or run)."""
    if not losses:
        raise ValueError("no loss curves to plot")
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for label, values in losses.items():
        ax.plot(range(len(values)), list(values), label=label, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


def plot_crossover(path: str | os.PathLike[str], doc: Mapping[str, Any]) -> None:
    """Step time ÷ single's against link bandwidth, one line per strategy (``auto``
    included, its pick written at each point), a line at 1.0 (below it collaborating
    pays). Bandwidth is on a log axis; loopback sits at the right end, labelled.

    Args:
        doc: a ``crossover.json`` document (:mod:`xronos.bench.crossover`).
    """
    links: Sequence[Mapping[str, Any]] = doc.get("links", [])
    if not links:
        raise ValueError("crossover has no links to plot")
    rates = [float(e["bandwidth_bps"]) for e in links if e.get("bandwidth_bps")]
    top = max(rates) if rates else 1e9
    loopback_x = top * 4 if rates else top
    xs = [float(e["bandwidth_bps"]) if e.get("bandwidth_bps") else loopback_x for e in links]
    order = sorted(range(len(links)), key=lambda i: xs[i])
    fig = Figure(figsize=(8, 4.6))
    ax = fig.add_subplot()
    names: list[str] = list(doc.get("strategies", []))
    for name in names:
        points = [
            (xs[i], ratio)
            for i in order
            if (ratio := (links[i]["strategies"].get(name) or {}).get("step_over_single"))
        ]
        if not points:
            continue
        style = {"lw": 2.4, "color": "#222"} if name == "auto" else {"lw": 1.4}
        ax.plot(*zip(*points, strict=True), marker="o", ms=4, label=name, **style)
        if name == "auto":
            for i in order:
                ratio = (links[i]["strategies"].get(name) or {}).get("step_over_single")
                if ratio and links[i].get("auto_chosen"):
                    ax.annotate(
                        str(links[i]["auto_chosen"]),
                        (xs[i], ratio),
                        textcoords="offset points",
                        xytext=(0, 7),
                        ha="center",
                        fontsize=7,
                    )
    ax.axhline(1.0, color="#888", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xticks([xs[i] for i in order], [str(links[i]["link"]) for i in order])
    ax.minorticks_off()
    if rates:
        ax.axvspan(top * 2, loopback_x * 2, color="#f0f0f0", zorder=0)
    ax.set_xlim(min(xs) / 1.6, max(xs) * 1.6)
    ax.set_xlabel("link bandwidth (every device)")
    ax.set_ylabel("step time ÷ single (below 1: collaborating pays)")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.005, 1.0))
    fig.suptitle(
        f"xronos bench crossover: {doc.get('scenario', '')}  model: {doc.get('model', '')}"
    )
    fig.tight_layout()
    _save(fig, path)
