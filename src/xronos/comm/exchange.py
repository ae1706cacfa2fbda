"""All-reduce and all-gather between two ranks as one exchange of messages.

gloo's collectives run on a worker thread of the process group and its ring takes two
dependent rounds for an all-reduce (reduce-scatter, then all-gather), even between two
ranks. Between two ranks the same result needs one round: each rank sends its whole tensor
to the other (``isend``/``irecv``, issued from the calling thread) and combines the two.
The bytes on each link are the ring's (``B`` each way: the ring sends ``B/2`` twice); the
latency paid is one hop instead of two, and the thread hand-offs of the worker are gone.

Measured between two one-CPU processes on one host (median of 300, ms; gloo's all-reduce
against this exchange): one float 0.36 → 0.15, 256 KB of bf16 0.49 → 0.19, 512 KB of fp32
0.44 → 0.25; with one side slowed to 0.4 by a competing load, 512 KB of fp32 1.4 → 0.5 on
the other side. docs/benchmarks.md has what it does to a step.

The result is the same on both ranks, bit for bit: a sum or a maximum of two operands
does not depend on their order in IEEE arithmetic (``a + b == b + a``), and it is the
number gloo's two-rank ring computes. Groups of other sizes, and other operations, use
gloo's collectives: there the exchange would send ``P − 1`` times the bytes.

Every wait is bounded by the process group's timeout, as gloo's collectives are, and fails
as they do (``DistError``: the launcher tells a failed collective from a bug by it). gloo
checks only a message's size: a peer that sends a tensor of another size makes it abort the
receiving process (the launcher reports the worker's death), and one of the same size but
another shape would go unnoticed. Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` — where torch
checks its collectives' shapes across ranks — the two ranks therefore first exchange a
fingerprint of the call (operation, dtype, shape) and raise on any difference.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

REDUCE_TAG = 1 << 21
"""Tag of the exchange's messages (the pipeline's tags are below ``1 << 21``)."""
GATHER_TAG = REDUCE_TAG + 1
CHECK_TAG = REDUCE_TAG + 2
_COMBINE = {
    dist.ReduceOp.SUM: torch.Tensor.add_,
    dist.ReduceOp.MAX: lambda t, other: torch.maximum(t, other, out=t),
}


def _peer(pg: dist.ProcessGroup | None) -> int | None:
    """The other rank's global rank when ``pg`` has exactly two ranks, else None."""
    if pg is None or dist.get_world_size(pg) != 2:
        return None
    return dist.get_global_rank(pg, 1 - dist.get_rank(pg))


def _check(t: torch.Tensor, what: str, peer: int, pg: dist.ProcessGroup) -> None:
    """Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: raise unless the peer makes the same call
    (``what``: the operation) on a tensor of the same dtype and shape."""
    if dist.get_debug_level() != dist.DebugLevel.DETAIL:
        return
    call = (what, str(t.dtype), tuple(t.shape))
    mine = torch.tensor([t.numel(), t.dim(), zlib.crc32(repr(call).encode())], dtype=torch.int64)
    theirs = torch.empty_like(mine)
    _swap(mine, theirs, peer, pg, CHECK_TAG)
    if not torch.equal(mine, theirs):
        raise RuntimeError(
            f"exchange: rank {dist.get_rank()} called {what} on {t.dtype} {tuple(t.shape)}, "
            f"its peer (rank {peer}) on another dtype or shape "
            f"(numel {int(theirs[0])}, {int(theirs[1])} dims)"
        )


Send = Callable[[Callable[[], "dist.Work"]], "Future[dist.Work]"]
"""How a message is issued later (a link's latency): called with the function that hands
it to gloo, it runs that function in due time and returns the future of its work."""


