"""A device leaves during `xronos finetune`: the survivor carries on from the newest
checkpoint under a new plan and reaches the last step; with --no-elastic the run stops
with one line naming the device."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from xronos.cli import main

STEPS = 40  # far beyond KILL_AFTER: the run is still going when the device is killed
SAVE_EVERY = 4
KILL_AFTER = 6  # steps done when the slow device is killed: one checkpoint (4) exists
RUN = [
    "--model",
    "tiny",
    "--cluster",
    "ci-2dev",
    "--strategy",
    "tp-even",  # both devices train until one is lost (auto may leave the slow one out)
    "--steps",
    str(STEPS),
    "--save-every",
    str(SAVE_EVERY),
    "--train-size",
    "96",
    "--batch-size",
    "8",
    "--seq-len",
    "48",
    "--eval-size",
    "0",
    "--warmup-steps",
    "2",
    "--no-emulate",  # the launcher's fault handling is the same; the run is much shorter
    "--comm-dtype",
    "fp32",  # exact payloads: the losses are compared across plans
]
# After the loss the survivor runs `single` from the checkpoint: the same data order (the
# batcher's position is in the checkpoint), parameters and AdamW moments as the two-device
# run had; only the order in which the all-reduces summed the partial results differs, so
# the losses agree with the uninterrupted run's to fp32 reassociation (at most 1.5e-6
# relative measured; 1e-5, as for any resume onto another plan). A resume that lost the
# optimizer state or the data position is off by far more from the first step on.
LOSS_RTOL = 1e-5
WAIT_S = 240.0  # every wait below is bounded; a loaded 2-core host starts workers slowly


def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps_done(run: Path) -> int:
    return max((r["step"] for r in _rows(run) if "loss" in r), default=0)


def _pid_of(run: Path, device: str) -> int:
    table = json.loads((run / "devices.json").read_text())["devices"]
    return int(next(d["pid"] for d in table if d["name"] == device))


def _start(run: Path, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "xronos", "finetune", *RUN, "--out", str(run), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_slow_after(proc: subprocess.Popen[str], run: Path, how: int) -> tuple[int, int]:
    """Send ``how`` to the slow device's worker once KILL_AFTER steps are done (a
    checkpoint exists then); returns the steps done at that moment and the worker's pid."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        done = _steps_done(run)
        if done >= KILL_AFTER:
            pid = _pid_of(run, "slow")
            os.kill(pid, how)
            return done, pid
        time.sleep(0.05)
    out, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "")
    pytest.fail(f"the run never reached step {KILL_AFTER}: {out}\n{err}")


def _stop(proc: subprocess.Popen[str], stopped: int | None) -> None:
    """Whatever the test's outcome: no run left behind, no worker left stopped."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    if stopped is not None:
        try:
            state = Path(f"/proc/{stopped}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state == "T":
            os.kill(stopped, signal.SIGKILL)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Each step's loss in the same run with no device lost."""
    whole = tmp_path_factory.mktemp("whole") / "run"
    assert main(["finetune", *RUN, "--out", str(whole)]) == 0
    return {r["step"]: r["loss"] for r in _rows(whole) if "loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "extra"),
    [
        (signal.SIGKILL, []),
        # a device that stops answering: the others' collectives time out (--timeout), and
        # the launcher waits half of it more for the silent one to speak. The run waits both
        # out, so the timeout is short: 6 s (was 10), still far above any wait between the
        # two devices while both answer (steps of milliseconds with `tiny`, no emulation,
        # workers forked from a warm server that join within a second of each other)
        (signal.SIGSTOP, ["--timeout", "6"]),
    ],
    ids=["killed", "silent"],
)
def test_the_survivor_carries_on_from_the_checkpoint(
    tmp_path: Path, how: int, extra: list[str], uninterrupted: dict[int, float]
) -> None:
    run = tmp_path / "lost"
    proc = _start(run, *extra)
    pid = None
    try:
        seen, pid = _kill_slow_after(proc, run, how)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        _stop(proc, pid if how == signal.SIGSTOP else None)
    assert proc.returncode == 0, err
    assert "device lost after step" in out and "resumed from step" in out, out

    rows = _rows(run)
    events = [r for r in rows if "event" in r]
    assert [e["event"] for e in events] == ["device_lost", "resumed"], events
    lost, resumed = events
    assert (lost["device"], lost["rank"]) == ("slow", 1)
    reason = "died: killed by SIGKILL" if how == signal.SIGKILL else "stopped answering"
    assert lost["reason"].startswith(reason), lost
    assert lost["step"] >= seen  # steps reported before the loss
    assert resumed["step"] % SAVE_EVERY == 0 and 0 < resumed["step"] <= lost["step"]
    assert resumed["devices"] == ["fast"] and resumed["strategy"] == "single"
    assert resumed["recomputed_steps"] == lost["step"] - resumed["step"]

    # the steps after the resumption: every one up to the last, once, after the event
    after = rows[rows.index(resumed) + 1 :]
    got = {r["step"]: r["loss"] for r in after if "loss" in r}
    assert sorted(got) == list(range(resumed["step"] + 1, STEPS + 1))
    table = json.loads((run / "devices.json").read_text())["devices"]
    assert [(d["name"], d["rank"]) for d in table] == [("fast", 0)]
    assert "device lost" in (run / "summary.md").read_text()

    # the uninterrupted run: the same losses before the loss and after the resumption
    want = uninterrupted
    before = {r["step"]: r["loss"] for r in rows[: rows.index(lost)] if "loss" in r}
    for step, loss in [*before.items(), *got.items()]:
        assert loss == pytest.approx(want[step], rel=LOSS_RTOL), step
    assert got[STEPS] < want[1], "the run should learn"


