"""The bench's bound with every device busy: solo steps timed together against in turn."""

from __future__ import annotations

from typing import Any

import pytest

from xronos.bench.report import together_bound
from xronos.cli.bench import together_line
from xronos.emulation.cluster import ci_2dev


def _result() -> dict[str, Any]:
    return {"strategies": {"xronos": {"step_time_s": 0.5}, "pp-1f1b": {"feasible": False}}}


def test_together_gives_contention_bound_and_efficiency() -> None:
    result = _result()
    together_bound(result, ci_2dev(), alone=[0.6, 1.5], together=[0.66, 1.5])
    assert result["contention"] == pytest.approx({"fast": 0.1, "slow": 0.0})
    bound = 1 / (1 / 0.66 + 1 / 1.5)
    assert result["ideal_together_step_time_s"] == pytest.approx(bound)
    assert result["strategies"]["xronos"]["efficiency_together"] == pytest.approx(bound / 0.5)
    assert "efficiency_together" not in result["strategies"]["pp-1f1b"]  # never ran
    line = together_line(result, result["contention"])
    assert "fast +10.0 %" in line and "slow +0.0 %" in line and "xronos" in line


@pytest.mark.parametrize(
    ("alone", "together"),
    [([0.6, 1.5], []), ([0.6, 1.5], [0.66, None]), ([0.6, None], [0.66, 1.5])],
)
def test_no_bound_unless_every_device_was_timed_both_ways(
    alone: list[float | None], together: list[float | None]
) -> None:
    result = _result()
    together_bound(result, ci_2dev(), alone=alone, together=together)
    assert result == _result()
