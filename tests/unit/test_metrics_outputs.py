"""trace.json, PNG figures, metrics.jsonl and the bench table."""

from __future__ import annotations

import io
import itertools
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread
from rich.console import Console

from xronos.errors import UserError
from xronos.metrics import (
    MetricsWriter,
    Span,
    StepRecord,
    analyze_step,
    format_bench_table,
    plot_bench,
    plot_losses,
    plot_timeline,
    print_bench_table,
    read_metrics,
    write_trace,
)
from xronos.metrics.plot import COLORS

NAMES = ["hub", "gateway", "car"]


def _steps() -> list[list[StepRecord]]:
    """Two TP steps of three ranks; rank 1 is the straggler; rank 0 records compute spans."""
    steps = []
    for n, t in enumerate((100.0, 112.0)):
        steps.append(
            [
                StepRecord(
                    0,
                    "hub",
                    n,
                    t,
                    t + 10,
                    (Span("c0", t + 2, t + 5), Span("c1", t + 6, t + 9)),
                    (Span("fwd", t, t + 2, "forward"), Span("bwd", t + 5, t + 6, "backward")),
                ),
                StepRecord(
                    1, "gateway", n, t, t + 10, (Span("c0", t + 4, t + 5), Span("c1", t + 8, t + 9))
                ),
                StepRecord(
                    2,
                    "car",
                    n,
                    t + 0.5,
                    t + 10,
                    (Span("c0", t + 3, t + 5), Span("c1", t + 7, t + 9)),
                ),
            ]
        )
    return steps


def test_trace_has_one_process_per_device_and_phases_tile_each_step(tmp_path: Path) -> None:
    steps = _steps()
    path = tmp_path / "run" / "trace.json"
    write_trace(path, steps, NAMES)
    assert [p.name for p in path.parent.iterdir()] == ["trace.json"]  # no temp file left
    events = json.loads(path.read_text())["traceEvents"]

    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == dict(enumerate(NAMES))
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 for e in spans)

    # Phase lane (tid 1): per device and step, consecutive and covering the step exactly.
    # Times are ~1e8 µs, where float64 spacing is ~1e-8 µs: 1e-6 µs tolerates rounding only.
    origin = min(r.start for step in steps for r in step)
    by_lane: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in spans:
        if e["tid"] == 1:
            by_lane[e["pid"]].append(e)
    assert sorted(by_lane) == [0, 1, 2]
    for pid, lane in by_lane.items():
        lane.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(lane):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6
        for step in steps:
            rec = step[pid]
            mine = [e for e in lane if e["args"]["step"] == rec.step]
            assert mine[0]["ts"] == pytest.approx((rec.start - origin) * 1e6, abs=1e-6)
            last = mine[-1]
            assert last["ts"] + last["dur"] == pytest.approx((rec.end - origin) * 1e6, abs=1e-6)
            assert sum(e["dur"] for e in mine) == pytest.approx(rec.duration * 1e6, abs=1e-6)
            idle = sum(e["dur"] for e in mine if e["cat"] == "idle") / 1e6
            assert idle == pytest.approx(analyze_step(step).devices[pid].idle_s, abs=1e-9)

    ops = [e["name"] for e in spans if e["tid"] == 2]
    assert ops == ["fwd", "bwd"] * 2  # explicit compute spans, only rank 0 recorded them


def _assert_png(path: Path, min_side: int = 200) -> np.ndarray:
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] >= min_side and image.shape[1] >= min_side
    assert float(image[..., :3].std()) > 0.01  # not a blank canvas
    return image


def _has_colour(image: np.ndarray, colour: str) -> bool:
    # PNG stores 8-bit channels: an exact fill comes back within 1/255 of the colour.
    return bool((np.abs(image[..., :3] - np.array(to_rgb(colour))) < 1.5 / 255).all(-1).any())


def test_timeline_png_shows_each_phase(tmp_path: Path) -> None:
    image = _assert_png_written(lambda p: plot_timeline(p, _steps(), NAMES), tmp_path)
    for kind in ("compute", "transfer", "idle"):
        assert _has_colour(image, COLORS[kind]), kind
    # A step with no waiting at all draws no idle colour.
    no_wait = [[StepRecord(0, "a", 0, 0.0, 2.0, (Span("c", 1.0, 1.5),))]]
    image = _assert_png_written(lambda p: plot_timeline(p, no_wait), tmp_path)
    assert not _has_colour(image, COLORS["idle"])


