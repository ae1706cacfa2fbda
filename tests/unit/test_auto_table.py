"""The table ``xronos finetune`` prints for ``auto``: every candidate, what was measured, a
re-planned candidate, and what runs."""

from __future__ import annotations

from xronos.run.autotable import auto_table


def test_the_table_names_the_re_plan_and_the_plan_kept() -> None:
    choice = {
        "devices": ["hub", "pi"],
        "candidates": [
            {"strategy": "xronos", "devices": [0, 1], "predicted_step_s": 0.40, "why": "w1"},
            {"strategy": "single", "devices": [0], "predicted_step_s": 0.48, "why": "w2"},
        ],
    }
    refined = [
        {
            "candidate": "xronos:0,1",
            "before": {"attn": [12, 4], "mlp": [45, 19], "vocab": [180, 76]},
            "after": {"attn": [13, 3], "mlp": [48, 16], "vocab": [180, 76]},
            "measured_before_s": 0.47,
            "measured_after_s": 0.39,
            "kept": "after",
        }
    ]
    text = auto_table(choice, choice["candidates"][0], {"xronos:0,1": 0.39}, refined)
    lines = text.splitlines()
    assert lines[1].startswith(" * xronos") and "measured 0.390 s" in lines[1]
    re_plan = next(line for line in lines if "re-planned" in line)
    assert "attn 12:4 -> 13:3" in re_plan and "mlp 45:19 -> 48:16" in re_plan
    assert "vocab" not in re_plan  # unchanged segments are not listed
    assert "0.470 s -> 0.390 s, kept after" in re_plan
    assert lines[-1] == "auto runs xronos on [hub, pi]"
