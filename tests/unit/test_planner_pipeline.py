"""The PP stage planner against brute force over all contiguous partitions."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xronos.config import small
from xronos.errors import UserError
from xronos.planner import PipelinePlan, StageCosts, even_pipeline, plan_pipeline
from xronos.planner.comm import LinkModel
from xronos.planner.pipesearch import (
    StageDevice,
    device_stages,
    lower_bound,
    schedule_s,
    search_pipeline,
    stage_costs_for,
)
from xronos.planner.profile import CostCurve, DeviceProfile


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


# -- explicit stage order, exact step, the search over orders and micro-batches -----------
def test_stage_ranks_round_trip_and_old_plans_load() -> None:
    plan = PipelinePlan(("slow", "fast"), ((0, 3), (3, 8)), (1.0, 2.0), 4, ranks=(1, 0))
    assert plan.stage_ranks == (1, 0)
    assert PipelinePlan.from_json(plan.to_json()) == plan
    old = {k: v for k, v in plan.to_dict().items() if k != "ranks"}
    assert PipelinePlan.from_dict(old).stage_ranks == (0, 1)
    with pytest.raises(ValueError, match="distinct"):
        PipelinePlan(("a", "b"), ((0, 1), (1, 2)), (), 2, ranks=(0, 0))


def brute_step(num_layers: int, costs: list[StageCosts], m: int) -> float:
    """Least ``Σ t + (m − 1) max t`` over every contiguous partition that fits."""
    n, best = len(costs), math.inf
    for sizes in partitions(num_layers, n):
        flags = [dict(first=j == 0, last=j == n - 1) for j in range(n)]
        if not all(c.fits(k, **f) for c, k, f in zip(costs, sizes, flags, strict=True)):
            continue
        times = [c.stage_s(k, **f) for c, k, f in zip(costs, sizes, flags, strict=True)]
        best = min(best, sum(times) + (m - 1) * max(times))
    return best


@settings(max_examples=150, deadline=None)
@given(pipeline_cases(), st.integers(1, 6))
def test_exact_step_matches_brute_force(case: tuple[int, list[StageCosts]], m: int) -> None:
    num_layers, costs = case
    want = brute_step(num_layers, costs, m)
    if want == math.inf:
        with pytest.raises(UserError):
            plan_pipeline(num_layers, costs, m, exact_step=True)
        return
    plan = plan_pipeline(num_layers, costs, m, exact_step=True)
    assert plan.predicted_step_s == pytest.approx(want, rel=1e-9)  # float sums, same terms
    assert plan.predicted_step_s <= plan_pipeline(num_layers, costs, m).predicted_step_s + 1e-9


def stage_device(name: str, rank: int, speed: float, *, head: float = 1.0) -> StageDevice:
    costs = StageCosts(name=name, layer_s=1.0 / speed, head_s=head / speed)
    return StageDevice(costs, LinkModel(1e-3, 1e6), (rank,))


def test_search_puts_the_head_on_the_fast_device_of_a_one_to_point_four_pair() -> None:
    # Rank 0 is the slow one (0.4), rank 1 the fast one; a heavy head (4 layers' worth).
    devices = [stage_device("slow", 0, 0.4, head=4.0), stage_device("fast", 1, 1.0, head=4.0)]
    fixed = plan_pipeline(
        12, stage_costs_for(devices, fraction=1 / 4, act_bytes=1e4), 4, exact_step=True
    )
    best = search_pipeline(12, devices, batch_size=4, grad_accum=1, act_bytes=1e4)
    assert best is not None and fixed.devices[-1] == "fast"
    assert best.devices[-1] == "fast" and best.stage_ranks[-1] == 1
    flipped = search_pipeline(12, devices[::-1], batch_size=4, grad_accum=1, act_bytes=1e4)
    assert flipped is not None and flipped.devices[-1] == "fast"
    # In rank order fast -> slow, the head would sit on the slow device: the search beats it.
    rank_order = plan_pipeline(
        12, stage_costs_for(devices[::-1], fraction=1 / 4, act_bytes=1e4), 4, exact_step=True
    )
    assert rank_order.devices[-1] == "slow"
    assert flipped.predicted_step_s < rank_order.predicted_step_s


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.floats(0.2, 2.0), min_size=2, max_size=3),
    st.lists(st.floats(0.0, 3.0), min_size=3, max_size=3),
    st.integers(3, 7),
    st.integers(1, 3),
    st.integers(1, 2),
)
def test_search_matches_brute_force_over_orders_and_microbatches(
    speeds: list[float], heads: list[float], num_layers: int, batch: int, accum: int
) -> None:
    # Every order and micro-batch count, each with its least closed-form split, timed by
    # the schedule: the search (which prunes with lower_bound) must find the least of them.
    devices = [
        stage_device(f"d{i}", i, s, head=h)
        for i, (s, h) in enumerate(zip(speeds, heads[: len(speeds)], strict=True))
    ]
    want = math.inf
    for size in range(2, len(devices) + 1):
        for order in itertools.permutations(devices, size):
            if size > num_layers:
                continue
            for k in range(1, batch + 1):
                costs = stage_costs_for(list(order), fraction=1 / k, act_bytes=1e5)
                plan = plan_pipeline(num_layers, costs, accum * k, exact_step=True)
                step = schedule_s(plan, list(order), batch, accum, act_bytes=1e5)
                assert step >= lower_bound(num_layers, costs, accum * k) - 1e-9
                want = min(want, step)
    got = search_pipeline(num_layers, devices, batch_size=batch, grad_accum=accum, act_bytes=1e5)
    assert got is not None
    assert got.predicted_step_s == pytest.approx(want, rel=1e-9)  # same terms, other order
    assert got.num_microbatches % accum == 0 and len(set(got.stage_ranks)) == got.num_stages


def test_search_lets_a_device_hold_no_stage() -> None:
    # A crawling device on the path only adds a stage and its sends: it is left out.
    devices = [stage_device("a", 0, 1.0), stage_device("b", 1, 1.0), stage_device("c", 2, 0.01)]
    best = search_pipeline(8, devices, batch_size=4, grad_accum=1, act_bytes=1e4)
    assert best is not None and 2 not in best.stage_ranks


@settings(max_examples=150, deadline=None)
@given(pipeline_cases(), st.integers(1, 6))
def test_the_search_bound_never_exceeds_the_best_step(
    case: tuple[int, list[StageCosts]], m: int
) -> None:
    num_layers, costs = case
    assert lower_bound(num_layers, costs, m) <= brute_step(num_layers, costs, m) + 1e-9


def test_cutting_the_batch_costs_each_micro_batch_its_split_share() -> None:
    # A layer of 1 s for the whole batch, of which 0.3 s is paid per pass however small:
    # k micro-batches cost 1/k of the batch plus (1 - 1/k) of that 0.3 s each.
    d = StageDevice(
        StageCosts(
            name="a",
            layer_s=1.0,
            head_s=2.0,
            embed_s=0.4,
            layer_split_s=0.3,
            head_split_s=0.5,
            embed_split_s=0.1,
        ),
        None,
        (0,),
    )
    for k in (1, 2, 4):
        (c,) = stage_costs_for([d], fraction=1 / k, act_bytes=0.0)
        assert c.layer_s == pytest.approx(1.0 / k + 0.3 * (1 - 1 / k))
        assert c.head_s == pytest.approx(2.0 / k + 0.5 * (1 - 1 / k))
        assert c.embed_s == pytest.approx(0.4 / k + 0.1 * (1 - 1 / k))
        # all k micro-batches: the whole batch plus (k - 1) extra passes
        assert k * c.layer_s == pytest.approx(1.0 + 0.3 * (k - 1))


def test_the_first_stage_pays_the_profiled_embedding() -> None:
    # A tied model's whole embedding runs on the first stage only: a device whose embedding
    # costs a lot is kept off the first stage, and the prediction counts it.
    cheap, dear = stage_device("a", 0, 1.0), stage_device("b", 1, 1.0)
    dear = replace(dear, costs=replace(dear.costs, embed_s=5.0))
    best = search_pipeline(8, [cheap, dear], batch_size=1, grad_accum=1, act_bytes=1e4)
    assert best is not None and best.stage_ranks[0] == 0
    # One micro-batch: the step is all the stages' work in sequence, embedding included.
    dear_first = plan_pipeline(8, stage_costs_for([dear, cheap], fraction=1.0, act_bytes=0.0), 1)
    plain = plan_pipeline(8, stage_costs_for([cheap, cheap], fraction=1.0, act_bytes=0.0), 1)
    assert dear_first.predicted_step_s == pytest.approx(plain.predicted_step_s + 5.0)


def test_costly_passes_make_the_search_cut_the_batch_less() -> None:
    free = [stage_device("a", 0, 1.0), stage_device("b", 1, 1.0)]
    costly = [replace(d, costs=replace(d.costs, layer_split_s=0.9, head_split_s=0.9)) for d in free]
    cheap = search_pipeline(8, free, batch_size=8, grad_accum=1, act_bytes=1e4)
    dear = search_pipeline(8, costly, batch_size=8, grad_accum=1, act_bytes=1e4)
    assert cheap is not None and dear is not None
    assert dear.num_microbatches < cheap.num_microbatches


def test_the_tied_rows_exchange_is_paid_once_per_step_over_the_end_stages_link() -> None:
    devices = [stage_device("a", 0, 1.0), stage_device("b", 1, 1.0)]
    plain = search_pipeline(8, devices, batch_size=4, grad_accum=1, act_bytes=1e4)
    tied = search_pipeline(8, devices, batch_size=4, grad_accum=1, act_bytes=1e4, tied_bytes=2e6)
    assert plain is not None and tied is not None
    # two messages of 2 MB, one after the other (the step's rows there, their gradient
    # back), each over two links of 1 ms and 1 MB/s: 2 × (2 ms + 2 s)
    swap = 2 * (LinkModel(1e-3, 1e6).p2p_s(0.0) * 2 + 2e6 / 1e6)
    assert tied.step_extra_s == pytest.approx(swap)
    assert tied.predicted_step_s == pytest.approx(plain.predicted_step_s + swap)


def test_a_profiled_embedding_reaches_the_stage_costs() -> None:
    cfg = small()
    p = DeviceProfile(
        name="a",
        segments={s: CostCurve(0.0, 1e-3) for s in ("attn", "mlp", "vocab")},
        replicated_s=0.01,
        embed_s=0.7,
        embed_split_s=0.2,
    )
    (d,) = device_stages([p], cfg)
    assert (d.costs.embed_s, d.costs.embed_split_s) == (0.7, 0.2)


def test_the_update_leaves_the_micro_batches_and_the_slowest_stage_pays_it_once() -> None:
    cfg = small()
    profiles = [
        DeviceProfile(
            name=n,
            segments={s: CostCurve(0.0, 1e-3 / speed) for s in ("attn", "mlp", "vocab")},
            replicated_s=0.01 / speed,
            embed_s=0.3 / speed,
            update_s={"layer": 0.02 / speed, "embed": 0.05 / speed, "head": 0.06 / speed},
        )
        for n, speed in (("fast", 1.0), ("slow", 0.4))
    ]
    stages = device_stages(profiles, cfg)
    plain = device_stages([replace(p, update_s={}) for p in profiles], cfg)
    for d, was, p in zip(stages, plain, profiles, strict=True):
        # every micro-batch term loses exactly the profiled update; nothing else moves
        assert d.costs.layer_s == pytest.approx(was.costs.layer_s - p.update_s["layer"])
        assert d.costs.embed_s == pytest.approx(was.costs.embed_s - p.update_s["embed"])
        assert d.costs.head_s == pytest.approx(was.costs.head_s - p.update_s["head"])
    plan = search_pipeline(cfg.num_layers, stages, batch_size=4, grad_accum=1, act_bytes=0.0)
    assert plan is not None
    n = plan.num_stages
    per_stage = [
        stages[r].costs.update_s(b - a, first=j == 0, last=j == n - 1)
        for j, (r, (a, b)) in enumerate(zip(plan.stage_ranks, plan.layer_ranges, strict=True))
    ]
    assert plan.update_s == pytest.approx(max(per_stage)) and plan.update_s > 0
    assert plan.schedule_s > 0
    assert plan.predicted_step_s == pytest.approx(plan.schedule_s + plan.update_s)
    assert PipelinePlan.from_dict(plan.to_dict()) == plan


def test_an_update_larger_than_its_timed_segment_is_capped_at_it() -> None:
    # measured apart, an update can exceed a tiny segment's time by noise: a cost stays >= 0
    p = DeviceProfile(
        name="a",
        segments={s: CostCurve(0.0, 1e-6) for s in ("attn", "mlp", "vocab")},
        replicated_s=0.0,
        update_s={"layer": 1.0, "embed": 1.0, "head": 1.0},
    )
    (d,) = device_stages([p], small())
    assert min(d.costs.layer_s, d.costs.head_s, d.costs.embed_s) == 0.0
    assert d.costs.embed_update_s == 0.0  # no embedding time was profiled, none to move


def test_a_trained_tied_matrix_is_updated_by_the_last_stage_only() -> None:
    # The first stage reads a tied matrix's rows and sends their gradient back; the last
    # stage (whose head update includes the matrix) updates it. The first stage's profiled
    # embedding update leaves its micro-batches and is not paid at the step's end.
    base = DeviceProfile(
        name="a",
        segments={s: CostCurve(0.0, 1e-3) for s in ("attn", "mlp", "vocab")},
        replicated_s=0.0,
        embed_s=0.5,
        update_s={"layer": 0.0, "embed": 0.2, "head": 0.3},
    )
    (untied,) = device_stages([base], small())
    (tied,) = device_stages([replace(base, tied_grad_bytes=1)], small())
    assert untied.costs.embed_update_s == pytest.approx(0.2)
    assert tied.costs.embed_update_s == 0.0
    assert tied.costs.embed_s == pytest.approx(0.3)  # the update left the micro-batches
    assert tied.costs.head_update_s == untied.costs.head_update_s > 0  # the matrix is in it
