"""The row seam fused with the projection before it (:mod:`xronos.parallel.rows`) on real
gloo ranks: the all-reduce goes in two halves, and the outputs and gradients are the
unfused seam's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.dist.world import WorkerContext, run_world
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.parallel.rows import RowSeam, halves


def test_halves_cover_the_rows_in_order() -> None:
    for n in (2, 3, 7, 256):
        parts = halves(n)
        assert parts[0][0] == 0 and parts[-1][1] == n and len(parts) == 2
        assert parts[0][1] == parts[1][0] and parts[0][1] - parts[0][0] >= n - parts[0][1] > 0


def _run(ctx: WorkerContext, fused: bool, columns: int, shape: tuple[int, int]) -> dict[str, Any]:
    """One row-parallel projection (this rank's ``columns`` inputs of it) and its seam on
    a batch of ``shape`` (sequences, tokens), fused or as the projection then
    ``reduce_from_tp``."""
    torch.manual_seed(3 + ctx.rank)
    x = torch.randn(*shape, columns, requires_grad=True)  # this rank's part of the input
    linear = nn.Linear(columns, 16, bias=False)
    seam = RowSeam(ctx.group, "seam", "mlp")
    rec = SpanRecorder(ctx.group.rank, enabled=True)
    rec.start_step(0)
    with use_recorder(rec):
        y = seam.project(x, linear) if fused else seam(linear(x))
        (y * torch.linspace(-1, 1, 16)).square().sum().backward()
    record = rec.end_step()
    assert record is not None
    return {
        "y": y.detach(),
        "x": x.grad,
        "w": linear.weight.grad,
        "collectives": [c.name for c in record.collectives],
    }


def _both(ctx: WorkerContext, second: int) -> tuple[dict[str, Any], dict[str, Any]]:
    cols = 5 if ctx.rank == 0 else second
    return _run(ctx, True, cols, (2, 7)), _run(ctx, False, cols, (2, 7))


def test_the_halves_give_the_unfused_outputs_and_gradients() -> None:
    # ranks with 5 and 8 input columns; then rank 1 with none (it still sends its zeros)
    for second in (8, 0):
        results = run_world(_both, 2, second)
        for fused, plain in results:
            assert fused["collectives"] == ["seam.fwd", "seam.fwd"]  # two halves
            assert plain["collectives"] == ["seam.fwd"]
            # Each output row: the same dot products (a GEMM's row does not depend on how
            # many other rows it computes with here) and the same two-operand sum.
            torch.testing.assert_close(fused["y"], plain["y"], rtol=0, atol=0)
            # the backward is the whole batch's, as autograd's for the unfused projection
            assert torch.equal(fused["x"], plain["x"]) and torch.equal(fused["w"], plain["w"])
            assert fused["y"].abs().max() > 0
        (a, _), (b, _) = results
        assert torch.equal(a["y"], b["y"])  # reduced: the same on both ranks


def _one_token(ctx: WorkerContext, _: object) -> dict[str, Any]:
    return _run(ctx, True, 4, (1, 1)) | {"autocast": _autocast(ctx)}


def _autocast(ctx: WorkerContext) -> list[str]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _run(ctx, True, 4, (2, 6))["collectives"]


def test_one_token_and_autocast_run_unfused() -> None:
    for r in run_world(_one_token, 2):
        assert r["collectives"] == ["seam.fwd"]  # nothing to cut
        assert r["autocast"] == ["seam.fwd"]  # bf16 products: the unfused seam's numbers
