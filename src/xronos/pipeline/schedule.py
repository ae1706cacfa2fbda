"""Pipeline schedules at run time: micro-batches and the point-to-point messages between
stages.

Which stage runs which micro-batch's forward ``F(i)`` and backward ``B(i)`` in which order
(GPipe, 1F1B) is the planner's (:mod:`xronos.planner.schedules`, which also times it);
this module cuts the step's batches into micro-batches and moves the data.

Messages (``<msg>`` per the convention of :mod:`xronos.metrics.analysis`)::

    act/mb{i}/{j}->{j+1}    activations (B_i, S, H) of micro-batch i, forward direction
    grad/mb{i}/{j+1}->{j}   their gradient (B_i, S, H), backward direction

All receives of a step are posted (``irecv``) before the step's first computation, so data
arrives in the background while the stage computes; sends are ``isend`` and only waited on
at the end of the step. Each message has its own gloo tag, so posting order does not matter.
Recorded spans:

* ``recv:<msg>`` from the moment the stage starts waiting for the data until it is there;
* ``send:<msg>`` around issuing the ``isend`` (the sender does not block there); the
  receiver's idle therefore ends when the sender issued the data, the rest is transfer;
* ``drain:stage{j}`` around waiting for this step's sends to complete (a wait with no
  partner: the analysis counts it as idle).

On a group with link latency (:mod:`xronos.comm.links`) a send is handed to gloo
``l_src + l_dst`` after it was issued, by a timer thread: the stage computes on and the
receiver cannot have the data any sooner.

Every wait is bounded by ``timeout_s``; a timeout raises an error naming the message and
the peer stage's device.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed as dist

from xronos.comm.mappings import TPGroup
from xronos.errors import UserError
from xronos.metrics.recorder import current_recorder
from xronos.train.batches import Batch


def split_microbatches(batches: Sequence[Batch], m: int) -> list[Batch]:
    """Cut the step's gradient-accumulation batches into ``m`` pipeline micro-batches.

    Each of the ``k = len(batches)`` batches is split along the batch dim into ``m / k``
    parts of (nearly) equal size, in order; ``m`` must be a multiple of ``k`` and no part
    may be empty. The loss is normalised by the whole step's label count, so the split
    changes only the order of floating-point sums, not the result.
    """
    k = len(batches)
    if k == 0:
        raise ValueError("a training step needs at least one batch")
    if m % k:
        raise UserError(
            f"pipeline: {m} micro-batches cannot be cut evenly from {k} accumulation batches; "
            f"set the micro-batch count to a multiple of {k}"
        )
    parts = m // k
    out: list[Batch] = []
    for ids, labels in batches:
        if ids.shape[0] < parts:
            raise UserError(
                f"pipeline: a batch of {ids.shape[0]} sequences cannot make {parts} "
                f"micro-batches; raise the batch size or lower the micro-batch count"
            )
        out += zip(ids.tensor_split(parts), labels.tensor_split(parts), strict=True)
    return out


ACT_TAG, GRAD_TAG, TIED_TAG, TIED_ROWS_TAG = 0, 1, 1 << 20, (1 << 20) + 1


def act_tag(mb: int) -> int:
    return 2 * mb + ACT_TAG


def grad_tag(mb: int) -> int:
    return 2 * mb + GRAD_TAG


def _issued(work: dist.Work | None, msg: str) -> dist.Work:
    if work is None:  # torch returns None when this rank is not in the group
        raise RuntimeError(f"pipeline: {msg} was not issued: this rank is not in the group")
    return work


class P2P:
    """This stage's in-flight point-to-point messages for one step.

    Peers are the group's ranks: ``src``/``dst`` index ``devices`` and ``ranks``.

    Args:
        group: the pipeline's group.
        devices: device name per group rank (for error messages).
        timeout_s: bound on every wait.
        ranks: the global rank of each group rank (default: the same numbers).
    """

    def __init__(
        self,
        group: TPGroup,
        devices: Sequence[str],
        timeout_s: float,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.group, self.devices = group, tuple(devices)
        # group rank -> global rank (torch's point-to-point calls take global ranks)
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(len(self.devices)))
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._recvs: dict[str, tuple[dist.Work, torch.Tensor, int]] = {}
        self._sends: list[tuple[str, Future[dist.Work], torch.Tensor, int]] = []

    def post_recv(self, msg: str, src: int, buf: torch.Tensor, tag: int) -> None:
        """Start receiving ``msg`` from rank ``src`` into ``buf`` (returns at once)."""
        work = dist.irecv(buf, src=self.ranks[src], group=self.group.pg, tag=tag)
        self._recvs[msg] = (_issued(work, msg), buf, src)

    def wait_recv(self, msg: str) -> torch.Tensor:
        """Block until ``msg`` has arrived (span ``recv:<msg>``) and return its buffer."""
        work, buf, src = self._recvs.pop(msg)
        with current_recorder().collective("recv:" + msg):
            self._wait(work, msg, src, "receiving")
        return buf

    def send(self, msg: str, dst: int, t: torch.Tensor, tag: int) -> None:
        """Start sending ``t`` to rank ``dst`` (span ``send:<msg>`` around the issue only)."""
        t, peer = t.contiguous(), self.ranks[dst]
        links = self.group.links if self.group.delays() is not None else None

        def issue() -> dist.Work:
            return _issued(dist.isend(t, dst=peer, group=self.group.pg, tag=tag), msg)

        with current_recorder().collective("send:" + msg):
            if links is not None:  # link latency (and rate): gloo gets it when it could arrive
                nbytes = t.numel() * t.element_size()
                work = links.send_later(dist.get_rank(), peer, issue, nbytes=nbytes)
            else:
                work = Future()
                work.set_result(issue())
        self._sends.append((msg, work, t, dst))  # keeps ``t`` alive until sent

    def drain(self) -> None:
        """Wait for every send of this step to complete (span ``drain:stage{j}``)."""
        if not self._sends and not self._recvs:
            return
        if self._recvs:
            raise RuntimeError(f"pipeline: step ended with unreceived messages {list(self._recvs)}")
        with current_recorder().collective(f"drain:stage{self.group.rank}"):
            for msg, issued, _, dst in self._sends:
                self._wait(self._issued_work(issued, msg, dst), msg, dst, "sending")
        self._sends.clear()

    def abandon(self) -> None:
        """Forget in-flight messages after a failure (the process group is torn down next)."""
        for _, issued, _, _ in self._sends:
            issued.cancel()  # a send still held back by link latency is never issued
        self._recvs.clear()
        self._sends.clear()

    def _issued_work(self, issued: Future[dist.Work], msg: str, dst: int) -> dist.Work:
        """The send's gloo work, once the link's latency has let it go."""
        try:
            return issued.result(self.timeout.total_seconds())
        except FutureTimeout:
            raise TimeoutError(self._stuck(msg, dst, "sending", "never issued")) from None

    def _wait(self, work: dist.Work, msg: str, peer: int, what: str) -> None:
        try:
            done = work.wait(self.timeout)
        except RuntimeError as e:
            lines = str(e).strip().splitlines()
            raise TimeoutError(self._stuck(msg, peer, what, lines[-1] if lines else "")) from e
        if done is False:
            raise TimeoutError(self._stuck(msg, peer, what, ""))

    def _stuck(self, msg: str, peer: int, what: str, cause: str) -> str:
        name = self.devices[peer] if peer < len(self.devices) else f"rank {peer}"
        secs = self.timeout.total_seconds()
        return (
            f"pipeline: {what} {msg} with rank {peer} (device {name!r}) did not finish "
            f"within {secs:.0f} s; that device is stuck or gone ({cause or 'timed out'})"
        )
