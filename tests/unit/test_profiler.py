"""Profiler: the line fit on synthetic timings, and measurements that grow with the units.

No test here times anything for real: the fit is fed made-up points, and the measuring
code runs with its timer replaced by a deterministic one (a fake clock, or a count of the
floating-point operations of the timed step).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from xronos.config import tiny
from xronos.metrics.rss import PeakRSS
from xronos.model.lora import LoRAConfig
from xronos.planner.plan import segment_units
from xronos.planner.profile import CostCurve
from xronos.profiler import measure, whole
from xronos.profiler.bytes import base_bytes, memory_scale, unit_bytes, whole_need
from xronos.profiler.line import MAX_INTERCEPT, fit_line, line_of, plausible, rising, unit_points
from xronos.profiler.measure import SegmentTimes, Shape, measure_segments
from xronos.profiler.whole import WholeStep

SHAPE = Shape(cfg=tiny(), batch_size=2, seq_len=16, mlp_chunk=8, vocab_chunk=32)


# -- the fit -----------------------------------------------------------------------------
def test_fit_of_hand_computed_points() -> None:
    # t = 0.3 + 0.2·u at u = 2, 4, 8. Float rounding of these short sums only: a few ulps
    # of the largest time (1.9).
    curve = fit_line([(2, 0.7), (4, 1.1), (8, 1.9)])
    assert curve.a == pytest.approx(0.3, abs=1e-14)
    assert curve.b == pytest.approx(0.2, abs=1e-14)


@given(
    a=st.floats(0, 1),
    b=st.floats(1e-4, 1),
    units=st.lists(st.integers(1, 64), min_size=2, max_size=5, unique=True),
)
@settings(max_examples=100, deadline=None)
def test_fit_recovers_an_exact_line(a: float, b: float, units: list[int]) -> None:
    # Any fit that did not use the points (a constant, one point only, the wrong axis)
    # misses some (a, b) drawn here.
    curve = fit_line([(u, a + b * u) for u in units])
    # least squares on exact points: only float rounding, relative to the largest time
    scale = a + b * max(units)
    assert curve.a == pytest.approx(a, abs=1e-9 * scale + 1e-12)
    assert curve.b == pytest.approx(b, rel=1e-6)


@pytest.mark.parametrize("seed", range(5))
def test_fit_of_noisy_points_stays_within_the_noise_bound(seed: int) -> None:
    rng = random.Random(seed)
    a, b, eps = 0.05, 0.01, 0.002  # 2 ms of noise on a 50 ms + 10 ms/unit segment
    units = [1, 2, 4, 8, 16]
    curve = fit_line([(u, a + b * u + rng.uniform(-eps, eps)) for u in units])
    # Least squares is linear in the noise ε: Δb = Σ(u−ū)ε_u / Σ(u−ū)² and
    # Δa = mean(ε) − Δb·ū. With |ε| ≤ eps this bounds the error for *every* draw, so the
    # tolerances are exact worst cases, not statistical ones (+1e-12 for float rounding).
    mu = sum(units) / len(units)
    var = sum((u - mu) ** 2 for u in units)
    db = eps * sum(abs(u - mu) for u in units) / var
    da = eps + db * mu
    assert abs(curve.b - b) <= db + 1e-12
    assert abs(curve.a - a) <= da + 1e-12
    # and the bound is tight enough to mean something: well under the true values
    assert db < b / 10 and da < a / 2


def test_decreasing_points_clamp_to_a_flat_line_through_their_mean() -> None:
    # Times that fall with the units are noise, not physics: the slope is floored at a
    # tiny positive value and the intercept becomes the mean time.
    pts = [(1, 0.5), (2, 0.4), (4, 0.1)]
    curve = fit_line(pts)
    assert curve.b == 1e-12
    mean_t, mean_u = 1.0 / 3, 7.0 / 3
    # a = mean_t − 1e-12·mean_u: the floor's share is far below float rounding of mean_t.
    assert curve.a == pytest.approx(mean_t, abs=1e-11)
    assert curve.a == pytest.approx(mean_t - 1e-12 * mean_u, abs=1e-15)


def test_negative_intercept_is_clamped_and_the_slope_kept() -> None:
    # The least-squares line of these points is t = −0.3 + 0.2·u: no time can be negative
    # at u = 0+, so a is clamped to 0 and the fitted slope is kept (not refitted).
    curve = fit_line([(2, 0.1), (4, 0.5), (6, 0.9)])
    assert curve.a == 0.0
    assert curve.b == pytest.approx(0.2, abs=1e-14)  # rounding of a three-term sum


def test_degenerate_inputs() -> None:
    assert fit_line([(4, 2.0)]) == CostCurve(0.0, 0.5)  # one point: through 0
    # All points at one unit count (no spread): mean time over mean units, through 0.
    assert fit_line([(3, 1.0), (3, 2.0)]) == CostCurve(0.0, 0.5)


def test_unit_points() -> None:
    assert unit_points(16) == [4, 8]
    assert unit_points(257) == [64, 128]
    assert unit_points(3) == [1]  # 3 // 4 and 3 // 2 both give 1 unit
    assert unit_points(1) == [1]
    for total in (1, 2, 3, 16, 257):
        pts = unit_points(total)
        assert pts == sorted(set(pts)) and all(1 <= p <= total for p in pts)


def test_points_that_do_not_rise_are_not_a_line_of_the_work() -> None:
    assert rising([(4, 0.02), (8, 0.035)]) and rising([(1, 0.5)])
    assert not rising([(4, 0.035), (8, 0.035)]) and not rising([(8, 0.02), (4, 0.035)])
    # flat or falling: through the origin and the point of the most units, never a flat
    # line whose every unit is free (the fit's floor)
    assert line_of([(4, 0.035), (8, 0.035)]) == CostCurve(0.0, 0.035 / 8)
    assert line_of([(8, 0.02), (4, 0.03)]) == CostCurve(0.0, 0.02 / 8)
    assert line_of([(4, 0.02), (8, 0.035)]) == fit_line([(4, 0.02), (8, 0.035)])


def test_a_line_is_plausible_when_its_intercept_is_a_small_part_of_its_points() -> None:
    # Intercept a = 2·t(4) − t(8) for points at 4 and 8 units.
    assert plausible([(4, 0.020), (8, 0.036)])  # a = 4 ms, a fifth of t(4)
    edge = 0.020 * (2 - MAX_INTERCEPT)  # a = MAX_INTERCEPT·t(4) exactly
    assert plausible([(4, 0.020), (8, edge + 1e-9)])
    assert not plausible([(4, 0.020), (8, edge - 1e-9)])
    assert not plausible([(4, 0.035), (8, 0.035)]) and not plausible([])
    assert plausible([(1, 0.5)])  # one unit count: a line through the origin


# -- the timer ---------------------------------------------------------------------------
class FakeClock:
    """``perf_counter`` that advances only when the timed function says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_best_time_is_the_minimum_after_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(measure, "time", clock)
    durations = iter([100.0, 5.0, 3.0, 4.0])  # the first run is the warm-up
    calls = []

    def fn() -> None:
        calls.append(clock.now)
        clock.now += next(durations)

    assert measure.best_time(fn, repeats=3, warmup=1) == 3.0
    assert len(calls) == 4  # the warm-up ran, and was not counted (it took 100)


