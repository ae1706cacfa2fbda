"""The table ``auto`` prints before it runs: every candidate's predicted step, the trial
steps it measured, the plans it re-planned from them, and what runs."""

from __future__ import annotations

from typing import Any


def auto_table(
    choice: dict[str, Any],
    ran: dict[str, Any],
    trials: dict[str, float] | None = None,
    refined: list[dict[str, Any]] | None = None,
    against_alone: dict[str, Any] | None = None,
) -> str:
    """What ``auto`` predicted for every candidate, fastest first, what it measured of the
    best few (and of any plan re-planned from its trial steps), how its fastest
    collaboration weighed against the fastest device alone, and what runs."""
    names = choice["devices"]
    rows = sorted(
        choice["candidates"],
        key=lambda c: (c["predicted_step_s"] is None, c["predicted_step_s"] or 0.0),
    )
    lines = ["auto: predicted seconds per step of every way to run it (the best few measured)"]
    for c in rows:
        mark = "*" if c["strategy"] == ran["strategy"] and c["devices"] == ran["devices"] else " "
        pred = f"{c['predicted_step_s']:.3f} s" if c["predicted_step_s"] else "infeasible"
        who = ", ".join(names[r] for r in c["devices"])
        key = f"{c['strategy']}:{','.join(map(str, c['devices']))}"
        tried = (trials or {}).get(key)
        got = f"  measured {tried:.3f} s" if tried is not None else ""
        lines.append(f" {mark} {c['strategy']:<8} [{who}]  {pred}{got}  {c['why']}")
    for r in refined or ():
        moved = ", ".join(
            f"{seg} {':'.join(map(str, r['before'][seg]))} -> {':'.join(map(str, after))}"
            for seg, after in r["after"].items()
            if after != r["before"][seg]
        )
        lines.append(
            f"   {r['candidate']} re-planned from its trial steps ({moved}): measured "
            f"{r['measured_before_s']:.3f} s -> {r['measured_after_s']:.3f} s, kept {r['kept']}"
        )
    if against_alone is not None:
        a = against_alone
        how = "the median of the rounds' ratios" if a["paired"] else "the ratio of the medians"
        lines.append(
            f"   {a['together']} / {a['alone']}: {a['ratio']:.3f} ({how}); a collaboration "
            f"runs only at {1.0 - a['margin']:.2f} or less"
        )
    lines.append(f"auto runs {ran['strategy']} on [{', '.join(names[r] for r in ran['devices'])}]")
    return "\n".join(lines)
