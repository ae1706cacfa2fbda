"""The bench's predicted step per strategy: of the plan that ran, for ``auto`` as for
``xronos`` (calibration moves a tensor-parallel plan after ``auto`` predicted it)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from tests.unit.test_calibrate import _profile
from xronos.bench.steps import StrategyLog
from xronos.bench.worker import predictions
from xronos.config import small
from xronos.planner import plan_tp
from xronos.planner.auto import AutoChoice, Candidate
from xronos.planner.plan import Plan
from xronos.planner.solve import predict
from xronos.train.session import Strategy

CFG = small()


PROFILES = [_profile("fast", 1.0), _profile("slow", 0.4), _profile("third", 0.2)]


def _run(ran: Candidate, plan_that_ran: dict[str, Any]) -> dict[Strategy, float | None]:
    job: Any = SimpleNamespace(
        strategies=(Strategy.AUTO,), fastest=0, spec=SimpleNamespace(comm_dtype="fp32")
    )
    single = Candidate("single", (0,), 1.5, Plan.single(CFG), True, "single")
    choice = AutoChoice(("fast", "slow", "third"), (single, ran))
    logs = {Strategy.AUTO: StrategyLog(plan=plan_that_ran)}
    return predictions(job, choice, PROFILES, logs, {"ran": ran.to_dict()})


def test_auto_that_ran_tensor_parallelism_is_predicted_on_the_plan_after_calibration() -> None:
    pair = [PROFILES[0], PROFILES[1]]
    first = plan_tp(CFG, pair)  # what auto predicted before calibration
    ran = Candidate("xronos", (0, 1), 0.25, first, True, "xronos over two")
    mlp = first.split("mlp")
    calibrated = dataclasses.replace(first, mlp=(mlp[0] - 6, mlp[1] + 6))  # moved by calibration
    got = _run(ran, calibrated.to_dict())[Strategy.AUTO]
    # the plan that ran, over the two devices that ran it (not the third), like xronos's
    assert got == pytest.approx(predict(calibrated, pair)["step_time_s"])
    assert got != pytest.approx(predict(first, pair)["step_time_s"])
    assert got != pytest.approx(0.25)


def test_auto_that_ran_something_else_keeps_its_candidates_prediction() -> None:
    ran = Candidate("single", (0,), 1.5, Plan.single(CFG), True, "single")
    assert _run(ran, Plan.single(CFG).to_dict())[Strategy.AUTO] == pytest.approx(1.5)