def test_the_points_of_a_line_are_timed_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two points, three rounds; the host is slow in the first round (both points alike).
    # Timed in turn, each point's minimum comes from the same calm rounds.
    clock = FakeClock()
    monkeypatch.setattr(measure, "time", clock)
    order: list[str] = []
    durations = {"a": iter([9.0, 1.0, 1.5]), "b": iter([18.0, 2.5, 2.0])}

    def run(name: str) -> Callable[[], None]:
        def fn() -> None:
            order.append(name)
            clock.now += next(durations[name])

        return fn

    assert measure.best_times([run("a"), run("b")], repeats=3) == [1.0, 2.0]
    assert order == ["a", "b"] * 3  # interleaved, not a's repeats then b's


def approx(x: float) -> object:
    return pytest.approx(x, abs=1e-12)


def _timed_points(
    monkeypatch: pytest.MonkeyPatch, durations: dict[int, list[float]], cut: list[float]
) -> tuple[list[tuple[int, float]], float, dict[int, int]]:
    """``_line_and_cut`` over two unit counts whose steps take the made-up ``durations``
    in turn (the first of each the warm-up), the cut's steps ``cut``; how often each ran."""
    clock = FakeClock()
    monkeypatch.setattr(measure, "time", clock)
    left = {u: iter(ts) for u, ts in durations.items()}
    left[0] = iter(cut)
    runs = dict.fromkeys(left, 0)

    def step_of(u: int, passes: int = 1) -> Callable[[], None]:
        key = 0 if passes > 1 else u

        def fn() -> None:
            runs[key] += 1
            clock.now += next(left[key])

        return fn

    pts, cut_s = measure._line_and_cut(step_of, sorted(durations), 4, repeats=2)
    return pts, cut_s, runs