class Swap:
    """One exchange in flight: ``t`` sent to the peer, its tensor arriving in ``out``.
    :meth:`wait` ends both (bounded by the group's timeout)."""

    def __init__(
        self,
        t: torch.Tensor,
        out: torch.Tensor,
        peer: int,
        pg: dist.ProcessGroup,
        tag: int,
        send: Send | None = None,
    ) -> None:
        self.peer, self.out = peer, out
        recv = dist.irecv(out, src=peer, group=pg, tag=tag)
        if recv is None:  # torch's answer for a rank outside the group
            raise RuntimeError("exchange: this rank is not a member of the group")
        self._recv: dist.Work = recv

        def issue() -> dist.Work:
            work = dist.isend(t, dst=peer, group=pg, tag=tag)
            if work is None:
                raise RuntimeError("exchange: this rank is not a member of the group")
            return work

        self._later = send(issue) if send is not None else None
        self._sent = issue() if self._later is None else None

    def wait(self) -> None:
        try:
            self._recv.wait()
            sent = self._later.result() if self._later is not None else self._sent
            if sent is not None:
                sent.wait()
        except RuntimeError as e:  # a timeout or a lost connection: a failed collective
            if isinstance(e, dist.DistError):
                raise
            raise dist.DistError(f"exchange with rank {self.peer}: {e}") from e


def _swap(t: torch.Tensor, out: torch.Tensor, peer: int, pg: dist.ProcessGroup, tag: int) -> None:
    """Send ``t`` to ``peer`` and receive its tensor into ``out``; both waits bounded."""
    Swap(t, out, peer, pg, tag).wait()


def all_reduce(t: torch.Tensor, pg: dist.ProcessGroup | None, op: Any = dist.ReduceOp.SUM) -> None:
    """In-place all-reduce of ``t`` over ``pg``: one exchange between two ranks (sum or
    max of a contiguous tensor), gloo's collective otherwise."""
    start_all_reduce(t, pg, op).wait()


class Reduction:
    """An all-reduce in flight (:func:`start_all_reduce`); :meth:`wait` leaves the result
    in the tensor it was started on."""

    def __init__(
        self,
        t: torch.Tensor,
        op: Any,
        swap: Swap | None = None,
        work: dist.Work | None = None,
    ) -> None:
        self.t, self._op, self._swap, self._work = t, op, swap, work

    def wait(self) -> torch.Tensor:
        if self._swap is not None:
            self._swap.wait()
            _COMBINE[self._op](self.t, self._swap.out)
        elif self._work is not None:
            self._work.wait()
        self._swap = self._work = None
        return self.t


def start_all_reduce(
    t: torch.Tensor,
    pg: dist.ProcessGroup | None,
    op: Any = dist.ReduceOp.SUM,
    send: Send | None = None,
) -> Reduction:
    """:func:`all_reduce` of ``t`` that returns once its messages are issued: the caller
    computes on while they travel, then waits (``t`` must not be touched before). ``send``
    issues this rank's message (see :data:`Send`). Other group sizes and operations start
    gloo's collective on its worker thread."""
    peer = _peer(pg) if op in _COMBINE and t.is_contiguous() else None
    if peer is None or pg is None:
        work = dist.all_reduce(t, op=op, group=pg, async_op=True)
        return Reduction(t, op, work=work)
    _check(t, f"all_reduce {op}", peer, pg)
    return Reduction(t, op, swap=Swap(t, torch.empty_like(t), peer, pg, REDUCE_TAG, send))


def all_gather(out: list[torch.Tensor], t: torch.Tensor, pg: dist.ProcessGroup | None) -> None:
    """Every rank's ``t`` (equal shapes) into ``out``, in group-rank order: one exchange
    between two ranks, gloo's collective otherwise."""
    peer = _peer(pg) if t.is_contiguous() else None
    if peer is None or pg is None:
        dist.all_gather(out, t, group=pg)
        return
    _check(t, "all_gather", peer, pg)
    me = dist.get_rank(pg)
    _swap(t, out[1 - me], peer, pg, GATHER_TAG)
    out[me].copy_(t)
