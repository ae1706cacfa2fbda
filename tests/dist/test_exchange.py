"""Two ranks' all-reduce and all-gather as one exchange (:mod:`xronos.comm.exchange`), on
real gloo ranks: the same numbers as gloo's own collectives, bit for bit, on the world and
on a two-rank subgroup; larger groups use gloo's; a peer that never answers ends in the
group's timeout."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.world import WorkerContext, run_world
from xronos.comm import exchange
from xronos.comm.groups import new_group

# Sizes: one value, an odd length, an activation of 4 x 64 tokens x hidden 512 (plus 3, so
# that no length is a multiple of a segment).
SIZES = (1, 1001, 4 * 64 * 512 + 3)
DTYPES = (torch.float32, torch.bfloat16)
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _inputs(rank: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own numbers
    return [(f"{n}/{dt}", torch.randn(n, generator=gen).to(dt)) for n in SIZES for dt in DTYPES]


def _compare(pg: dist.ProcessGroup, rank: int) -> dict[str, Any]:
    """Per input and op: the exchange's result, gloo's result, and whether they match."""
    out: dict[str, Any] = {}
    for key, x in _inputs(rank):
        for name, op in OPS.items():
            mine, ref = x.clone(), x.clone()
            exchange.all_reduce(mine, pg, op)
            dist.all_reduce(ref, op=op, group=pg)
            out[f"{name}/{key}"] = (mine, torch.equal(mine, ref))
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(pg))]
        refs = [torch.empty_like(x) for _ in parts]
        exchange.all_gather(parts, x, pg)
        dist.all_gather(refs, x, group=pg)
        out[f"gather/{key}"] = (
            parts,
            all(torch.equal(a, b) for a, b in zip(parts, refs, strict=True)),
        )
    return out


def _world(ctx: WorkerContext, _: object) -> dict[str, Any]:
    assert ctx.group.pg is not None
    return _compare(ctx.group.pg, ctx.rank)


def test_two_ranks_exchange_gives_gloos_numbers_on_both_ranks() -> None:
    a, b = run_world(_world, 2)
    assert a.keys() == b.keys() and len(a) == 3 * len(SIZES) * len(DTYPES)
    for key in a:
        assert a[key][1] and b[key][1], key  # equal to gloo's collective, bit for bit
        if key.startswith("gather/"):
            assert all(torch.equal(x, y) for x, y in zip(a[key][0], b[key][0], strict=True)), key
        else:
            assert torch.equal(a[key][0], b[key][0]), key  # the same on both ranks
    # and it is a reduction of both ranks' inputs, not a copy of one of them
    x0, x1 = _inputs(0)[2][1], _inputs(1)[2][1]
    assert torch.equal(a["sum/" + _inputs(0)[2][0]][0], x0 + x1)
    assert torch.equal(a["max/" + _inputs(0)[2][0]][0], torch.maximum(x0, x1))
    assert torch.equal(a["gather/" + _inputs(0)[2][0]][0][1], x1)


def _subgroups(ctx: WorkerContext, _: object) -> dict[str, Any] | None:
    pair = new_group([0, 2])  # every rank takes part in making each group
    trio = new_group([0, 1, 2])
    out: dict[str, Any] = {"trio": _compare(trio, ctx.rank)}
    if ctx.rank != 1:
        out["pair"] = _compare(pair, ctx.rank)
    return out


def test_a_pair_inside_a_larger_world_and_a_group_of_three() -> None:
    results = run_world(_subgroups, 3)
    for rank in (0, 2):  # the pair {0, 2}: global ranks of its peer, not group ranks
        assert all(ok for _, ok in results[rank]["pair"].values())
    for r in results:  # three ranks: gloo's collectives themselves
        assert all(ok for _, ok in r["trio"].values())
    key = "sum/" + _inputs(0)[0][0]
    assert torch.equal(results[0]["pair"][key][0], _inputs(0)[0][1] + _inputs(2)[0][1])


def _silent_peer(ctx: WorkerContext, timeout_s: float) -> str | None:
    pg = new_group(None, timeout_s)
    if ctx.rank == 1:
        time.sleep(3 * timeout_s)  # alive, but never takes part
        return None
    start = time.monotonic()
    try:
        exchange.all_reduce(torch.ones(4), pg)
    except dist.DistError as e:  # what the launcher takes for a failed collective
        return f"{time.monotonic() - start:.1f} s: {e}"
    return "returned"


def test_a_peer_that_never_answers_ends_in_the_groups_timeout() -> None:
    got, _ = run_world(_silent_peer, 2, 1.0)
    assert got is not None and "Timed out" in got, got
    # bounded by the group's 1 s timeout (generous upper bound: a loaded host's scheduling)
    assert float(got.split(" s:")[0]) < 10.0


def _mismatch(ctx: WorkerContext, _: object) -> str:
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # as the test suite runs; checks shapes
    assert ctx.group.pg is not None
    shape = (2, 3) if ctx.rank == 0 else (3, 2)  # the same size: gloo alone cannot tell
    try:
        exchange.all_reduce(torch.ones(shape), ctx.group.pg)
    except RuntimeError as e:
        return str(e)
    return "returned"


def test_a_shape_mismatch_raises_under_distributed_debug() -> None:
    for got in run_world(_mismatch, 2):
        assert "another dtype or shape" in got, got