def test_a_line_is_timed_after_a_warm_up_and_once_when_its_points_rise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The warm-up's 0.9 s would set the smaller point if it were timed.
    pts, cut, runs = _timed_points(
        monkeypatch, {4: [0.9, 0.021, 0.020], 8: [0.9, 0.038, 0.036]}, [0.9, 0.05, 0.06]
    )
    # a clock that adds and subtracts its sums: rounding of a few ulps of ~3 s
    assert pts == [(4, approx(0.020)), (8, approx(0.036))] and cut == approx(0.05)
    assert runs == {4: 3, 8: 3, 0: 3}  # a warm-up and two rounds, no more


def test_points_stretched_by_the_host_are_timed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # The smaller point's two rounds were both stretched (a flat line: 35 ms at 4 and at 8
    # units); two more rounds find it at 19 ms, and each point keeps its minimum.
    pts, cut, runs = _timed_points(
        monkeypatch,
        {4: [0.9, 0.035, 0.036, 0.019, 0.030], 8: [0.9, 0.035, 0.037, 0.036, 0.034]},
        [0.9, 0.05, 0.06, 0.04, 0.07],
    )
    assert pts == [(4, approx(0.019)), (8, approx(0.034))] and cut == approx(0.04)
    assert runs == {4: 5, 8: 5, 0: 5}  # stopped once plausible: one retime of 2 rounds
    # still flat after every retime: all of them ran, and the line is the proportional one
    flat = [0.9, *[0.035] * 2 * (1 + measure.RETIMES)]
    pts, _, runs = _timed_points(monkeypatch, {4: flat, 8: flat}, flat)
    assert runs[4] == 1 + 2 * (1 + measure.RETIMES)
    assert line_of(pts) == CostCurve(0.0, approx(0.035 / 8))


def _steps_taking(
    monkeypatch: pytest.MonkeyPatch, durations: list[float], seen: list[int] | None = None
) -> Iterator[float]:
    """The training loop's real step runs; the clock advances by the next made-up duration
    (and ``seen`` gets each step's number of micro-batches)."""
    clock = FakeClock()
    monkeypatch.setattr(measure, "time", clock)  # run_times' clock
    left = iter(durations)
    real_step = whole.Trainer.step

    def step(self: whole.Trainer, micro: list[object], *args: object) -> object:
        out = real_step(self, micro, *args)  # type: ignore[arg-type]
        if seen is not None:
            seen.append(len(micro))
        clock.now += next(left)
        return out

    monkeypatch.setattr(whole.Trainer, "step", step)
    return left


WARM = [50.0, 40.0, 30.0]  # the warm-up steps: slow (allocator, AdamW's moments), not counted


def test_the_whole_step_is_the_median_of_its_timed_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three timed steps that agree within 10 %: their median, and no more steps are run.
    assert len(WARM) == whole.SLOW_FIRST_STEPS and whole.WHOLE_STEP_REPEATS == 3
    left = _steps_taking(monkeypatch, [*WARM, 3.0, 3.2, 3.1, 99.0])
    got = whole.time_whole_step(SHAPE)
    assert got.seconds == pytest.approx(3.1) and got.per_pass_s is None  # a float clock
    assert next(left) == 99.0  # the fourth was never run


def test_a_busy_moment_over_two_timed_steps_is_waited_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # A busy moment that spans two of the three (9.0, 9.2) would be the median of three;
    # the profiler times more until three agree and takes theirs.
    left = _steps_taking(monkeypatch, [*WARM, 9.0, 9.2, 3.0, 3.1, 3.05, 99.0])
    got = whole.time_whole_step(SHAPE)
    assert got.seconds == pytest.approx(3.05) and got.per_pass_s is None  # a float clock
    assert next(left) == 99.0


def test_a_host_that_never_settles_is_timed_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    # No three agree within WHOLE_STEP_MAX_REPEATS: the median of all of them (the host the
    # run will meet), and the profiler stops there.
    timed = [2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]
    assert len(timed) == whole.WHOLE_STEP_MAX_REPEATS
    left = _steps_taking(monkeypatch, [*WARM, *timed, 99.0])
    got = whole.time_whole_step(SHAPE)
    assert got.seconds == pytest.approx(16.0) and got.per_pass_s is None  # a float clock
    assert next(left) == 99.0


