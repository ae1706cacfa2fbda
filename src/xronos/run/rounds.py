"""The order in which sessions that take turns step by step run in each round.

Sessions measured against each other (``auto``'s trial steps, the benchmark's strategies)
take one step each per round, so that a host whose speed drifts over seconds slows them
alike. Rotating the order (round ``k`` starts at session ``k``) spreads who goes first,
but every session then always follows the same one: a step can carry over part of the
cost of the one before it (the caches it left, a device still finishing the other's
work), and with a fixed predecessor that cost stays with one session. Across 116
strategy runs of the benchmark a step after the solo round against one after its fixed
predecessor differed by a median 0.5 % (1.2 % where that predecessor was ``single``):
small, but as large as the margins some comparisons are decided by.

A Williams design balances it: over every ``2n`` rounds (``n`` where ``n`` is even) each
session goes first equally often and follows every other session equally often. Round
``k``'s order is the base row ``0, 1, n-1, 2, n-2, …`` shifted by ``k``; for odd ``n``
the next ``n`` rounds run the same rows reversed.
"""

from __future__ import annotations


def round_order(n: int, k: int) -> list[int]:
    """Indices ``0 … n-1`` in the order round ``k`` (from 0) runs them."""
    if n <= 0:
        return []
    base = [0]
    for j in range(1, n):
        base.append((j + 1) // 2 if j % 2 else n - j // 2)
    row = [(b + k) % n for b in base]
    if n % 2 and (k // n) % 2:
        row.reverse()
    return row
