"""Live re-balancing as a user sees it: while nothing changes the run keeps its plan (no
chasing noise); when another program starts on the slow device of ``ci-2dev`` mid-run
(``--disturb``), the run moves to a new plan and completes. Behaviour only: the timings are
benchmarks (docs/benchmarks.md)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_emulation_cgroups import NO_CGROUPS
from xronos.cli import main
from xronos.run.rebalance import COOLDOWN

# the other program joins the slow device's cgroups
pytestmark = pytest.mark.skipif(NO_CGROUPS is not None, reason=str(NO_CGROUPS))

STEPS = 110
DISTURB_AT = 36  # the steady steps before it pass the cooldown (24) and 3 agreements
# A move must pay twice its cost over the steps left (before any move: 5 step times). The
# first move comes by step 52 (below). In one run the program took a step from 0.55-0.67
# to 1.43 s, the move came at step 44 and was predicted to save 22.7 s over the 40 steps
# left against a 1.4 s move (steps then 0.75-0.85 s); on a quieter host it took a step
# only from 0.39 to 0.65 s, and with 84 steps no move paid for 5 such steps twice over the
# 40-48 left. 110 leave 58-66 steps, half as much again.
# `small` with LoRA: enough units per segment that the plan can follow the slow device (on
# `tiny` it already holds almost nothing), and no AdamW over every weight each step. 64
# tokens a sequence: at 32 the slow device's share is small enough (its vocabulary slice
# alone, once two-rank all-reduces became one exchange) that a move rarely pays for itself
# over the steps left, which is right, but not what this test is about.
RUN = [
    *("--model", "small", "--no-full", "--cluster", "ci-2dev", "--strategy", "xronos"),
    *("--batch-size", "4", "--seq-len", "64", "--train-size", "96"),
    *("--eval-size", "0", "--warmup-steps", "2"),
]


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_plan_stays_until_another_program_starts_on_the_slow_device(tmp_path: Path) -> None:
    run = tmp_path / "run"
    disturb = ["--disturb", f"slow@{DISTURB_AT}"]
    assert main(["finetune", *RUN, "--steps", str(STEPS), *disturb, "--out", str(run)]) == 0
    rows = _rows(run)
    # the slow device's idle-class I/O threads would starve behind the program (the run
    # then lasts many minutes): they are put back in the normal class once it starts
    back = [r for r in rows if r.get("event") == "io_threads_restored"]
    assert [r["device"] for r in back] == ["slow"] and back[0]["step"] >= DISTURB_AT
    rows = _rows(run)
    replans = [r for r in rows if r.get("event") == "replan"]
    # The first plan is checked once against its own first steps; where its calibration
    # missed by enough to pay (a busy moment of the host), that one move comes before the
    # program starts.
    balance = [r for r in replans if "out of balance" in r["reason"]]
    assert len(balance) <= 1 and all(r["step"] < DISTURB_AT for r in balance)
    moves = [r for r in replans if r not in balance]
    assert moves, "no move after the program started"
    # not while nothing changed (steps 1-36: no chasing noise), then within the window
    # after the program started (the recent median needs half of it), before the end
    assert DISTURB_AT < moves[0]["step"] <= DISTURB_AT + 16 < STEPS
    # The program keeps running: the slow device's speed beside it need not settle with
    # the first move (on one host, 2 of 4 recorded runs moved again 24 steps later, the slow
    # device's compute against the fast one's having changed by x1.33 and x0.76 since the
    # first move, each predicted to save 7 s against a 1.4-1.6 s move). A later move must
    # wait out the cooldown and pay for itself like the first.
    steps = [m["step"] for m in replans]
    assert all(b - a >= COOLDOWN for a, b in itertools.pairwise(steps)), steps
    # the rebalancer's rule: over the steps left, more than twice what the last move took
    assert all(b["predicted_gain_s"] > 2 * a["move_s"] for a, b in itertools.pairwise(replans))
    move = moves[0]
    assert move["before"] != move["after"] and move["move_s"] > 0
    assert move["predicted_gain_s"] > 0  # the new plan is predicted faster over the steps left
    assert "slow" in move["reason"]
    fast, slow = move["relative"]
    assert slow > 1.25 and fast < 1  # the slow device's compute grew against the fast one's
    plan = json.loads((run / "plan.json").read_text())
    assert plan["devices"] == ["fast", "slow"]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))


# auto: the same workload on a pair where collaborating clearly pays (the slow device at
# 0.6 of the fast one, so that auto's trials never pick the fast device alone, as they did
# about half the time at ci-2dev's 0.4), until three other programs take the slow device
# and leave its worker a quarter of it (0.15), where the fast device alone is faster than
# any plan over both. A release needs a full window of steps (8, after 2 of warm-up) and
# must pay twice a first move's estimated cost (5 steps) over the steps left. In two runs
# the pair stepped in 0.24 s, the programs started at step 17, and the release came at
# step 20, once half the window was slow (0.61-0.63 s measured against 0.37 predicted on
# the fast device alone, which then stepped in 0.32-0.33 s); 12 steps of margin allow a
# busier host.
RELEASE_STEPS = 80
RELEASE_AT = 16
PAIR = """
[[device]]
name = "fast"
cores = 1

[[device]]
name = "slow"
cores = 1
cpu_quota = 0.6
"""


@pytest.mark.slow
def test_auto_releases_a_device_that_other_programs_took(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cluster = tmp_path / "pair.toml"
    cluster.write_text(PAIR)
    at, c = RUN.index("--strategy"), RUN.index("--cluster")
    flags = [*RUN[:c], "--cluster", str(cluster), *RUN[c + 2 : at], "--strategy", "auto"]
    flags += RUN[at + 2 :]
    programs = ",".join([f"slow@{RELEASE_AT}"] * 3)
    steps, disturb = ["--steps", str(RELEASE_STEPS)], ["--disturb", programs]
    assert main(["finetune", *flags, *steps, *disturb, "--out", str(run)]) == 0
    rows = _rows(run)
    started = [r for r in rows if r.get("event") == "io_threads_restored"]
    assert [r["device"] for r in started] == ["slow"]  # the programs started there
    ran = json.loads((run / "auto.json").read_text())["ran"]
    assert ran["strategy"] == "xronos", ran
    released = [r for r in rows if r.get("event") == "release"]
    assert len(released) == 1, released  # for the rest of the run
    (r,) = released
    assert RELEASE_AT < r["step"] <= RELEASE_AT + 12
    assert r["released"] == ["slow"] and r["after"]["devices"] == ["fast"]
    assert r["after"]["strategy"] == "single"
    assert r["predicted_s"] < 0.95 * r["measured_s"]  # RELEASE_GAIN
    assert json.loads((run / "plan.json").read_text())["devices"] == ["fast"]
    # the fast device trains on alone to the end; every step is reported once
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, RELEASE_STEPS + 1))
