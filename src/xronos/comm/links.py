"""Link latency and, where the kernel cannot shape traffic, link bandwidth, emulated in the
communication layer.

Bandwidth is shaped by the kernel (``tc tbf`` on each device's veth, see
:mod:`xronos.emulation.netns`) wherever network namespaces can be made; latency needs
``netem``. What the kernel does, nothing here repeats. What it cannot do is added here, to
every message that carries model data — the tensor-parallel all-reduces and all-gathers of
:class:`~xronos.comm.mappings.TPGroup` and the pipeline's point-to-point messages — so that
every strategy pays for its links alike: latency where the kernel has no ``netem``; latency
*and* bandwidth where no network namespaces can be made at all (the emulator's fallback).

The model (``l_i``: one-way latency of device ``i``'s link, ``b_i`` its rate, ``P`` ranks).
A message from ``i`` to ``j`` crosses ``i``'s uplink and ``j``'s downlink, as between two
machines on one switch: it is held up by both latencies and streams at the slower rate::

    one message i -> j of B bytes  hop(i, j) = l_i + l_j,   transfer = 8B / min(b_i, b_j)

    gloo ring all-reduce of B bytes (gloo/allreduce.cc, the default algorithm):
        S = roundup(max(ceil(B / 1 MiB), 2P), P) segments, k = S / P per rank;
        reduce-scatter, then all-gather, each k(P-1) sends to a ring neighbour with two
        in flight at a time  =>  R = 2 · ceil(k(P-1) / 2) sequential rounds
        (k = 2 below 2P MiB:  R = 2(P-1);  2 ranks: 2 rounds);
        every link carries 2(P-1)/P · B bytes in all, c = 2(P-1)B / (P·R) per round
    gloo ring all-gather (gloo/allgather.cc): 2(P-1) half-chunk sends, two in flight
        =>  R = P - 1 rounds of c = B bytes (B: one rank's part)
    two ranks, all-reduce or all-gather (:mod:`xronos.comm.exchange`): each sends its
        whole tensor to the other  =>  R = 1 round of c = B bytes

    in each round rank r receives c bytes from its ring predecessor p(r), over the link
    p(r) -> r, which carries one round's bytes at a time:
        T_r(0) = 0,  F_r(0) = 0
        F_r(k) = max(T_p(r)(k-1), F_r(k-1)) + 8c / min(b_p(r), b_r)   (the bytes are out)
        T_r(k) = max(T_r(k-1), F_r(k) + hop(p(r), r))                 (and have arrived)
    rank r's added delay is T_r(R); with equal links it is R · (2l + 8c/b), i.e. the
    ring's 2(P-1)/P · 8B/b bandwidth term plus R · 2l. Without bandwidth the recursion
    is latency's alone: T_r(k) = max(T_r(k-1), T_p(k-1) + hop).

All-reduce rounds receive from ``r + 1`` (gloo sends a segment to ``r - 1``), all-gather
rounds from ``r - 1``. The delay is added after the real collective returns, inside its
timed span: it starts when the last rank has arrived (a device that arrives early waits for
the straggler first, as on a real link) and counts as transfer, not idle. It comes on top
of the real collective's own time over loopback, which it thus overstates by that time
(microseconds to a few milliseconds; see the emulation docs). A point-to-point message is
handed to gloo once it could have arrived — ``hop(i, j)`` after the sender issued it, plus,
with bandwidth, its transfer time after the sender's uplink and the path to ``j`` are free
of its earlier messages — by a timer thread: the sender computes on, the receiver's wait
ends no earlier than the message could have arrived. Every wait is a sleep; a device waiting
on its link is idle, as on a real link. Under emulated rates each process's link is one
queue (:class:`Wire`): the bytes of collectives in flight at once (two lanes of overlapped
tensor parallelism) and of its point-to-point messages are charged one after another, not
side by side.

Control traffic that carries no model data (barriers, gathering step records) is not
delayed. A group without latencies and bandwidths (``links=None``, all latencies zero and
no bandwidth) never sleeps.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

T = TypeVar("T")

GLOO_MAX_SEGMENT_BYTES = 1024 * 1024
"""gloo's ``AllreduceOptionsImpl::kMaxSegmentSize``: the largest single send of its ring."""


