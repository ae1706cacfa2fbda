"""The order of interleaved rounds: balanced for what a step carries over from the one
before it (a Williams design), unlike a rotation."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from xronos.run.rounds import round_order


def _block(n: int) -> int:
    return n if n % 2 == 0 else 2 * n


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_every_session_goes_first_and_follows_every_other_equally_often(n: int) -> None:
    for start in (0, 3):  # any window of a whole block of rounds is balanced
        rows = [round_order(n, k) for k in range(start, start + _block(n))]
        assert all(sorted(r) == list(range(n)) for r in rows)  # each runs once a round
        firsts = Counter(r[0] for r in rows)
        assert set(firsts.values()) == {_block(n) // n}
        after = Counter(pair for r in rows for pair in itertools.pairwise(r))
        pairs = {(a, b) for a in range(n) for b in range(n) if a != b}
        assert set(after) == pairs  # every ordered pair occurs ...
        assert len(set(after.values())) <= 1  # ... equally often


def test_a_rotation_would_not_be_balanced() -> None:
    # what the design replaces: rotating five sessions, session 0 always follows 4
    rotated = [[(k + i) % 5 for i in range(5)] for k in range(10)]
    after = Counter(pair for r in rotated for pair in itertools.pairwise(r))
    assert (3, 0) not in after and (4, 0) in after
    designed = [round_order(5, k) for k in range(10)]
    after = Counter(pair for r in designed for pair in itertools.pairwise(r))
    assert after[(3, 0)] == after[(4, 0)] == 2


def test_no_sessions_no_order() -> None:
    assert round_order(0, 7) == []
