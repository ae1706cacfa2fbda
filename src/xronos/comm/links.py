"""Link latency, emulated in the communication layer where the kernel cannot delay packets.

Bandwidth is shaped by the kernel (``tc tbf`` on each device's veth, see
:mod:`xronos.emulation.netns`). Latency needs ``netem``; where the kernel has it, the
kernel delays every packet and nothing here is used. Where it has not, every message that
carries model data — the tensor-parallel all-reduces and all-gathers of
:class:`~xronos.comm.mappings.TPGroup` and the pipeline's point-to-point messages — is
delayed here, so that every strategy pays for latency alike.

The model (``l_i``: one-way latency of device ``i``'s link, ``P`` ranks)::

    one message i -> j             hop(i, j) = l_i + l_j    (i's uplink, j's downlink)

    gloo ring all-reduce of B bytes (gloo/allreduce.cc, the default algorithm):
        S = roundup(max(ceil(B / 1 MiB), 2P), P) segments, k = S / P per rank;
        reduce-scatter, then all-gather, each k(P-1) sends to a ring neighbour with two
        in flight at a time  =>  R = 2 · ceil(k(P-1) / 2) sequential rounds
        (k = 2 below 2P MiB:  R = 2(P-1);  2 ranks: 2 rounds)
    gloo ring all-gather (gloo/allgather.cc): 2(P-1) half-chunk sends, two in flight
        =>  R = P - 1 rounds

    in each round rank r receives from its ring predecessor p(r):
        T_r(0) = 0
        T_r(k) = max(T_r(k-1), T_p(r)(k-1) + hop(p(r), r))
    rank r's added delay is T_r(R); with equal latencies l it is R · 2l.

All-reduce rounds receive from ``r + 1`` (gloo sends a segment to ``r - 1``), all-gather
rounds from ``r - 1``. The delay is added after the real collective returns, inside its
timed span: it starts when the last rank has arrived (a device that arrives early waits for
the straggler first, as on a real link) and counts as transfer, not idle. A point-to-point
message is handed to gloo ``hop(i, j)`` after the sender issued it, by a timer thread: the
sender computes on, the receiver's wait ends no earlier than the message could have
arrived. Every wait is a sleep; a device waiting on latency is idle, as on a real link.

Control traffic that carries no model data (barriers, gathering step records) is not
delayed. A group without latencies (``links=None`` or all zero) never sleeps.
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


def ring_delays(latency_s: Sequence[float], rounds: int, step: int) -> tuple[float, ...]:
    """Per rank, the latency ``rounds`` ring rounds add when rank ``r`` receives each round
    from rank ``r + step`` (mod P) — the recursion of the module docstring.

    Args:
        latency_s: one-way latency of each rank's link, seconds, rank order.
        rounds: sequential rounds of the algorithm.
        step: +1 for gloo's all-reduce ring, -1 for its all-gather ring.
    """
    n = len(latency_s)
    done = [0.0] * n
    for _ in range(rounds):
        prev = list(done)
        for r in range(n):
            src = (r + step) % n
            done[r] = max(prev[r], prev[src] + latency_s[src] + latency_s[r])
    return tuple(done)


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
    """Per-rank link latencies of one group, and the waits they cause (module docstring).

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "latency_s", tuple(float(x) for x in self.latency_s))
        if any(not (math.isfinite(x) and x >= 0) for x in self.latency_s):
            raise ValueError(f"link latencies must be finite and >= 0, got {self.latency_s}")
        self.sender.clock = self.clock

    @property
    def active(self) -> bool:
        """False when no link adds latency: then nothing waits, nothing is scheduled."""
        return any(x > 0 for x in self.latency_s)

    @property
    def world(self) -> int:
        return len(self.latency_s)

    def among(self, ranks: Sequence[int]) -> LinkDelays:
        """The latencies of ``ranks`` (global ranks, in a subgroup's rank order)."""
        return replace(self, latency_s=tuple(self.latency_s[r] for r in ranks))

    def hop(self, src: int, dst: int) -> float:
        """One message from ``src`` to ``dst``: ``l_src + l_dst`` seconds."""
        return self.latency_s[src] + self.latency_s[dst]

    def allreduce_delay(self, rank: int, nbytes: int, element_size: int = 4) -> float:
        """Latency one all-reduce of ``nbytes`` adds for ``rank``."""
        rounds = allreduce_rounds(self.world, nbytes, element_size)
        return ring_delays(self.latency_s, rounds, +1)[rank] if rounds else 0.0

    def allgather_delay(self, rank: int, nbytes: int) -> float:
        """Latency one all-gather of ``nbytes`` per rank adds for ``rank``."""
        rounds = allgather_rounds(self.world, nbytes)
        return ring_delays(self.latency_s, rounds, -1)[rank] if rounds else 0.0

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds`` (nothing at all for 0)."""
        if seconds > 0:
            self.sleep(seconds)

    def send_later(self, src: int, dst: int, issue: Callable[[], T]) -> Future[T]:
        """Call ``issue()`` (which hands a message to gloo) ``hop(src, dst)`` from now, on
        the timer thread."""
        return self.sender.call_at(self.clock() + self.hop(src, dst), issue)