def test_the_fastest_steps_agree_within_ten_percent() -> None:
    assert whole.agreeing([3.0, 9.0, 3.2, 3.1]) == [3.0, 3.1, 3.2]
    assert whole.agreeing([3.0, 3.31, 9.0]) is None  # 3.31 / 3.0 - 1 > 10 %
    assert whole.agreeing([3.0, 3.2]) is None  # too few


def test_a_cut_step_is_timed_right_after_each_whole_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each cut step is paired with the whole step before it. SHAPE's batch of 2 sequences is
    # cut into 2 however many passes are asked: one extra pass, cut - whole.
    seen: list[int] = []
    _steps_taking(monkeypatch, [*WARM, 3.0, 3.3, 3.1, 3.3, 2.9, 3.5], seen)
    got = whole.time_whole_step(SHAPE, passes=4)
    assert SHAPE.batch_size == 2
    assert seen == [1, 1, 2, 1, 2, 1, 2, 1, 2]  # warm-up: whole, whole, cut; then pairs
    assert got.seconds == pytest.approx(3.0)
    assert got.per_pass_s == pytest.approx(0.3)  # the pairs' 0.3, 0.2, 0.6


def test_what_a_micro_batch_adds_is_shared_as_the_parts_take_time() -> None:
    totals = {"attn": 4, "mlp": 8, "vocab": 16}
    curves = {"attn": CostCurve(0, 0.05), "mlp": CostCurve(0, 0.05), "vocab": CostCurve(0, 0.025)}
    # the parts' own cuts (one layer's came out at nothing) are replaced, not scaled: times
    # 0.2 : 0.4 : 0.4 and the embedding's 0.2 share the whole model's 120 ms a micro-batch
    parts = SegmentTimes(curves, 0.1, {"attn": 0.0, "mlp": 0.0, "vocab": 0.01}, embed_s=0.2)
    got = whole.split_to_whole(parts, 0.12, totals)
    assert got.split_s == pytest.approx({"attn": 0.02, "mlp": 0.04, "vocab": 0.04})
    assert got.embed_split_s == pytest.approx(0.02) and got.curves == parts.curves


def _time_vocab(units: int, shape: Shape, repeats: int) -> float:
    return measure.best_time(measure._vocab_step(units, shape), repeats=repeats)


def flops_of(fn: Callable[[], None], repeats: int = 2, warmup: int = 0) -> float:
    """A deterministic stand-in for ``best_time``: the FLOPs of one run of ``fn``."""
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return float(counter.get_total_flops())


@pytest.mark.parametrize("lora", [None, LoRAConfig(r=4)], ids=["full", "lora"])
@pytest.mark.parametrize("seg", ["attn", "mlp", "vocab"])
def test_measured_work_grows_linearly_with_the_units(
    monkeypatch: pytest.MonkeyPatch, seg: str, lora: LoRAConfig | None
) -> None:
    # The real shard of u units is built and run; only the clock is replaced by a count of
    # its matmul FLOPs (forward + backward). Every matmul is either fixed (LoRA's
    # replicated factor) or linear in the units, so the counts are exactly a line: a
    # profiler that built the same shard whatever u was would fail here.
    # Attention is linear in whole KV groups (q_per_kv query heads with their K/V).
    monkeypatch.setattr(measure, "best_time", flops_of)
    shape = replace(SHAPE, lora=lora)
    g = shape.cfg.q_per_kv if seg == "attn" else 1
    if seg == "vocab":
        points = [_time_vocab(u, shape, repeats=1) for u in (1, 2, 3, 4)]
    else:
        points = [measure.time_layer_segment(seg, g * u, shape, 1) for u in (1, 2, 3, 4)]
    steps = [y - x for x, y in itertools.pairwise(points)]
    assert steps[0] > 0 and steps == [steps[0]] * 3, points  # integer counts: exact


