"""`xronos profile` → `xronos plan` → `xronos finetune --plan`: the planner as commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xronos.cli import main
from xronos.cli.profile import shape_for
from xronos.config import tiny
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.plan import Plan
from xronos.profiler.bytes import base_bytes, unit_bytes


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
    # each device's bytes: the counts with their activations scaled to its measured step
    shape = shape_for("tiny", 8, 48, 0)
    for d in data["devices"]:
        assert d["memory_scale"] >= 1.0
        assert d["unit_bytes"] == unit_bytes(shape, d["memory_scale"])
        assert d["base_bytes"] == base_bytes(shape, d["memory_scale"])
    assert main(["plan", "--profile", str(profile), "--out", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert "predicted step" in out and "fast" in out and "slow" in out
    plan = Plan.from_json(plan_file.read_text())
    plan.check(tiny())  # units of every segment sum to the model's
    pp_file = tmp_path / "pp.json"
    assert main(["plan", "--profile", str(profile), "--strategy", "pp", "--out", str(pp_file)]) == 0
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
    # a pipeline plan runs as a pipeline (auto takes the given plan's kind)
    pipeline = PipelinePlan.from_dict(json.loads(pp_file.read_text()))
    args = ["finetune", "--cluster", "ci-2dev", "--plan", str(pp_file), "--steps", "2"]
    args += ["--train-size", "64", "--batch-size", "8", "--seq-len", "48", "--eval-size", "0"]
    assert main([*args, "--no-emulate", "--out", str(tmp_path / "pp-run")]) == 0
    ran = PipelinePlan.from_dict(json.loads((tmp_path / "pp-run" / "plan.json").read_text()))
    assert ran.layer_ranges == pipeline.layer_ranges and ran.stage_ranks == pipeline.stage_ranks


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


def test_a_pipeline_plan_is_refused_by_a_strategy_that_cannot_run_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_file = tmp_path / "pp.json"
    plan_file.write_text(PipelinePlan(("slow", "fast"), ((0, 1), (1, 4)), (), 2, (1, 0)).to_json())
    base = ["finetune", "--cluster", "ci-2dev", "--model", "tiny", "--plan", str(plan_file)]
    base += ["--no-emulate", "--out", str(tmp_path / "run")]
    assert main([*base, "--strategy", "xronos"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a pipeline plan" in err and "pp-1f1b" in err
    # the stage order names each device at its rank: slow is rank 1, fast rank 0
    plan_file.write_text(PipelinePlan(("slow", "fast"), ((0, 1), (1, 4)), (), 2, (0, 1)).to_json())
    assert main(base) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "runs 'slow' as rank 0" in err
    assert not (tmp_path / "run").exists()
