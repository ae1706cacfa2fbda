"""The PP stage planner against brute force over all contiguous partitions."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xronos.errors import UserError
from xronos.planner import PipelinePlan, StageCosts, even_pipeline, plan_pipeline


def partitions(num_layers: int, n: int):
    """Every split of ``num_layers`` into ``n`` contiguous non-empty stages (as sizes)."""
    for cuts in itertools.combinations(range(1, num_layers), n - 1):
        bounds = (0, *cuts, num_layers)
        yield [bounds[j + 1] - bounds[j] for j in range(n)]


def brute_force(num_layers: int, costs: list[StageCosts]):
    """(least bottleneck, least sum of stage times at it) over partitions that fit."""
    n, best = len(costs), None
    for sizes in partitions(num_layers, n):
        flags = [dict(first=j == 0, last=j == n - 1) for j in range(n)]
        if not all(c.fits(k, **f) for c, k, f in zip(costs, sizes, flags, strict=True)):
            continue
        times = [c.stage_s(k, **f) for c, k, f in zip(costs, sizes, flags, strict=True)]
        key = (max(times), sum(times))
        best = key if best is None or key < best else best
    return best


t = st.one_of(st.integers(0, 4).map(float), st.floats(0, 4, allow_nan=False))


@st.composite
def pipeline_cases(draw: st.DrawFn) -> tuple[int, list[StageCosts]]:
    n = draw(st.integers(1, 4))
    num_layers = draw(st.integers(n, 10))
    costs = [
        StageCosts(
            name=f"d{j}",
            layer_s=draw(t),
            embed_s=draw(t),
            head_s=draw(t),
            send_s=draw(st.sampled_from([0.0, 0.5])),
            layer_bytes=draw(st.integers(0, 3)),
            embed_bytes=draw(st.integers(0, 4)),
            head_bytes=draw(st.integers(0, 4)),
            memory_bytes=draw(st.sampled_from([0, 0, 6, 10, 16])),
        )
        for j in range(n)
    ]
    return num_layers, costs


@settings(max_examples=200, deadline=None)
@given(pipeline_cases())
def test_optimal_against_brute_force(case) -> None:
    num_layers, costs = case
    expected = brute_force(num_layers, costs)
    if expected is None:
        with pytest.raises(UserError, match="memory"):
            plan_pipeline(num_layers, costs)
        return
    plan = plan_pipeline(num_layers, costs)
    n = len(costs)
    assert plan.num_layers == num_layers and plan.num_stages == n
    sizes = [b - a for a, b in plan.layer_ranges]
    assert min(sizes) >= 1
    for j, (c, k) in enumerate(zip(costs, sizes, strict=True)):
        assert c.fits(k, first=j == 0, last=j == n - 1)
        assert plan.predicted_stage_s[j] == c.stage_s(k, first=j == 0, last=j == n - 1)
    # Stage times are computed by the same expression on both sides: the max is exact.
    assert plan.bottleneck_s == expected[0]
    # The sums add the same stage times in the same order; tolerance for safety only.
    assert sum(plan.predicted_stage_s) == pytest.approx(expected[1], rel=1e-12)


def test_faster_device_gets_more_layers() -> None:
    # 0.4x speed -> 2.5x time per layer: 28 layers split 20 : 8 balances at 20 s each.
    costs = [StageCosts(name="nuc", layer_s=1.0), StageCosts(name="pi", layer_s=2.5)]
    plan = plan_pipeline(28, costs)
    assert plan.layer_ranges == ((0, 20), (20, 28))
    assert plan.predicted_stage_s == (20.0, 20.0)
    assert plan.num_microbatches == 4  # default: 2 x stages


def test_embedding_head_and_send_shift_layers() -> None:
    costs = [
        StageCosts(name="a", layer_s=1.0, embed_s=3.0, send_s=1.0),
        StageCosts(name="b", layer_s=1.0, head_s=2.0),
    ]
    plan = plan_pipeline(10, costs)
    # a: 3 + 1 + k, b: 2 + (10 - k): balanced at k = 4 (8 s each).
    assert plan.layer_ranges == ((0, 4), (4, 10))
    assert plan.bottleneck_s == 8.0
    # GPipe/1F1B estimate: fill + (m - 1) bottleneck intervals.
    assert plan.predicted_step_s == 16.0 + 3 * 8.0


def test_memory_caps_layers() -> None:
    costs = [
        StageCosts(name="fast", layer_s=1.0, layer_bytes=10, memory_bytes=35),
        StageCosts(name="slow", layer_s=3.0, layer_bytes=10),
    ]
    plan = plan_pipeline(12, costs)
    assert plan.layer_ranges == ((0, 3), (3, 12))  # speed alone would give 9 : 3


def test_errors() -> None:
    with pytest.raises(UserError, match="3 layers cannot fill 4 stages"):
        plan_pipeline(3, [StageCosts(name=f"d{j}", layer_s=1.0) for j in range(4)])
    tiny_mem = StageCosts(name="pi", layer_s=1.0, layer_bytes=10, memory_bytes=5)
    with pytest.raises(UserError, match=r"device 'pi' has .* one layer needs"):
        plan_pipeline(4, [StageCosts(name="nuc", layer_s=1.0), tiny_mem])
    small_mem = [
        StageCosts(name=f"d{j}", layer_s=1.0, layer_bytes=10, memory_bytes=20) for j in range(2)
    ]
    with pytest.raises(UserError, match="cannot hold all 5 layers"):
        plan_pipeline(5, small_mem)
    with pytest.raises(UserError, match="negative or not finite"):
        plan_pipeline(4, [StageCosts(name="x", layer_s=math.nan)])


def test_even_pipeline() -> None:
    plan = even_pipeline(10, ["a", "b", "c"])
    assert plan.layer_ranges == ((0, 4), (4, 7), (7, 10))
    assert plan.num_microbatches == 6 and plan.predicted_stage_s == ()
    assert math.isnan(plan.predicted_step_s)
    assert [plan.stage_of(k) for k in (0, 3, 4, 9)] == [0, 0, 1, 2]
    with pytest.raises(UserError, match="use at most 2 devices"):
        even_pipeline(2, ["a", "b", "c"])


def test_json_round_trip_table_and_validation() -> None:
    plan = plan_pipeline(
        7, [StageCosts(name="a", layer_s=1.0), StageCosts(name="b", layer_s=2.0)], 8
    )
    back = PipelinePlan.from_json(plan.to_json())
    assert back == plan
    table = plan.table()
    assert "a" in table and "0-4 (5)" in table
    with pytest.raises(UserError, match="malformed"):
        PipelinePlan.from_json('{"devices": ["a"]}')
    with pytest.raises(UserError, match="invalid JSON"):
        PipelinePlan.from_json("{")
    with pytest.raises(ValueError, match="contiguous"):
        PipelinePlan(("a", "b"), ((0, 3), (4, 6)), (), 2)
    with pytest.raises(ValueError, match="contiguous"):
        PipelinePlan(("a", "b"), ((0, 3), (3, 3)), (), 2)
