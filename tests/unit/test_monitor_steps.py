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


def test_a_release_is_logged_and_summed_up(tmp_path: Path) -> None:
    from xronos.config import ModelConfig
    from xronos.planner.plan import Plan

    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=8, num_kv_heads=4)  # fmt: skip
    pair, alone = Plan.even(cfg, ("fast", "slow")), Plan.single(cfg, "fast")
    out = io.StringIO()
    monitor = RunMonitor(tmp_path, 40, lambda generated: None, out=out)
    release = {"kind": "rebalance", "step": 24, "seconds": 0.6, "before": pair.to_dict(),
               "steps_left": 16, "plan": alone.to_dict(), "relative": [], "now_s": 1.0,
               "then_s": 0.55, "why": "release", "keep": [0]}  # fmt: skip
    monitor.on_event(0, release)
    monitor.on_event(0, _step(25, 100))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r.get("event") == "release"]
    assert row["released"] == ["slow"] and row["after"]["devices"] == ["fast"]
    assert row["measured_s"] == 1.0 and row["predicted_s"] == 0.55
    assert abs(row["predicted_gain_s"] - 0.45 * 16) < 1e-9
    assert json.loads((tmp_path / "plan.json").read_text())["devices"] == ["fast"]
    assert "slow no longer paid for its part" in out.getvalue()
    summary = monitor.finish(25)
    assert "| release at step 24 | slow no longer paid for its part" in summary


def test_a_move_back_is_logged_with_what_was_measured(tmp_path: Path) -> None:
    from xronos.config import ModelConfig
    from xronos.planner.plan import Plan

    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=8, num_kv_heads=4)  # fmt: skip
    moved = Plan.from_dict({**Plan.even(cfg, ("fast", "slow")).to_dict(), "attn": [3, 1]})
    first = Plan.even(cfg, ("fast", "slow"))
    out = io.StringIO()
    monitor = RunMonitor(tmp_path, 100, lambda generated: None, out=out)
    undo = {"kind": "rebalance", "step": 24, "seconds": 0.8, "before": moved.to_dict(),
            "steps_left": 76, "plan": first.to_dict(), "relative": [], "now_s": 0.318,
            "then_s": 0.300, "why": "undo", "keep": []}  # fmt: skip
    monitor.on_event(0, undo)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r.get("event") == "replan_undone"]
    assert row["before"]["attn"] == [3, 1] and row["after"]["attn"] == list(first.split("attn"))
    assert "slower (0.318 s a step against 0.300 before it); moved back" in out.getvalue()
    assert "measured 0.318 → 0.300 s/step" in out.getvalue()
    assert json.loads((tmp_path / "plan.json").read_text())["attn"] == list(first.split("attn"))
    summary = monitor.finish(25)
    assert "| replan undone at step 24 | the steps after the last move were slower" in summary


def _offer(pays: bool) -> dict[str, object]:
    """A pipeline's restart offer as :class:`xronos.run.restage.Restager` emits it."""
    held = None if pays else "3% faster, under the 5% a first plan's restart needs"
    return {"kind": "restage" if pays else "restage_kept", "step": 12, "why": "balance",
            "relative": {"core0": 1.1, "core1": 4.0}, "now_s": 0.259, "best_s": 0.216,
            "best": "pp-1f1b [core1 -> core0]", "saving_s": 0.04, "restart_s": 1.4,
            "left": 208, "pays": pays, "held": held}  # fmt: skip


def test_a_restart_offer_is_logged_taken_or_not(tmp_path: Path) -> None:
    out = io.StringIO()
    monitor = RunMonitor(tmp_path, 220, lambda generated: None, out=out)
    monitor.on_event(0, _offer(pays=False))
    monitor.on_event(0, _offer(pays=True))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kept, taken = rows
    assert kept["event"] == "restage_kept" and taken["event"] == "restage"
    assert kept["held"] == _offer(pays=False)["held"] and "held" not in taken
    assert kept["left"] == taken["left"] == 208 and kept["relative"]["core1"] == 4.0
    said = out.getvalue()
    head = "step 12: compute against the plan's core0 ×1.10, core1 ×4.00; pp-1f1b [core1 -> "
    head += "core0] predicted at 0.216 s a step, now 0.259"
    assert f"{head}: 3% faster, under the 5% a first plan's restart needs; kept the plan" in said
    assert f"{head}: planned again" in said
    summary = monitor.finish(220)
    assert "| restage kept at step 12 | compute against the plan's" in summary
    assert "| restage at step 12 | compute against the plan's" in summary
