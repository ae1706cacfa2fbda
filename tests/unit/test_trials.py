"""``auto``'s trials keep every shortlisted candidate open at once only where each device's
memory holds the whole model once per candidate it takes part in, and weigh a collaboration
against the device alone round by round where both stepped in the same rounds."""

from __future__ import annotations

import math

import pytest

from xronos.config import small
from xronos.planner.auto import Candidate
from xronos.planner.memory import tp_need
from xronos.planner.plan import segment_units
from xronos.planner.profile import CostCurve, DeviceProfile
from xronos.run.trials import room_for_all

CFG = small()
TOTALS = segment_units(CFG, 32, 32)


def _profile(name: str, memory: int) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        segments={s: CostCurve(0.0, 1e-3) for s in TOTALS},
        replicated_s=0.01,
        memory_bytes=memory,
        unit_bytes={s: 1000 for s in TOTALS},
        base_bytes=10_000,
    )


def _cand(strategy: str, devices: tuple[int, ...]) -> Candidate:
    return Candidate(strategy, devices, 1.0, None, True, "")


SHORTLIST = [_cand("single", (0,)), _cand("xronos", (0, 1)), _cand("tp-even", (0, 1))]


def test_unbounded_devices_hold_every_candidate() -> None:
    assert room_for_all([_profile("a", 0), _profile("b", 0)], SHORTLIST, TOTALS)


def test_a_device_in_three_candidates_needs_three_models() -> None:
    whole = tp_need(_profile("a", 0), TOTALS)
    enough = [_profile("a", 3 * whole), _profile("b", 2 * whole)]
    assert room_for_all(enough, SHORTLIST, TOTALS)
    # one byte short on the device that takes part in all three
    short = [_profile("a", 3 * whole - 1), _profile("b", 2 * whole)]
    assert not room_for_all(short, SHORTLIST, TOTALS)
    # device b takes part in two: it needs two models, not three
    assert not room_for_all(
        [_profile("a", 3 * whole), _profile("b", 2 * whole - 1)], SHORTLIST, TOTALS
    )


def test_a_device_in_one_candidate_is_not_counted() -> None:
    whole = tp_need(_profile("a", 0), TOTALS)
    alone = [_cand("single", (1,)), _cand("xronos", (0,))]
    assert room_for_all([_profile("a", math.ceil(whole / 2)), _profile("b", 1)], alone, TOTALS)


def test_trials_go_on_only_while_the_two_fastest_are_close() -> None:
    from xronos.run.trials import CLOSE, _close

    # medians 1.00 and just under 1 + CLOSE: close; the third candidate does not count
    assert _close([[1.0, 1.0], [1.0 + CLOSE * 0.9] * 2, [5.0]])
    assert not _close([[1.0, 1.0], [1.0 + CLOSE * 1.1] * 2, [1.0 + CLOSE * 1.2]])
    # the medians decide, not one stray step
    assert _close([[1.0, 1.0, 9.0], [1.05, 1.05, 1.05]])


def test_a_collaboration_must_beat_the_device_alone_by_the_margin() -> None:
    from xronos.run.trials import ALONE_MARGIN, pick

    single, xronos, even = SHORTLIST
    alone = 0.500
    just = alone * (1.0 - ALONE_MARGIN)
    # ahead, but by less than the margin: one device alone
    assert pick(SHORTLIST, {"single:0": alone, "xronos:0,1": just + 1e-4})[0] is single
    # ahead by more than the margin: the collaboration
    assert pick(SHORTLIST, {"single:0": alone, "xronos:0,1": just - 1e-4})[0] is xronos
    # the fastest of the collaborations is the one weighed
    times = {"single:0": alone, "xronos:0,1": 0.49, "tp-even:0,1": 0.40}
    assert pick(SHORTLIST, times)[0] is even
    # nothing tried: the prediction decides, with no margin
    assert pick(SHORTLIST, {})[0] is single  # all predicted at 1.0: the first
    # a device alone that was not tried does not hold a tried collaboration back
    assert pick([xronos, single], {"xronos:0,1": 0.499})[0] is xronos


def test_rounds_weigh_the_collaboration_against_the_device_alone_round_by_round() -> None:
    from xronos.run.trials import against_alone, pick

    single, xronos, _ = SHORTLIST
    # The host slows over the race (round factors 1.0, 1.2, 1.4); in round 2 the device
    # alone stepped in a quiet moment. Each median then comes from another round, and their
    # ratio (0.54 / 0.52) keeps the device alone, where every other round shows the
    # collaboration 10 % ahead.
    rounds = {"xronos:0,1": [0.45, 0.54, 0.63], "single:0": [0.50, 0.52, 0.70]}
    trials = {k: sorted(v)[1] for k, v in rounds.items()}
    assert pick(SHORTLIST, trials)[0] is single  # the medians alone
    weighed = against_alone(SHORTLIST, trials, rounds)
    assert weighed is not None and weighed.paired and weighed.wins
    assert weighed.ratio == pytest.approx(0.90)  # the median of 0.90, 1.04, 0.90
    assert pick(SHORTLIST, trials, rounds)[0] is xronos
    # level round by round: the device alone, as with the medians
    level = {"xronos:0,1": [0.50, 0.49, 0.51], "single:0": [0.50, 0.50, 0.50]}
    trials = {k: sorted(v)[1] for k, v in level.items()}
    assert pick(SHORTLIST, trials, level)[0] is single
    # steps not taken in the same rounds (lists of other lengths): the medians' ratio
    apart = {"xronos:0,1": [0.45, 0.54, 0.63], "single:0": [0.50, 0.52]}
    weighed = against_alone(SHORTLIST, {"xronos:0,1": 0.54, "single:0": 0.51}, apart)
    assert weighed is not None and not weighed.paired
    assert weighed.ratio == pytest.approx(0.54 / 0.51)


def test_nothing_to_weigh_unless_a_collaboration_and_a_device_alone_were_tried() -> None:
    from xronos.run.trials import against_alone

    single, xronos, _ = SHORTLIST
    assert against_alone([xronos, single], {"xronos:0,1": 0.4}) is None  # alone not tried
    assert against_alone(SHORTLIST, {"single:0": 0.4}) is None  # no collaboration tried
    behind = against_alone(SHORTLIST, {"single:0": 0.4, "xronos:0,1": 0.5})
    assert behind is not None and behind.ratio == pytest.approx(1.25) and not behind.wins
    weighed = against_alone(SHORTLIST, {"single:0": 0.5, "xronos:0,1": 0.4})
    assert weighed is not None
    assert weighed.to_dict() == {
        "together": "xronos:0,1",
        "alone": "single:0",
        "ratio": pytest.approx(0.8),
        "paired": False,
        "margin": 0.03,
        "wins": True,
    }
