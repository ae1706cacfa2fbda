"""Communication for tensor parallelism: a process-group handle and Megatron's conjugate pairs.

Shape algebra (``R`` ranks, hidden ``H``, tokens ``N = B·S``)::

    copy_to_tp(x):      forward  y = x                         x, y: (N, H) on every rank
                        backward dx = all_reduce(dy)           dy: per-rank partial (N, H)
    reduce_from_tp(x):  forward  y = all_reduce(x)             x: per-rank partial (N, H)
                        backward dx = dy                        dy: identical on every rank

``copy_to_tp`` sits before a column-parallel input, ``reduce_from_tp`` after a
row-parallel output. Both are identities with one rank. Every collective goes through
``TPGroup.all_reduce`` so that it is timed (arrive/leave: docs/architecture.md,
Measurement) and bounded by the group's timeout; between two ranks it is one exchange of messages
(:mod:`xronos.comm.exchange`). A group with ``links`` adds its links' latency to every
all-reduce and all-gather (the model is in :mod:`xronos.comm.links`).

**Lanes** (overlap, :meth:`TPGroup.with_lanes`): two threads of one rank may run two halves
of a batch at once, each inside :func:`lane` ``k``; the collectives of lane ``k`` go over
process group ``lanes[k]``, so each lane's collectives keep the same order on every rank
while one lane computes and the other waits on the wire. Their spans are named
``L<k>:<name>`` (see :mod:`xronos.metrics.analysis`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from xronos.comm import exchange
from xronos.comm.groups import new_group
from xronos.comm.links import LinkDelays
from xronos.metrics.recorder import current_recorder
from xronos.metrics.records import COLLECTIVE

_LANE = threading.local()


@contextmanager
def lane(k: int) -> Iterator[None]:
    """Run the block as lane ``k`` of this thread's groups (see the module docstring)."""
    previous = getattr(_LANE, "k", None)
    _LANE.k = k
    try:
        yield
    finally:
        _LANE.k = previous


def current_lane() -> int | None:
    """The lane this thread runs in, or None outside :func:`lane`."""
    return getattr(_LANE, "k", None)


