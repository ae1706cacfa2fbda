"""Gloo process groups, made in one place: each bounded by a timeout, and each group's I/O
thread put in ``SCHED_IDLE`` (:mod:`xronos.comm.iothreads`).

**Groups made by their members alone** (``local=True``, torch's
``use_local_synchronization``) are named by torch after their ranks *and the number of
groups the calling process has registered*. A process registers only the groups it is a
member of, so two members with different histories (one was in an earlier subgroup, the
other not) would name the same new group differently, wait for each other under different
store keys, and hang until the timeout. Before such a group is made its members therefore
tell each other, through the default store, how many groups each has registered, and each
one behind registers one-rank placeholder groups until all agree.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

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
    if local and ranks is not None:
        _align_names(sorted(ranks))
    pg = dist.new_group(
        None if ranks is None else list(ranks),
        timeout=timeout,
        backend="gloo",
        use_local_synchronization=local,
    )
    demote_io_threads()
    return pg


_LOCAL_MADE: dict[tuple[int, ...], int] = {}
"""Local groups made so far per set of ranks (the same on every member: all make each)."""
_PLACEHOLDERS: list[dist.ProcessGroup] = []


def _align_names(ranks: list[int]) -> None:
    """Bring this member's count of registered groups up to the largest among ``ranks``
    (see the module docstring); nothing where torch keeps no such count."""
    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    me = dist.get_rank()
    if names is None or me not in ranks:
        return
    key = tuple(ranks)
    made = _LOCAL_MADE.get(key, 0)
    _LOCAL_MADE[key] = made + 1
    store = c10d._get_default_store()
    prefix = f"xronos/local/{'_'.join(map(str, key))}/{made}"
    store.set(f"{prefix}/{me}", str(len(names)))
    most = max(int(store.get(f"{prefix}/{r}")) for r in key)  # waits: the store's timeout
    while len(names) < most:
        _PLACEHOLDERS.append(dist.new_group([me], backend="gloo", use_local_synchronization=True))
