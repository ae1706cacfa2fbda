"""One line for each event of a run (``metrics.jsonl``'s ``{"event": ...}`` rows), as the
run's progress and its ``summary.md`` show it."""

from __future__ import annotations

from typing import Any


def event_text(e: dict[str, Any]) -> str:
    """The text of the event row ``e`` (its ``event`` names it; a ``resumed`` row else)."""
    if e["event"] == "device_lost":
        return f"{e['device']} (rank {e['rank']}): {e['reason']}"
    if e["event"] == "device_joined":
        return f"{e['device']} is back"
    if e["event"] in ("replan", "release"):
        return (
            f"{e['reason']}; moved in {e['move_s']:.1f} s, predicted to save "
            f"{e['predicted_gain_s']:.0f} s"
        )
    if e["event"] == "replan_undone":
        return f"{e['reason']} in {e['move_s']:.1f} s"
    if e["event"] == "replan_held":
        return f"a better plan was found, but {e['reason']}; kept the plan"
    if e["event"] in ("restage", "restage_kept"):
        return _restage_text(e)
    if e["event"] == "io_threads_restored":
        return f"another program took {e['device']}'s CPU; its I/O threads are back to normal"
    return (
        f"on {', '.join(e['devices'])} ({e['strategy']}), {e['recomputed_steps']} steps done again"
    )


def _restage_text(e: dict[str, Any]) -> str:
    """A pipeline's restart offer (:mod:`xronos.run.restage`), taken or not."""
    speeds = ", ".join(f"{d} ×{r:.2f}" for d, r in e["relative"].items())
    what = "the plan's" if e.get("why") == "balance" else "the others'"
    best = f"{e['best']} predicted at {e['best_s']:.3f} s a step, now {e['now_s']:.3f}"
    said = f"compute against {what} {speeds}; {best}"
    if e["event"] == "restage":
        return f"{said}: planned again"
    return f"{said}: {e['held']}; kept the plan"