@pytest.mark.slow
def test_no_elastic_stops_with_one_line(tmp_path: Path) -> None:
    run = tmp_path / "strict"
    proc = _start(run, "--no-elastic")
    try:
        _kill_slow_after(proc, run, signal.SIGKILL)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        _stop(proc, None)
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last == "xronos: error: device 'slow' (rank 1) died: killed by SIGKILL", err
    assert not [r for r in _rows(run) if r.get("event") == "resumed"]


@pytest.mark.slow
# a pipeline too: its checkpoint resumes as `single`, `single`'s as the pipeline again
@pytest.mark.parametrize("strategy", ["tp-even", "pp-1f1b"])
def test_a_lost_device_comes_back_into_the_plan(
    tmp_path: Path,
    strategy: str,
    uninterrupted: dict[int, float],
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "back"
    # switched off after step 6 (the checkpoint of step 4 exists), back after step 14
    script = ["--leave", f"slow@{KILL_AFTER}", "--rejoin", "slow@14"]
    argv = ["finetune", *RUN, "--strategy", strategy, "--out", str(run), *script]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "back after step" in out, out

    rows = _rows(run)
    events = [r for r in rows if "event" in r]
    kinds = [e["event"] for e in events]
    assert kinds == ["device_lost", "resumed", "device_joined", "resumed"], events
    lost, alone, joined, together = events
    assert lost["device"] == "slow" and lost["reason"].startswith("died: killed by SIGKILL")
    assert alone["devices"] == ["fast"] and alone["strategy"] == "single"
    # taken back after the step in flight when it asked, from the checkpoint written then:
    # nothing to do again
    assert joined["device"] == "slow" and joined["step"] >= 14
    assert together["step"] == joined["step"] and together["recomputed_steps"] == 0
    # (a pipeline lists its devices in stage order, which its planner chooses)
    assert sorted(together["devices"]) == ["fast", "slow"] and together["strategy"] == strategy

    after = rows[rows.index(together) + 1 :]
    got = {r["step"]: r["loss"] for r in after if "loss" in r}
    assert sorted(got) == list(range(joined["step"] + 1, STEPS + 1))
    table = json.loads((run / "devices.json").read_text())
    assert [(d["name"], d["rank"]) for d in table["devices"]] == [("fast", 0), ("slow", 1)]
    assert table["lost"] == []
    assert not list((run / "join").iterdir())  # the request was taken
    assert "device joined" in (run / "summary.md").read_text()
    # alone and together again, the same training as the run that lost nothing
    final = {r["step"]: r["loss"] for r in rows if "loss" in r}  # the last of each step
    for step, loss in final.items():
        assert loss == pytest.approx(uninterrupted[step], rel=LOSS_RTOL), step
