"""`xronos finetune` refuses bad input with one line, before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xronos.cli import main


def _finetune(capsys: pytest.CaptureFixture[str], tmp: Path, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["finetune", "--out", str(tmp / "run"), "--no-emulate", *argv])
    return code, capsys.readouterr().err.strip()


def _one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("xronos: error: ")
    for n in needles:
        assert n in err, err


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_missing_data_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _finetune(capsys, tmp_path, "--data", str(tmp_path / "nope.jsonl"))
    _one_line(code, err, "nope.jsonl", "no such file")


def test_empty_data_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write(tmp_path / "empty.jsonl", [])
    code, err = _finetune(capsys, tmp_path, "--data", data)
    _one_line(code, err, "empty.jsonl", "empty")


def test_malformed_json_names_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = json.dumps({"prompt": "lights on", "completion": " turn_on(light)"})
    data = _write(tmp_path / "bad.jsonl", [good, good, "{not json"])
    code, err = _finetune(capsys, tmp_path, "--data", data)
    _one_line(code, err, "bad.jsonl:3", "malformed JSON")


def test_missing_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = json.dumps({"prompt": "lights on", "completion": " turn_on(light)"})
    data = _write(tmp_path / "fields.jsonl", [good, json.dumps({"prompt": "only a prompt"})])
    code, err = _finetune(capsys, tmp_path, "--data", data)
    _one_line(code, err, "fields.jsonl:2", "completion")


def test_all_examples_too_long_under_drop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long = json.dumps({"text": "lights on in the kitchen please " * 20})
    data = _write(tmp_path / "long.jsonl", [long] * 4)
    code, err = _finetune(
        capsys, tmp_path, "--data", data, "--truncation", "drop", "--seq-len", "16"
    )
    _one_line(code, err, "longer than --seq-len 16", "--truncation truncate")


def test_invalid_cluster_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "cluster.toml"
    spec.write_text('[[device]]\nname = "hub"\ncores = 1\ncpu_quota = 1.7\n')
    code, err = _finetune(capsys, tmp_path, "--cluster", str(spec))
    _one_line(code, err, "cluster.toml", "cpu_quota")


def test_bad_option_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _finetune(capsys, tmp_path, "--batch-size", "0")
    _one_line(code, err, "--batch-size")
    code, err = _finetune(capsys, tmp_path, "--strategy", "ring")
    _one_line(code, err, "--strategy", "xronos")
    code, err = _finetune(capsys, tmp_path, "--seq-len", "4096")
    _one_line(code, err, "--seq-len", "context")


def test_resume_of_a_directory_that_is_not_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _finetune(capsys, tmp_path, "--resume", str(tmp_path))
    _one_line(code, err, "--resume", "not a run directory")


def test_a_hybrid_on_two_devices_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _finetune(
        capsys, tmp_path, "--strategy", "hybrid", "--cluster", "ci-2dev", "--model", "tiny"
    )
    _one_line(code, err, "--strategy hybrid", "three devices", "has 2", "--strategy auto")
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_new_run_into_another_runs_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new run writing its checkpoints beside an older run's would leave ``--resume``
    continuing whichever has the higher step: the older run's, here."""
    quick = ["--model", "tiny", "--strategy", "single", "--eval-size", "0"]
    code, err = _finetune(capsys, tmp_path, *quick, "--steps", "2")
    assert code == 0, err
    run = tmp_path / "run"
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    code, err = _finetune(capsys, tmp_path, *quick, "--steps", "1")
    _one_line(code, err, f"--out {run}", "step 2", f"--resume {run}", "another --out")
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before


def test_a_save_total_limit_below_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _finetune(capsys, tmp_path, "--save-total-limit", "0")
    _one_line(code, err, "--save-total-limit", "≥ 1", "got 0")
    assert not (tmp_path / "run").exists()
