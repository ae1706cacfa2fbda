"""What computing while an all-reduce travels costs: the group's ``overlap_loss``.

A fused column seam (:mod:`xronos.parallel.columns`) starts its input gradient's
all-reduce and computes the weight gradients while it travels. On a device whose one CPU
both computes and moves the messages the two take from each other: the products run
slower while packets arrive, and the transfer advances only as far as the computing
leaves it the CPU. Hiding a transfer of ``T`` seconds behind ``W`` seconds of computing
therefore takes longer than ``max(W, T)``::

    overlapped = max(W, T) + loss · min(W, T)

``loss`` 0: the overlap hides all it can; 1: it hides nothing (as slow as one after the
other); above 1: slower than not overlapping. The planner prices the seams with it
(:meth:`~xronos.planner.comm.Network.hidden_s`).

Measured on the group, at the activation's size, with the step's own exchange
(:meth:`~xronos.comm.mappings.TPGroup.start_all_reduce`, links' latency included): each
device sizes products shaped like a weight gradient (``(tokens, H)ᵀ · (tokens, H)``) to
the all-reduce's time at its own speed, then every round times the all-reduce alone, the
products alone, and the two overlapped, each after a barrier; a round's time is its slowest
device's, and each of the three is the median over rounds (interleaved, so the host's drift
moves all three alike). Measured on ``ci-2dev`` (docs/benchmarks.md): 0.21-0.30 at 200
Mbit/s, 0.38-0.78 at 1 Gbit/s, 1.0-1.9 on loopback, where the message leaves only once the
computing ends.
"""

from __future__ import annotations

import statistics
import time

import torch

from xronos.comm.mappings import TPGroup

MIN_WORK_S = 0.003
"""The least computing overlapped: a shorter one is lost in a slow device's timing noise."""
MAX_WORK_S = 0.25
"""The most: a very slow link's all-reduce is overlapped with at most this much."""
BUDGET_S = 2.0
"""About how long the rounds may take in all (fewer rounds where the work is long)."""
LOSS_RANGE = (0.0, 2.0)
"""``overlap_loss`` is clamped to this: on a link with next to no transfer, noise divided
by a tiny ``min(W, T)`` could otherwise read as anything."""


def _products(tokens: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen)
    return x, torch.randn(tokens, hidden, generator=gen), torch.empty(hidden, hidden)


def _seconds_per_product(x: torch.Tensor, dy: torch.Tensor, out: torch.Tensor) -> float:
    """One weight-gradient product's seconds on this device (a tenth of a second of them)."""
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < 0.1:
        torch.mm(x.t(), dy, out=out)
        n += 1
    return (time.perf_counter() - t0) / n


def measure_overlap(group: TPGroup, tokens: int, hidden: int) -> float:
    """The group's ``overlap_loss`` (see the module docstring) for an all-reduce of a
    ``(tokens, hidden)`` fp32 activation; the same on every rank, 0 on one rank. Collective."""
    if group.size == 1:
        return 0.0
    msg = torch.zeros(tokens * hidden)
    x, dy, out = _products(tokens, hidden)

    def products(k: int) -> None:
        for _ in range(k):
            torch.mm(x.t(), dy, out=out)

    def timed_all_reduce() -> float:
        group.barrier()
        t0 = time.perf_counter()
        group.start_all_reduce(msg, "profile.overlap").wait()
        return time.perf_counter() - t0

    for _ in range(2):  # the first messages open connections and buffers
        timed_all_reduce()
    ar = max(group.gather_object(statistics.median(timed_all_reduce() for _ in range(3))))
    work = min(max(ar, MIN_WORK_S), MAX_WORK_S)
    k = max(1, round(work / _seconds_per_product(x, dy, out)))
    rounds = max(5, min(15, int(BUDGET_S / (3 * max(work, ar)))))
    mine: list[tuple[float, float, float]] = []
    for _ in range(rounds):
        alone = timed_all_reduce()
        group.barrier()
        t0 = time.perf_counter()
        products(k)
        compute = time.perf_counter() - t0
        group.barrier()
        t0 = time.perf_counter()
        pending = group.start_all_reduce(msg, "profile.overlap")
        products(k)
        pending.wait()
        mine.append((alone, compute, time.perf_counter() - t0))
    every = group.gather_object(mine)
    t, w, both = (
        statistics.median(max(rank[r][i] for rank in every) for r in range(rounds))
        for i in range(3)
    )
    loss = (both - max(w, t)) / min(w, t) if min(w, t) > 0 else 0.0
    return min(max(loss, LOSS_RANGE[0]), LOSS_RANGE[1])
