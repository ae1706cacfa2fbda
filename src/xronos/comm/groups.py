"""Gloo process groups, made in one place: each bounded by a timeout, and each group's I/O
thread put in ``SCHED_IDLE`` (:mod:`xronos.comm.iothreads`)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch.distributed as dist

from xronos.comm.iothreads import demote_io_threads


def init_world(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """The default gloo group over ``store``, every collective bounded by ``timeout_s``."""
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    demote_io_threads()


def new_group(
    ranks: Sequence[int] | None = None, timeout_s: float | None = None, *, local: bool = False
) -> dist.ProcessGroup:
    """A gloo group over ``ranks`` (the world's when None). ``local``: made by its members
    alone (``use_local_synchronization``); otherwise every rank of the world calls this."""
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    pg = dist.new_group(
        None if ranks is None else list(ranks),
        timeout=timeout,
        backend="gloo",
        use_local_synchronization=local,
    )
    demote_io_threads()
    return pg