def allreduce_rounds(world: int, nbytes: int, element_size: int = 4) -> int:
    """Sequential message rounds of gloo's ring all-reduce of ``nbytes`` on ``world`` ranks
    (see the module docstring); 0 for one rank or an empty tensor."""
    if world <= 1 or nbytes <= 0:
        return 0
    max_segment = element_size * max(1, GLOO_MAX_SEGMENT_BYTES // element_size)
    segments = max(math.ceil(nbytes / max_segment), 2 * world)
    segments = math.ceil(segments / world) * world
    per_rank = segments // world
    return 2 * math.ceil(per_rank * (world - 1) / 2)


def allgather_rounds(world: int, nbytes: int) -> int:
    """Sequential message rounds of gloo's ring all-gather (``nbytes`` per rank)."""
    if world <= 1 or nbytes <= 0:
        return 0
    return world - 1


def ring_delays(
    latency_s: Sequence[float],
    rounds: int,
    step: int,
    *,
    bandwidth_bps: Sequence[float | None] | None = None,
    round_bytes: float = 0.0,
) -> tuple[float, ...]:
    """Per rank, the delay ``rounds`` ring rounds add when rank ``r`` receives each round
    from rank ``r + step`` (mod P) — the recursion of the module docstring.

    Args:
        latency_s: one-way latency of each rank's link, seconds, rank order.
        rounds: sequential rounds of the algorithm.
        step: +1 for gloo's all-reduce ring, -1 for its all-gather ring.
        bandwidth_bps: rate of each rank's link in bit/s (None, or a None entry: not
            limited here).
        round_bytes: bytes each link carries per round (``c``).
    """
    n = len(latency_s)
    done = [0.0] * n
    out = [0.0] * n  # F_r: when the link into r has sent its last round's bytes
    for _ in range(rounds):
        prev = list(done)
        for r in range(n):
            src = (r + step) % n
            rate = _slower(bandwidth_bps, src, r)
            send = 8 * round_bytes / rate if rate and round_bytes > 0 else 0.0
            out[r] = max(prev[src], out[r]) + send
            done[r] = max(prev[r], out[r] + latency_s[src] + latency_s[r])
    return tuple(done)


def _slower(bandwidth_bps: Sequence[float | None] | None, i: int, j: int) -> float | None:
    """The rate a message from ``i`` to ``j`` streams at: the slower of the two links
    (None: neither is limited)."""
    if bandwidth_bps is None:
        return None
    rates = [b for b in (bandwidth_bps[i], bandwidth_bps[j]) if b is not None]
    return min(rates) if rates else None


@dataclass
class Wire:
    """When this process's link, and its path to each peer, are next free of the bytes
    already charged to them, where the communication layer emulates the rate. One per
    process, shared by its subgroups and by collectives in flight at once (two lanes of
    overlapped tensor parallelism share one link, as on a real device)."""

    free_at: float = 0.0
    path_free_at: dict[int, float] = field(default_factory=dict)
    """By destination rank: when the link to it has sent this process's last message."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def book(self, now: float, busy_s: float) -> float:
        """Occupy the link ``busy_s`` seconds as soon as it is free; returns how long that
        is after ``now`` (0 on an idle link)."""
        with self.lock:
            start = max(now, self.free_at)
            self.free_at = start + busy_s
            return start - now

    def reserve(self, now: float, dst: int, transfer_s: float, uplink_s: float) -> float:
        """Queue a message of ``transfer_s`` seconds on the path to ``dst`` (occupying the
        uplink ``uplink_s``); returns when its last byte has left."""
        with self.lock:
            start = max(now, self.free_at, self.path_free_at.get(dst, 0.0))
            self.free_at = start + uplink_s
            self.path_free_at[dst] = start + transfer_s
            return start + transfer_s


class DelayedCalls:
    """Runs callables at given times on one background thread that sleeps in between (it
    takes no CPU while waiting). Started on first use; a daemon, so it never keeps a
    process alive."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, Callable[[], Any], Future[Any]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def call_at(self, due: float, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` at ``due`` (on :attr:`clock`); its result or exception comes
        through the returned future."""
        fut: Future[T] = Future()
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._order), fn, fut))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="xronos-links", daemon=True)
                self._thread.start()
            self._cond.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > self.clock():
                    wait = self._heap[0][0] - self.clock() if self._heap else None
                    self._cond.wait(wait)
                _, _, fn, fut = heapq.heappop(self._heap)
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to whoever waits on the future
                    fut.set_exception(e)


@dataclass(frozen=True)
class LinkDelays:
    """Per-rank link latencies (and, in the emulator's fallback, rates) of one group, and
    the waits they cause (module docstring).

    Set once where the group is created (:func:`xronos.comm.launch.init_gloo`) and carried
    by :class:`~xronos.comm.mappings.TPGroup`; never global.
    """

    latency_s: tuple[float, ...]
    """One-way latency of each rank's link in seconds, rank order."""
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)
    """How a rank waits (injected by tests)."""
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)
    """Clock of the delayed point-to-point sends."""
    sender: DelayedCalls = field(default_factory=DelayedCalls, compare=False, repr=False)
    """Timer thread that issues delayed point-to-point sends."""
    bandwidth_bps: tuple[float | None, ...] | None = None
    """Rate of each rank's link in bit/s, rank order, where the communication layer
    emulates bandwidth (no network namespaces); None where the kernel shapes the rate or
    nothing does. An entry None: that device's link has no rate limit."""
    wire: Wire = field(default_factory=Wire, compare=False, repr=False)
    """This process's link queue (under ``bandwidth_bps``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_s", tuple(float(x) for x in self.latency_s))
        if any(not (math.isfinite(x) and x >= 0) for x in self.latency_s):
            raise ValueError(f"link latencies must be finite and >= 0, got {self.latency_s}")
        rates = self.bandwidth_bps
        if rates is not None:
            rates = tuple(None if b is None else float(b) for b in rates)
            object.__setattr__(self, "bandwidth_bps", rates)
            if len(rates) != len(self.latency_s):
                raise ValueError(
                    f"{len(rates)} link rates for {len(self.latency_s)} link latencies"
                )
            if any(b is not None and not (math.isfinite(b) and b > 0) for b in rates):
                raise ValueError(f"link rates must be finite and > 0 bit/s, got {rates}")
        self.sender.clock = self.clock

    @property
    def active(self) -> bool:
        """False when no link adds latency or limits the rate: then nothing waits, nothing
        is scheduled."""
        shaped = self.bandwidth_bps is not None and any(b is not None for b in self.bandwidth_bps)
        return shaped or any(x > 0 for x in self.latency_s)

    @property
    def world(self) -> int:
        return len(self.latency_s)

    def among(self, ranks: Sequence[int]) -> LinkDelays:
        """The links of ``ranks`` (global ranks, in a subgroup's rank order)."""
        rates = self.bandwidth_bps
        return replace(
            self,
            latency_s=tuple(self.latency_s[r] for r in ranks),
            bandwidth_bps=tuple(rates[r] for r in ranks) if rates is not None else None,
        )

    def hop(self, src: int, dst: int) -> float:
        """One message from ``src`` to ``dst``: ``l_src + l_dst`` seconds."""
        return self.latency_s[src] + self.latency_s[dst]

    def transfer(self, src: int, dst: int, nbytes: int) -> float:
        """Seconds ``nbytes`` take from ``src`` to ``dst`` at the slower link's rate (0
        without rates here)."""
        rate = _slower(self.bandwidth_bps, src, dst)
        return 8 * nbytes / rate if rate and nbytes > 0 else 0.0

    def message_delay(self, src: int, dst: int, nbytes: int) -> float:
        """Latency plus transfer of one message of ``nbytes`` from ``src`` to ``dst`` on
        idle links (what a timed exchange between the two should wait)."""
        return self.hop(src, dst) + self.transfer(src, dst, nbytes)

    def allreduce_delay(self, rank: int, nbytes: int, element_size: int = 4) -> float:
        """Delay one all-reduce of ``nbytes``, just returned, adds for ``rank`` (call once
        per collective: under emulated rates it books this process's link)."""
        if self.world == 2 and nbytes > 0:  # one exchange of the whole tensor
            return self._ring(rank, 1, +1, float(nbytes))
        rounds = allreduce_rounds(self.world, nbytes, element_size)
        if not rounds:
            return 0.0
        per_round = 2 * (self.world - 1) * nbytes / (self.world * rounds)
        return self._ring(rank, rounds, +1, per_round)

    def allgather_delay(self, rank: int, nbytes: int) -> float:
        """Delay one all-gather of ``nbytes`` per rank, just returned, adds for ``rank``
        (call once per collective, as :meth:`allreduce_delay`)."""
        rounds = allgather_rounds(self.world, nbytes)
        return self._ring(rank, rounds, -1, float(nbytes)) if rounds else 0.0

    def _ring(self, rank: int, rounds: int, step: int, round_bytes: float) -> float:
        """The ring's delay for ``rank``; under emulated rates also the wait for bytes of
        other collectives still on this process's link (charged first, then these)."""
        rates = self.bandwidth_bps
        delay = ring_delays(
            self.latency_s, rounds, step, bandwidth_bps=rates, round_bytes=round_bytes
        )[rank]
        if rates is None:
            return delay
        zero = (0.0,) * self.world
        busy = ring_delays(zero, rounds, step, bandwidth_bps=rates, round_bytes=round_bytes)
        return delay + self.wire.book(self.clock(), busy[rank])

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds`` (nothing at all for 0)."""
        if seconds > 0:
            self.sleep(seconds)

    def send_later(
        self, src: int, dst: int, issue: Callable[[], T], nbytes: int | None = None
    ) -> Future[T]:
        """Call ``issue()`` (which hands a message of ``nbytes`` to gloo) on the timer
        thread once the message could have arrived: ``hop(src, dst)`` from now, plus, where
        rates are emulated here, its transfer after this process's earlier messages on the
        same uplink and path (global ranks; a message's size is then required)."""
        now = self.clock()
        if self.bandwidth_bps is None:
            return self.sender.call_at(now + self.hop(src, dst), issue)
        if nbytes is None:
            raise ValueError(
                "a point-to-point message on links whose rate the communication layer "
                "emulates needs its size: pass nbytes to send_later"
            )
        mine = self.bandwidth_bps[src]
        uplink = 8 * nbytes / mine if mine is not None else 0.0
        sent = self.wire.reserve(now, dst, self.transfer(src, dst, nbytes), uplink)
        return self.sender.call_at(sent + self.hop(src, dst), issue)
