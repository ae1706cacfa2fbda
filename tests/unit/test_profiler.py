"""Profiler: the line fit, and measurements that are positive and grow with the units."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xronos.config import tiny
from xronos.model.lora import LoRAConfig
from xronos.profiler.measure import Shape, fit_line, measure_segments, unit_points


@given(
    a=st.floats(0, 1),
    b=st.floats(1e-4, 1),
    units=st.lists(st.integers(1, 64), min_size=2, max_size=5, unique=True),
)
@settings(max_examples=100, deadline=None)
def test_fit_recovers_an_exact_line(a: float, b: float, units: list[int]) -> None:
    curve = fit_line([(u, a + b * u) for u in units])
    # least squares on exact points: only float rounding, relative to the largest time
    scale = a + b * max(units)
    assert curve.a == pytest.approx(a, abs=1e-9 * scale + 1e-12)
    assert curve.b == pytest.approx(b, rel=1e-6)


def test_fit_clamps_to_non_negative() -> None:
    curve = fit_line([(1, 0.5), (2, 0.4), (4, 0.1)])  # decreasing: noise, not physics
    assert curve.a >= 0 and curve.b > 0


def test_unit_points_are_distinct_and_in_range() -> None:
    for total in (1, 2, 3, 16, 257):
        pts = unit_points(total)
        assert pts == sorted(set(pts)) and all(1 <= p <= total for p in pts)


@pytest.mark.parametrize("lora", [None, LoRAConfig(r=4)], ids=["full", "lora"])
def test_measured_curves_are_positive(lora: LoRAConfig | None) -> None:
    shape = Shape(cfg=tiny(), batch_size=2, seq_len=16, mlp_chunk=8, vocab_chunk=32, lora=lora)
    curves, replicated = measure_segments(shape, repeats=1)
    assert set(curves) == {"attn", "mlp", "vocab"}
    assert replicated > 0
    for seg, c in curves.items():
        assert c.a >= 0 and c.b > 0, seg
        assert c(4) > 0 and c(0) == 0
