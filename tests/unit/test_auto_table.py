"""The table ``xronos finetune`` prints for ``auto``: every candidate, what was measured, a
re-planned candidate, the collaboration weighed against the device alone, and what runs."""

from __future__ import annotations

from xronos.run.autotable import auto_table
from xronos.run.trials import AgainstAlone

CHOICE = {
    "devices": ["hub", "pi"],
    "candidates": [
        {"strategy": "xronos", "devices": [0, 1], "predicted_step_s": 0.40, "why": "w1"},
        {"strategy": "single", "devices": [0], "predicted_step_s": 0.48, "why": "w2"},
    ],
}


def test_the_table_names_the_re_plan_and_the_plan_kept() -> None:
    choice = CHOICE
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


def test_the_table_says_how_the_collaboration_weighed_against_the_device_alone() -> None:
    alone = CHOICE["candidates"][1]
    weighed = AgainstAlone("xronos:0,1", "single:0", 0.98, paired=True).to_dict()
    text = auto_table(CHOICE, alone, {"xronos:0,1": 0.47, "single:0": 0.48}, None, weighed)
    line = next(line for line in text.splitlines() if line.startswith("   xronos:0,1 / single:0"))
    assert "0.980 (the median of the rounds' ratios)" in line and "at 0.97 or less" in line
    assert text.splitlines()[-1] == "auto runs single on [hub]"
    # medians from different times: their ratio, said so
    apart = AgainstAlone("xronos:0,1", "single:0", 0.9, paired=False).to_dict()
    text = auto_table(CHOICE, CHOICE["candidates"][0], {}, None, apart)
    assert "0.900 (the ratio of the medians)" in text
