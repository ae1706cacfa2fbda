"""`xronos profile` → `xronos plan` → `xronos finetune --plan`: the planner as commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xronos.cli import main
from xronos.config import tiny
from xronos.planner.plan import Plan


@pytest.mark.slow
def test_profile_plan_and_reuse_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile, plan_file = tmp_path / "profile.json", tmp_path / "plan.json"
    assert (
        main(
            [
                "profile",
                "--cluster",
                "ci-2dev",
                "--model",
                "tiny",
                "--batch-size",
                "8",
                "--seq-len",
                "48",
                "--out",
                str(profile),
                "--no-emulation",
                "--no-cache",
            ]
        )
        == 0
    )
    data = json.loads(profile.read_text())
    assert [d["name"] for d in data["devices"]] == ["fast", "slow"]
    assert all(set(d["segments"]) == {"attn", "mlp", "vocab"} for d in data["devices"])
    assert main(["plan", "--profile", str(profile), "--out", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert "predicted step" in out and "fast" in out and "slow" in out
    plan = Plan.from_json(plan_file.read_text())
    plan.check(tiny())  # units of every segment sum to the model's
    assert main(["plan", "--profile", str(profile), "--strategy", "pp"]) == 0
    assert "layers" in capsys.readouterr().out
    run = tmp_path / "run"
    assert (
        main(
            [
                "finetune",
                "--cluster",
                "ci-2dev",
                "--plan",
                str(plan_file),
                "--steps",
                "2",
                "--train-size",
                "64",
                "--batch-size",
                "8",
                "--seq-len",
                "48",
                "--eval-size",
                "0",
                "--no-emulate",
                "--out",
                str(run),
            ]
        )
        == 0
    )
    assert Plan.from_json((run / "plan.json").read_text()) == plan


def test_plan_for_another_cluster_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(Plan.from_shares(tiny(), [1, 1, 1], ["a", "b", "c"]).to_json())
    code = main(
        [
            "finetune",
            "--cluster",
            "ci-2dev",
            "--plan",
            str(plan_file),
            "--no-emulate",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "is for devices ['a', 'b', 'c']" in err and "xronos plan" in err
