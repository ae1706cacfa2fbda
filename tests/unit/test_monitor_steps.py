"""The run's step lines and metrics rows: the first step has no rate yet (its time is the
start-up's, not training's), and says so instead of printing a number."""

from __future__ import annotations

import io
import json
from pathlib import Path

from xronos.run.monitor import RunMonitor


def _step(step: int, tokens: int) -> dict[str, object]:
    return {"kind": "step", "step": step, "loss": 2.5, "grad_norm": 1.0, "lr": 1e-4,
            "tokens": tokens, "records": []}  # fmt: skip


def test_the_first_step_has_no_rate_and_the_second_has_one(tmp_path: Path) -> None:
    out = io.StringIO()
    monitor = RunMonitor(tmp_path, 2, lambda generated: None, out=out)
    monitor.on_event(0, _step(1, 100))
    monitor.on_event(0, _step(2, 100))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step     1/2  loss 2.5000  - tok/s")
    rate = float(lines[1].split("loss 2.5000")[1].split("tok/s")[0].replace(",", ""))
    assert rate > 0 and "nan" not in out.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["tokens_per_s"] is None
    assert abs(rows[1]["tokens_per_s"] - rate) <= 0.5  # the line rounds to the token