def test_attention_units_pay_for_the_kv_groups_they_touch(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first query head of a new KV group brings that group's K/V projections; the
    # next head of the same group only its own q/o columns. A profile that built K/V per
    # query head (or none) would see equal steps.
    monkeypatch.setattr(measure, "best_time", flops_of)
    q = SHAPE.cfg.q_per_kv
    assert q >= 2
    t = {u: measure.time_layer_segment("attn", u, SHAPE, 1) for u in (q, q + 1, q + 2)}
    assert t[q + 1] - t[q] > t[q + 2] - t[q + 1] > 0, t


@pytest.mark.parametrize("lora", [None, LoRAConfig(r=4)], ids=["full", "lora"])
def test_measure_segments_fits_what_it_measured(
    monkeypatch: pytest.MonkeyPatch, lora: LoRAConfig | None
) -> None:
    monkeypatch.setattr(measure, "best_time", flops_of)
    shape = replace(SHAPE, lora=lora)
    curves = measure_segments(shape, repeats=1).curves
    assert set(curves) == {"attn", "mlp", "vocab"}
    totals = segment_units(shape.cfg, shape.mlp_chunk, shape.vocab_chunk)
    layers, q = shape.cfg.num_layers, shape.cfg.q_per_kv
    for seg, curve in curves.items():
        # The line through two points of each segment's (exactly linear) work, scaled to
        # all layers for attn and mlp; the fit must reproduce it at every unit count
        # (attention's at whole KV groups, where it is linear).
        one = {
            u: _time_vocab(u, shape, 1)
            if seg == "vocab"
            else measure.time_layer_segment(seg, u, shape, 1) * layers
            for u in ((q, 2 * q, totals[seg]) if seg == "attn" else (1, 2, totals[seg]))
        }
        for u, want in one.items():
            # fit_line divides and subtracts counts of up to ~1e9: a few ulps of that
            assert curve(u) == pytest.approx(want, rel=1e-9), (seg, u)
        assert curve(totals[seg]) > curve(1) > curve(0) == 0.0


def test_split_cost_is_what_one_more_pass_adds_scaled_to_the_whole_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A clock that charges every forward pass a fixed PASS on top of its FLOPs: cutting
    # the batch into m parts leaves the FLOPs alone and adds m - 1 PASSes, so each
    # micro-batch beyond the first costs one PASS, measured at the larger unit point and
    # scaled to every unit of every layer — whether the batch is cut in two or in four.
    PASS = 1e6
    passes = [0]
    real_out = measure.module_out

    def counting_out(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        passes[0] += 1
        return real_out(module, x)

    def clock(fn: Callable[[], None], repeats: int = 2, warmup: int = 0) -> float:
        passes[0] = 0
        flops = flops_of(fn)
        return flops + PASS * passes[0]

    monkeypatch.setattr(measure, "module_out", counting_out)
    monkeypatch.setattr(measure, "best_time", clock)
    times = measure_segments(replace(SHAPE, batch_size=measure.SPLIT_PASSES), repeats=1)
    totals = segment_units(SHAPE.cfg, SHAPE.mlp_chunk, SHAPE.vocab_chunk)
    layers = SHAPE.cfg.num_layers
    for seg in ("attn", "mlp", "vocab"):
        step = SHAPE.cfg.q_per_kv if seg == "attn" else 1
        u = unit_points(totals[seg], step)[-1]
        scale = totals[seg] / u * (1 if seg == "vocab" else layers)
        # FlopCounter counts are exact integers; only the float scaling rounds
        assert times.split_s[seg] == pytest.approx(PASS * scale, rel=1e-9), seg
    two = measure_segments(SHAPE, repeats=1)  # two sequences: cut in two
    assert SHAPE.batch_size == 2 and two.split_s == pytest.approx(times.split_s, rel=1e-9)
    one = measure_segments(replace(SHAPE, batch_size=1), repeats=1)
    assert one.split_s == {"attn": 0.0, "mlp": 0.0, "vocab": 0.0}  # one sequence: no cut


def test_segments_are_scaled_to_a_whole_real_step(monkeypatch: pytest.MonkeyPatch) -> None:
    import xronos.profiler.run as run
    from xronos.comm.mappings import TPGroup
    from xronos.planner.profile import CostCurve
    from xronos.profiler.measure import SegmentTimes

    parts = SegmentTimes(
        {"attn": CostCurve(0.01, 0.002), "mlp": CostCurve(0.0, 0.001), "vocab": CostCurve(0, 1e-4)},
        0.05,
        {"attn": 0.01, "mlp": 0.02, "vocab": 0.0},
    )
    totals = segment_units(SHAPE.cfg, SHAPE.mlp_chunk, SHAPE.vocab_chunk)
    parts_sum = parts.replicated_s + sum(c(totals[s]) for s, c in parts.curves.items())
    # a real step 1.5 times the parts' sum: every cost grows by 1.5
    monkeypatch.setattr(
        run, "time_whole_step", lambda shape, passes: WholeStep(1.5 * parts_sum, None)
    )
    got = run.scaled(parts, SHAPE, TPGroup(), None)
    assert got.scale == pytest.approx(1.5)
    assert got.replicated_s == pytest.approx(0.075)
    assert got.curves["attn"].a == pytest.approx(0.015) and got.curves["mlp"].b == pytest.approx(
        0.0015
    )
    assert got.split_s["mlp"] == pytest.approx(0.03)
    assert got.memory_scale == 1.0  # no peak measured: the activations as counted
    # a step that peaked 40 MiB above the count: its activations scaled to match
    peak = whole_need(SHAPE) + 40 * 2**20
    monkeypatch.setattr(
        run, "time_whole_step", lambda shape, passes: WholeStep(1.5 * parts_sum, None, peak)
    )
    got = run.scaled(parts, SHAPE, TPGroup(), None)
    assert got.memory_scale == pytest.approx(memory_scale(SHAPE, peak)) and got.memory_scale > 1
    # a device whose parts promise more than the limit does not time a whole step
    monkeypatch.setattr(run, "WHOLE_STEP_MAX_S", parts_sum / 2)
    steps: list[Shape] = []
    monkeypatch.setattr(run, "step_peak", lambda shape: steps.append(shape) or peak)
    slow = run.scaled(parts, SHAPE, TPGroup(), None)
    assert slow.scale == 1.0 and slow.memory_scale == 1.0 and not steps
    # ... but where its memory is capped it steps untimed for the peak
    capped = run.scaled(parts, SHAPE, TPGroup(), 4 * 2**30)
    assert capped.scale == 1.0 and steps == [SHAPE]
    assert capped.memory_scale == pytest.approx(memory_scale(SHAPE, peak))


def test_the_whole_step_measures_the_memory_it_took() -> None:
    """Its peak above the process before the model: at least the weights, their gradients
    and AdamW's two moments (fp32 each), all alive at the end of a step; the same for the
    one untimed step of a capped device."""
    if not PeakRSS().resettable:
        pytest.skip("this kernel's high-water mark cannot be reset")
    timed, once = whole.time_whole_step(SHAPE).peak_bytes, whole.step_peak(SHAPE)
    assert timed is not None and once is not None
    assert min(timed, once) >= 16 * SHAPE.cfg.num_parameters()


@pytest.mark.parametrize("lora", [None, LoRAConfig(r=4)])
@pytest.mark.parametrize("tied", [True, False])
def test_the_update_is_timed_over_what_each_part_trains(
    lora: LoRAConfig | None, tied: bool
) -> None:
    from xronos.model.llama import LlamaForCausalLM
    from xronos.model.lora import add_lora
    from xronos.profiler.update import measure_update, trained_shapes

    cfg = replace(tiny(), tie_word_embeddings=tied)
    shape = Shape(cfg=cfg, batch_size=2, seq_len=8, mlp_chunk=16, vocab_chunk=64, lora=lora)
    model = LlamaForCausalLM(cfg)
    if lora is not None:
        add_lora(model, lora, seed=0)
    trained = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    parts = {k: sum(math.prod(s) for s in v) for k, v in trained_shapes(shape).items()}
    layer0 = sum(v for n, v in trained.items() if n.startswith("model.layers.0."))
    embed = sum(v for n, v in trained.items() if n.startswith("model.embed_tokens."))
    assert parts["layer"] == layer0 > 0
    assert parts["embed"] == embed
    # the head: what trains outside the layers and the embedding, plus a tied embedding's copy
    rest = sum(trained.values()) - cfg.num_layers * layer0 - embed
    assert parts["head"] == rest + (embed if tied else 0)
    upd = measure_update(shape, repeats=1)
    assert upd["layer"] > 0
    if lora is not None:  # adapters only: the embedding and the head are frozen
        assert upd["embed"] == upd["head"] == 0.0
    else:  # priced at the layer's per-parameter rate
        assert upd["embed"] / parts["embed"] == pytest.approx(upd["layer"] / parts["layer"])


def test_a_profile_holds_its_bytes_at_the_measured_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile's per-unit and replicated bytes are the counts with the activations
    scaled as the device's whole step measured (here a made-up 1.7)."""
    import xronos.profiler.run as run
    from xronos.comm.mappings import TPGroup

    monkeypatch.setattr(run, "memory_scale", lambda shape, grown: 1.7)
    got = run.profile_self("dev", SHAPE, TPGroup(), None, "k")
    assert got.memory_scale == 1.7
    assert got.unit_bytes == unit_bytes(SHAPE, 1.7) != unit_bytes(SHAPE)
    assert got.base_bytes == base_bytes(SHAPE, 1.7) > base_bytes(SHAPE)