def _assert_png_written(draw: Any, tmp_path: Path) -> np.ndarray:
    path = tmp_path / "figure.png"
    path.unlink(missing_ok=True)
    draw(path)
    return _assert_png(path)


BENCH: dict[str, Any] = {
    "scenario": "ci-2dev",
    "model": "tiny",
    "devices": [{"name": "hub", "cores": 1, "cpu_quota": 1.0}],
    "ideal_step_time_s": 0.5,
    "strategies": {
        "xronos": {
            "step_time_s": 0.82,
            "speedup_vs_single": 1.25,
            "predicted_step_time_s": 0.8,
            "tokens_per_s": 1250.0,
            "idle_ratio_mean": 0.02,
            "idle_ratio_max": 0.04,
            "stall_ratio": 0.0,
            "efficiency": 0.61,
            "final_loss": 2.3456,
        },
        "tp-even": {
            "step_time_s": 1.0,
            "tokens_per_s": 1024.0,
            "idle_ratio_mean": 0.2,
            "idle_ratio_max": 0.4,
            "stall_ratio": 0.0,
            "efficiency": 0.5,
            "final_loss": 2.3456,
        },
        "pp-1f1b": {
            "step_time_s": 1.9,
            "tokens_per_s": 540.0,
            "idle_ratio_mean": 0.35,
            "idle_ratio_max": 0.5,
            "stall_ratio": 0.18,
            "efficiency": None,
            "final_loss": float("nan"),
        },
    },
}


def test_bench_and_loss_pngs(tmp_path: Path) -> None:
    _assert_png_written(lambda p: plot_bench(p, BENCH), tmp_path)
    _assert_png_written(
        lambda p: plot_losses(p, {"xronos": [3.0, 2.5, 2.2], "pp-1f1b": [3.0, 2.7]}), tmp_path
    )
    with pytest.raises(ValueError):
        plot_bench(tmp_path / "x.png", {"strategies": {}})


def test_bench_table_lists_every_strategy() -> None:
    text = format_bench_table(BENCH)
    lines = text.splitlines()
    assert lines[0].split()[0] == "strategy" and "final loss" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2:] if not line.startswith("ideal")}
    assert set(rows) == set(BENCH["strategies"])
    assert lines[0].split()[1:3] == ["x", "single"]  # the table leads with the speed-up
    assert rows["xronos"][1:5] == ["1.25x", "0.820", "0.800", "-18.0%"]  # 0.82 / 1.0 - 1
    assert rows["pp-1f1b"][1] == "-"  # no speed-up given
    assert rows["pp-1f1b"][3:5] == ["-", "+90.0%"]  # no prediction given
    assert rows["pp-1f1b"][-2:] == ["-", "-"]  # missing efficiency, NaN loss
    assert rows["xronos"][6:8] == ["2.0%", "4.0%"]
    without_baseline = {"strategies": {"xronos": BENCH["strategies"]["xronos"]}}
    assert format_bench_table(without_baseline).splitlines()[2].split()[4] == "-"

    out = io.StringIO()
    print_bench_table(BENCH, Console(file=out, width=160))
    assert all(name in out.getvalue() for name in BENCH["strategies"])


def test_metrics_writer_flushes_each_line_and_writes_strict_json(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        writer.write({"step": 0, "loss": 2.5})
        assert read_metrics(path) == [{"step": 0, "loss": 2.5}]  # visible before close
        writer.write({"step": 1, "loss": math.nan, "per_device": [{"idle": math.inf}]})
        writer.write(analyze_step(_steps()[0]))
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # json: strict parse
    assert rows[1] == {"step": 1, "loss": None, "per_device": [{"idle": None}]}
    assert rows[2]["per_device"][0]["idle_s"] == pytest.approx(4.0, abs=1e-9)
    with pytest.raises(ValueError, match="closed"):
        writer.write({"step": 9})


def test_metrics_writer_appends_after_a_cut_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "lo')  # a crash cut the last line
    with MetricsWriter(path) as writer:
        writer.write({"step": 2})
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1]) == {"step": 2}
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not valid JSON"):
        read_metrics(path)
