"""The column seam fused with its projections (:mod:`xronos.parallel.columns`) on real gloo
ranks: a started all-reduce is in flight while its rank does other work, and the fused
backward gives the unfused seam's gradients."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.dist.world import WorkerContext, run_world
from xronos.comm import exchange
from xronos.comm.mappings import TPGroup, copy_to_tp
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.parallel.columns import project_columns

DONE_TAG = 7  # a message outside the exchange's tags


def _in_flight(ctx: WorkerContext, size: int) -> torch.Tensor:
    """Rank 0 starts an all-reduce and, before waiting on it, blocks until rank 1 says
    its own (ordinary, blocking) all-reduce has ended; rank 1's can end only if rank 0's
    message was already sent. Were it sent in ``wait()``, both would block until the
    group's timeout."""
    pg = ctx.group.pg
    assert pg is not None
    t = torch.full((size,), float(ctx.rank + 1))
    done = torch.zeros(1)
    if ctx.rank == 0:
        pending = exchange.start_all_reduce(t, pg)
        dist.recv(done, src=1, group=pg, tag=DONE_TAG)
        out = pending.wait()
        assert float(done[0]) == 1.0
        return out
    exchange.all_reduce(t, pg)
    dist.send(torch.ones(1), dst=0, group=pg, tag=DONE_TAG)
    return t


def test_a_started_all_reduce_travels_while_its_rank_does_other_work() -> None:
    # One float and an activation of 4 x 64 tokens x hidden 512 in fp32 (gloo may send a
    # small message at once and a large one in pieces).
    for size in (1, 4 * 64 * 512):
        a, b = run_world(_in_flight, 2, size, timeout_s=30.0)
        assert torch.equal(a, torch.full((size,), 3.0)) and torch.equal(a, b)


def _grads(ctx: WorkerContext, fused: bool, input_grad: bool = True) -> dict[str, Any]:
    """One projection block's gradients on this rank: three linears (one with a bias, one
    with no local rows) after the seam, fused or as copy_to_tp then each linear."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, 16, generator=gen)  # the same input on both ranks, as a seam's
    rows = (6, 0, 4) if ctx.rank == 0 else (2, 5, 3)
    torch.manual_seed(11 + ctx.rank)
    linears = [nn.Linear(16, r, bias=(k == 0)) for k, r in enumerate(rows)]
    x.requires_grad_(input_grad)
    group = ctx.group
    rec = SpanRecorder(group.rank, enabled=True)
    rec.start_step(0)
    with use_recorder(rec):
        if fused:
            outs = project_columns(x, group, "seam", "attn", linears)
        else:
            y = copy_to_tp(x, group, "seam", "attn")
            outs = tuple(lin(y) for lin in linears)
        loss = sum((o * (k + 1)).square().sum() for k, o in enumerate(outs))
        loss.backward()
    record = rec.end_step()
    assert record is not None and (x.grad is not None) == input_grad
    return {
        "x": x.grad,
        "params": [p.grad for lin in linears for p in lin.parameters()],
        "collectives": [c.name for c in record.collectives],
        "outs": [o.detach() for o in outs],
    }


def _both(ctx: WorkerContext, autocast: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    assert isinstance(ctx.group, TPGroup)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return _grads(ctx, True), _grads(ctx, False)


def test_the_fused_seam_gives_the_unfused_gradients() -> None:
    results = run_world(_both, 2, False)
    for fused, plain in results:
        assert fused["collectives"] == plain["collectives"] == ["seam.bwd"]
        for a, b in zip(fused["outs"], plain["outs"], strict=True):
            assert torch.equal(a, b)  # the same F.linear in the forward
        for a, b in zip(fused["params"], plain["params"], strict=True):
            assert torch.equal(a, b)  # weight and bias gradients: the same products
        # The input gradient adds the three projections' parts in another order than
        # autograd's accumulation: fp32 rounding of a sum of three terms, ~1e-7 relative.
        torch.testing.assert_close(fused["x"], plain["x"], rtol=1e-5, atol=1e-6)
        assert fused["x"].abs().max() > 0
    a, b = results
    assert torch.equal(a[0]["x"], b[0]["x"])  # reduced: the same on both ranks


def test_under_autocast_the_seam_runs_unfused() -> None:
    # bf16 products with fp32 weights: the fused backward's fp32 arithmetic does not apply,
    # so the seam runs the unfused way and gives its numbers exactly.
    for fused, plain in run_world(_both, 2, True):
        assert fused["outs"][0].dtype == torch.bfloat16
        assert torch.equal(fused["x"], plain["x"])
        for a, b in zip(fused["params"], plain["params"], strict=True):
            assert torch.equal(a, b)


def _frozen_input(ctx: WorkerContext, _: object) -> tuple[dict[str, Any], dict[str, Any]]:
    return _grads(ctx, True, input_grad=False), _grads(ctx, False, input_grad=False)


def test_an_input_without_gradient_sends_nothing_as_unfused() -> None:
    # e.g. the first block's input under LoRA: no input gradient, so no all-reduce
    for fused, plain in run_world(_frozen_input, 2):
        assert fused["collectives"] == plain["collectives"] == []
        for a, b in zip(fused["params"], plain["params"], strict=True):
            assert torch.equal(a, b)
