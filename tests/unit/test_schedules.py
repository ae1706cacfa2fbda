"""Timing a pipeline schedule: uniform micro-batches against the textbook bubble, uneven
ones against a schedule worked by hand, and the runtime's cut of the batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xronos.pipeline.schedule import split_microbatches
from xronos.planner.schedules import STRATEGIES, makespan, microbatch_sizes


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_uniform_micro_batches_take_m_plus_n_minus_one_stage_times(
    strategy: str, n: int, m: int
) -> None:
    # Every stage 1.5 s per micro-batch: GPipe and 1F1B both take (m + n - 1) of them.
    got = makespan(strategy, [[1.5] * m for _ in range(n)])
    assert got == pytest.approx((m + n - 1) * 1.5, rel=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_uneven_first_micro_batch_is_timed_as_worked_by_hand(strategy: str) -> None:
    # Two stages, the first micro-batch twice the second; forwards take a third.
    # stage 0: F0 0-1, F1 1-1.5; stage 1: F0 1-3, then (either schedule) B0 ends at 7,
    # F1 7-8 or 3-4, B1 ends at 10; stage 0: B0 7/8-9/10, B1 10-11.
    stage_s = [[3.0, 1.5], [6.0, 3.0]]
    assert makespan(strategy, stage_s) == pytest.approx(11.0, rel=1e-12)
    # The closed form Σ t + (m - 1) max t with the mean micro-batch says 11.25 either way;
    # the schedule knows which comes first: small first, stage 1 computes (1F1B) 0.5-1.5 (F0),
    # 1.5-3.5 (B0) and 3.5-9.5 (F1, B1), and stage 0's last backward ends at 11.5.
    assert makespan(strategy, [[1.5, 3.0], [3.0, 6.0]]) == pytest.approx(11.5, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(STRATEGIES),
    st.integers(1, 4),
    st.lists(st.floats(0.01, 10.0), min_size=1, max_size=6),
    st.lists(st.floats(0.1, 3.0), min_size=4, max_size=4),
)
def test_a_schedule_takes_at_least_its_busiest_stage_and_at_most_all_work_in_turn(
    strategy: str, n: int, sizes: list[float], speeds: list[float]
) -> None:
    stage_s = [[b / speeds[j] for b in sizes] for j in range(n)]
    got = makespan(strategy, stage_s)
    busiest = max(sum(row) for row in stage_s)
    serial = sum(sum(row) for row in stage_s)
    assert busiest - 1e-9 <= got <= serial + 1e-9


@pytest.mark.parametrize("accum", [1, 3])
def test_micro_batch_sizes_are_the_runtimes_cut(accum: int) -> None:
    for batch in range(1, 9):
        for parts in range(1, batch + 1):
            batches = [(torch.zeros(batch, 4), torch.zeros(batch, 4)) for _ in range(accum)]
            cut = [ids.shape[0] for ids, _ in split_microbatches(batches, parts * accum)]
            assert microbatch_sizes(batch, parts, accum) == cut
