"""Join requests: what `xronos join` accepts and refuses (one line each), and what the
launcher takes from the run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from xronos.cli import main
from xronos.errors import UserError
from xronos.run.membership import JoinWatch, request_join
from xronos.run.scripted import parse_at, parse_list


def _run_dir(tmp_path: Path, pid: int, lost: list[str]) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    rows = [{"name": "fast", "rank": 0, "pid": pid, "cpus": [0], "cgroups": []}]
    (run / "devices.json").write_text(json.dumps({"devices": rows, "lost": lost}))
    return run


def test_a_lost_device_of_a_live_run_is_asked_back(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, os.getpid(), ["slow"])  # this process stands for a live worker
    watch = JoinWatch(run, say=lambda line: None)  # the launcher, watching
    path = request_join(run, "slow")
    assert path == run / "join" / "slow" and path.read_text() == "slow\n"
    assert not watch.ask()  # the launcher has lost nothing: no reason to stop
    watch.lost = ["gateway", "slow"]
    assert watch.ask() and watch.asked
    assert watch.take() == ["slow"] and watch.lost == ["gateway"]
    assert not path.exists()


@pytest.mark.parametrize(
    ("device", "lost", "alive", "words"),
    [
        ("slow", ["slow"], False, "no run is going on there"),
        ("fast", [], True, "already training"),
        ("nuc", ["slow"], True, "did not lose a device 'nuc' (lost: 'slow')"),
    ],
)
def test_join_refuses_with_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    device: str,
    lost: list[str],
    alive: bool,
    words: str,
) -> None:
    dead = 2**22 + 12345  # above the default pid_max: no such process
    run = _run_dir(tmp_path, os.getpid() if alive else dead, lost)
    assert main(["join", str(run), device]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (run / "join").exists()  # nothing written


def test_join_needs_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a run directory"):
        request_join(tmp_path, "slow")


def test_requests_of_an_earlier_launch_are_dropped(tmp_path: Path) -> None:
    (tmp_path / "join").mkdir()
    (tmp_path / "join" / "slow").write_text("slow\n")  # the run stopped before taking it
    watch = JoinWatch(tmp_path, say=lambda line: None)
    watch.lost = ["slow"]  # lost again after the resume: it did not ask this time
    assert not watch.ask()


def test_a_request_for_a_device_not_lost_is_dropped(tmp_path: Path) -> None:
    said: list[str] = []
    watch = JoinWatch(tmp_path, said.append)
    (tmp_path / "join").mkdir()
    (tmp_path / "join" / "nuc").write_text("nuc\n")
    watch.lost = ["slow"]
    assert watch.requests() == [] and not (tmp_path / "join" / "nuc").exists()
    assert said == ["join request for 'nuc' ignored: it is not a device this run lost"]


@pytest.mark.parametrize(
    ("text", "words"),
    [("slow", "give DEVICE@STEP"), ("slow@0", "give DEVICE@STEP"), ("nuc@3", "no device 'nuc'")],
)
def test_scripted_steps_are_checked(text: str, words: str) -> None:
    with pytest.raises(UserError, match=words):
        parse_at("--leave", text, ["fast", "slow"])
    assert parse_at("--leave", "slow@3", ["fast", "slow"]) == ("slow", 3)


def test_several_programs_are_a_comma_separated_list() -> None:
    assert parse_list("--disturb", None) == []
    assert parse_list("--disturb", "slow@16, slow@16,fast@3") == ["slow@16", "slow@16", "fast@3"]
    with pytest.raises(UserError, match="an empty item"):
        parse_list("--disturb", "slow@16,")