@dataclass
class TPGroup:
    """The ranks that share one model's tensors, passed explicitly to every layer."""

    rank: int = 0
    size: int = 1
    pg: dist.ProcessGroup | None = None
    communicate: bool = True
    """False for a stand-in (:meth:`silent`) whose collectives are recorded but move no
    data: a model built on it runs a step's compute alone, for the computation-stall
    measurement. Its results are wrong by design; it never trains anything that is kept."""
    links: LinkDelays | None = None
    """Latency of each device's link by global rank, added to every message (None: none)."""
    payload: torch.dtype | None = None
    """Dtype the activations and their gradients travel in through the seams
    (:func:`reduce_activation`); None: their own (fp32, exact). bf16 halves the bytes on
    the wire and rounds each rank's partial sum to 8 bits of mantissa before adding."""
    lanes: tuple[dist.ProcessGroup, ...] = ()
    """Process groups over the same ranks, one per lane (:meth:`with_lanes`); empty: no
    overlap."""

    @classmethod
    def from_default(cls, links: LinkDelays | None = None) -> TPGroup:
        if not dist.is_initialized():
            return cls()
        world = dist.get_world_size()
        if links is not None and links.world != world:
            raise ValueError(f"{links.world} link latencies for a group of {world} ranks")
        return cls(dist.get_rank(), world, dist.group.WORLD, links=links)

    def silent(self) -> TPGroup:
        """The same rank and size, without communication (see ``communicate``)."""
        return replace(self, pg=None, communicate=False, links=None, lanes=())

    def on(self, pg: dist.ProcessGroup) -> TPGroup:
        """The same ranks and links on another process group over them."""
        return replace(self, pg=pg, lanes=())

    def world_ranks(self) -> tuple[int, ...]:
        """The members' global ranks, in group-rank order (one rank: this process's)."""
        if not dist.is_initialized():
            return (0,)
        if self.pg is None:
            return (dist.get_rank(),)
        return tuple(dist.get_process_group_ranks(self.pg))

    def with_lanes(self, timeout_s: float) -> TPGroup:
        """This group with two lanes: its own process group and a second one over the same
        ranks (made here; every member calls this, the other ranks need not). One rank or
        no communication: unchanged."""
        if self.size == 1 or not self.communicate or self.lanes or self.pg is None:
            return self
        second = new_group(dist.get_process_group_ranks(self.pg), timeout_s, local=True)
        return replace(self, lanes=(self.pg, second))

    def _route(self, name: str) -> tuple[dist.ProcessGroup | None, str]:
        """The process group and span name of a collective issued from this thread."""
        k = current_lane()
        if k is None or not self.lanes:
            return self.pg, name
        return self.lanes[k], f"L{k}:{name}"

    def delays(self) -> LinkDelays | None:
        """The latencies of this group's members, in group-rank order, that its collectives
        wait for; None when nothing waits (no latency, or a silent group). ``links`` is
        indexed by global rank (the launcher's device order), so it serves subgroups too."""
        links = self.links
        if links is None or not self.communicate or not links.active:
            return None
        if links.world == self.size:
            return links
        return links.among(dist.get_process_group_ranks(self.pg))

    def link_wait(self, t: torch.Tensor, collective: str) -> None:
        """Wait the latency the links add to one ``all_reduce`` or ``all_gather`` of ``t``
        (this rank's input); nothing without latency. Call it right after the collective,
        inside its timed region."""
        links = self.delays()
        if links is None:
            return
        nbytes = t.numel() * t.element_size()
        if collective == "all_reduce":
            links.wait(links.allreduce_delay(self.rank, nbytes, t.element_size()))
        elif collective == "all_gather":
            links.wait(links.allgather_delay(self.rank, nbytes))
        else:
            raise ValueError(f"no latency model for {collective!r}")

    def all_reduce(
        self, t: torch.Tensor, name: str, op: Any = dist.ReduceOp.SUM, kind: str = COLLECTIVE
    ) -> None:
        """In-place all-reduce of ``t`` (contiguous), timed and recorded as ``name``
        (``kind`` tags the span, e.g. with the plan segment it closes)."""
        if self.size == 1:
            return
        pg, name = self._route(name)
        with current_recorder().collective(name, kind):
            if self.communicate:
                exchange.all_reduce(t, pg, op)
            self.link_wait(t, "all_reduce")

    def start_all_reduce(self, t: torch.Tensor, name: str, kind: str = COLLECTIVE) -> PendingReduce:
        """In-place all-reduce (sum) of ``t`` (contiguous) that lets this rank compute
        while it travels: the messages are issued now, each after its link's latency
        where the links add one; :meth:`PendingReduce.wait` ends it. Only the wait is
        timed and recorded as ``name``: the time before it is compute."""
        if self.size == 1:
            return PendingReduce(t, None, name, kind)
        pg, name = self._route(name)
        if not self.communicate:
            return PendingReduce(t, None, name, kind)
        links, peer = self.delays(), 1 - self.rank
        send: exchange.Send | None = None
        if links is not None and self.size == 2:
            nbytes = t.numel() * t.element_size()

            def send(issue: Callable[[], dist.Work]) -> Future[dist.Work]:
                return links.send_later(self.rank, peer, issue, nbytes)

        reduction = exchange.start_all_reduce(t, pg, dist.ReduceOp.SUM, send)
        # A ring over more ranks: its latency is added once it is done, as for all_reduce.
        late = self if links is not None and self.size != 2 else None
        return PendingReduce(t, reduction, name, kind, late)

    def barrier(self) -> None:
        """Wait for every rank (bounded by the group's timeout; not recorded)."""
        if self.size > 1 and self.communicate:
            dist.barrier(group=self.pg)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (control data, not recorded)."""
        if self.size == 1 or not self.communicate:
            return [obj] * self.size
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def all_gather(self, t: torch.Tensor, name: str, kind: str = COLLECTIVE) -> list[torch.Tensor]:
        """All-gather of equal-shaped tensors (gloo requires equal sizes on every rank)."""
        if self.size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.size)]
        pg, name = self._route(name)
        with current_recorder().collective(name, kind):
            if not self.communicate:
                out = [t.clone() for _ in range(self.size)]
            else:
                exchange.all_gather(out, t.contiguous(), pg)
            self.link_wait(t, "all_gather")
        return out


class PendingReduce:
    """An all-reduce in flight (:meth:`TPGroup.start_all_reduce`)."""

    def __init__(
        self,
        t: torch.Tensor,
        reduction: exchange.Reduction | None,
        name: str,
        kind: str,
        late: TPGroup | None = None,
    ) -> None:
        self.t, self._reduction, self.name, self.kind = t, reduction, name, kind
        self._late = late

    def wait(self) -> torch.Tensor:
        """The reduced tensor (the one started on), after waiting for the others' parts."""
        with current_recorder().collective(self.name, self.kind):
            if self._reduction is not None:
                self._reduction.wait()
                self._reduction = None
                if self._late is not None:
                    self._late.link_wait(self.t, "all_reduce")
        return self.t


