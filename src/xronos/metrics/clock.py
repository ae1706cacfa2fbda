"""Clock offsets between ranks, NTP-style, over the training process group.

Rank 0 is the reference. For each other rank ``r`` and each round::

    rank r:  t0 = now()  ── send [t0] ──►  rank 0: t1 = now() on arrival
    rank r:  t3 = now()  ◄── send [t1, t2] ──  rank 0: t2 = now() before replying

    offset = ((t1 - t0) + (t2 - t3)) / 2        rank 0's clock minus rank r's clock
    rtt    = (t3 - t0) - (t2 - t1)              time spent on the wire and in the stacks

The round with the smallest ``rtt`` wins (least queueing). Because ``t0 <= t1 <= t2 <= t3``
in real time, the estimate's error is at most ``rtt / 2`` — so on one host, where every
process reads the same CLOCK_MONOTONIC, ``|offset| <= rtt / 2`` holds exactly.

Apply it with ``record.shifted(offset.offset_s)`` before shipping records to rank 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_clock = time.perf_counter


@dataclass(frozen=True)
class ClockOffset:
    """This rank's clock relative to rank 0 of the group."""

    offset_s: float
    """Add to this rank's ``perf_counter()`` times to express them on rank 0's clock."""
    rtt_s: float
    """Round-trip time of the chosen sample; the offset is exact to within ``rtt_s / 2``."""


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _serve(group: dist.ProcessGroup | None, rounds: int) -> None:
    """Rank 0: answer ``rounds`` pings from every other rank, one rank at a time."""
    ping = torch.zeros(1, dtype=torch.float64)
    for peer in range(1, dist.get_world_size(group)):
        src = _global(group, peer)
        for _ in range(rounds):
            dist.recv(ping, src=src, group=group)
            t1 = _clock()
            reply = torch.tensor([t1, _clock()], dtype=torch.float64)
            dist.send(reply, dst=src, group=group)


def _ping(group: dist.ProcessGroup | None, rounds: int) -> ClockOffset:
    """Rank r > 0: ping rank 0 ``rounds`` times, keep the minimum-RTT sample."""
    dst = _global(group, 0)
    reply = torch.zeros(2, dtype=torch.float64)
    best = ClockOffset(0.0, float("inf"))
    for _ in range(rounds):
        t0 = _clock()
        dist.send(torch.tensor([t0], dtype=torch.float64), dst=dst, group=group)
        dist.recv(reply, src=dst, group=group)
        t3 = _clock()
        t1, t2 = reply.tolist()
        rtt = (t3 - t0) - (t2 - t1)
        if rtt < best.rtt_s:
            best = ClockOffset(((t1 - t0) + (t2 - t3)) / 2, rtt)
    return best


def estimate_clock_offset(group: dist.ProcessGroup | None = None, rounds: int = 16) -> ClockOffset:
    """Estimate this rank's clock offset to rank 0 of ``group`` (collective: every rank of
    the group must call it). Rank 0 gets ``ClockOffset(0.0, 0.0)``.

    Args:
        group: the process group (default: the world).
        rounds: ping-pongs per rank; more rounds find a quieter sample.
    """
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    if dist.get_world_size(group) == 1:
        return ClockOffset(0.0, 0.0)
    if dist.get_rank(group) == 0:
        _serve(group, rounds)
        return ClockOffset(0.0, 0.0)
    return _ping(group, rounds)
