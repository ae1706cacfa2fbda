"""Groups made by their members alone (:func:`xronos.comm.groups.new_group` with
``local=True``) on real gloo ranks, after groups not every rank was a member of."""

from __future__ import annotations

import torch

from tests.dist.world import WorkerContext, run_world
from xronos.comm import exchange
from xronos.comm.groups import new_group


def _local_after_subgroup(ctx: WorkerContext, _: object) -> float | None:
    new_group([0, 1])  # every rank takes part; rank 2 is not a member and registers nothing
    if ctx.rank == 0:
        return None
    pg = new_group([1, 2], 10.0, local=True)  # ranks 1 and 2 alone, with different histories
    t = torch.ones(1)
    exchange.all_reduce(t, pg)
    return float(t)


def test_a_group_of_its_members_alone_after_a_subgroup_not_all_were_in() -> None:
    # torch names such a group after the groups each member has registered: without the
    # alignment ranks 1 and 2 wait for each other under different names until the timeout
    assert run_world(_local_after_subgroup, 3, timeout_s=60) == [None, 2.0, 2.0]