class PendingActivation:
    """An activation's all-reduce in flight (:func:`start_reduce_activation`)."""

    def __init__(self, pending: PendingReduce, dtype: torch.dtype) -> None:
        self._pending, self._dtype = pending, dtype

    def wait(self) -> torch.Tensor:
        return self._pending.wait().to(self._dtype)


def start_reduce_activation(
    t: torch.Tensor, group: TPGroup, name: str, kind: str
) -> PendingActivation:
    """:func:`reduce_activation` that computes on while it travels (see
    :meth:`TPGroup.start_all_reduce`); ``wait()`` gives the sum in ``t``'s dtype."""
    return PendingActivation(group.start_all_reduce(_payload(t, group), name, kind), t.dtype)


def _payload(t: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """A contiguous copy of ``t`` in the dtype it travels in (``group.payload``, else its
    own)."""
    if group.payload is None or group.payload == t.dtype:
        return t.contiguous().clone()
    return t.to(group.payload).contiguous()


def reduce_activation(t: torch.Tensor, group: TPGroup, name: str, kind: str) -> torch.Tensor:
    """All-reduce (sum) of an activation or its gradient ``t`` (N, H) at the seams: in
    ``group.payload`` on the wire when set, the result back in ``t``'s dtype."""
    y = _payload(t, group)
    group.all_reduce(y, name, kind=kind)
    return y.to(t.dtype)


class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) of the input gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup, name: str, kind: str) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.name, ctx.kind = group, name, kind
        return x

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return reduce_activation(dy, ctx.group, ctx.name + ".bwd", ctx.kind), None, None, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: TPGroup, name: str, kind: str) -> torch.Tensor:  # type: ignore[override]
        return reduce_activation(x, group, name + ".fwd", kind)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return dy, None, None, None


def copy_to_tp(
    x: torch.Tensor, group: TPGroup, name: str = "copy", kind: str = COLLECTIVE
) -> torch.Tensor:
    if group.size == 1:
        return x
    return _CopyToTP.apply(x, group, name, kind)  # type: ignore[no-any-return]


def reduce_from_tp(
    x: torch.Tensor, group: TPGroup, name: str = "reduce", kind: str = COLLECTIVE
) -> torch.Tensor:
    if group.size == 1:
        return x
    return _ReduceFromTP.apply(x, group, name, kind)  # type: ignore[no-any-return]


class ReduceFromTP(torch.nn.Module):
    """Module form of :func:`reduce_from_tp`, for the model's ``exit`` seam."""

    def __init__(self, group: TPGroup, name: str, kind: str = COLLECTIVE) -> None:
        super().__init__()
        self.group, self.name, self.kind = group, name, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(x, self.group, self.name, self.kind)
