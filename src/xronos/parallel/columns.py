"""The column-parallel seam fused with the projections it feeds: the input-gradient
all-reduce overlaps the weight gradients.

Unfused, a sharded block's input seam is ``copy_to_tp`` followed by the column-parallel
projections (q, k, v; gate, up; the LM head), and its backward computes every
projection's input *and* weight gradient before the all-reduce of the input gradient
starts; the device then waits on the wire doing nothing. Fused (as Megatron-LM's
column-parallel linear overlaps its all-reduce with the weight-gradient GEMM)::

    forward:   y_i = x W_iᵀ + b_i                            (N, H) -> (N, out_i), no message
    backward:  dx  = Σ_i dy_i W_i                            this rank's partial  (N, H)
               start all_reduce(dx)                          issued, not waited on
               dW_i = dy_iᵀ x,  db_i = Σ_n dy_i              compute while dx travels
               wait                                          dx: the sum of every rank's

The arithmetic is the unfused one's, term for term: the same products and sums, the
input gradient's partial sums added in projection order. Only the time of the wait moves;
it is recorded as the seam's collective (``<name>.bwd``), the weight gradients before it as
compute.

A projection that is not a plain ``nn.Linear`` (a LoRA-wrapped base, whose weight gets no
gradient) and a step under autocast use the unfused seam.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from xronos.comm.mappings import TPGroup, copy_to_tp, start_reduce_activation
from xronos.metrics.records import COLLECTIVE


class _SeamColumns(torch.autograd.Function):
    """Forward: the projections of ``x``. Backward: see the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: torch.Tensor,
        group: TPGroup,
        name: str,
        kind: str,
        *params: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        weights = [w for w in params[0::2] if w is not None]
        biases = params[1::2]
        ctx.group, ctx.name, ctx.kind = group, name, kind
        ctx.has_bias = tuple(b is not None for b in biases)
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *dys: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        h = x.shape[-1]
        x2 = x.reshape(-1, h)
        n = x2.shape[0]  # explicit: a projection may have no local rows
        flat = [dy.reshape(n, w.shape[0]) for dy, w in zip(dys, weights, strict=True)]
        pending = None
        if ctx.needs_input_grad[0]:  # else, as unfused, no input gradient and no all-reduce
            dx = flat[0] @ weights[0]
            for dy, w in zip(flat[1:], weights[1:], strict=True):
                dx = dx + dy @ w
            pending = start_reduce_activation(
                dx.view(x.shape), ctx.group, ctx.name + ".bwd", ctx.kind
            )
        grads: list[torch.Tensor | None] = []
        for k, (dy, has_bias) in enumerate(zip(flat, ctx.has_bias, strict=True)):
            needs_w, needs_b = ctx.needs_input_grad[4 + 2 * k], ctx.needs_input_grad[5 + 2 * k]
            grads.append(dy.t() @ x2 if needs_w else None)
            grads.append(dy.sum(0) if has_bias and needs_b else None)
        return (pending.wait() if pending is not None else None, None, None, None, *grads)


def fusable(linears: Sequence[nn.Module]) -> bool:
    """Whether ``linears`` can run fused with the seam before them (plain ``nn.Linear``
    outside autocast)."""
    return all(type(m) is nn.Linear for m in linears) and not torch.is_autocast_enabled("cpu")


def project_columns(
    x: torch.Tensor, group: TPGroup, name: str, kind: str, linears: Sequence[nn.Module]
) -> tuple[torch.Tensor, ...]:
    """``tuple(lin(copy_to_tp(x)) for lin in linears)``, fused where it can be."""
    if group.size == 1 or not fusable(linears):
        y = copy_to_tp(x, group, name, kind)
        return tuple(lin(y) for lin in linears)
    params: list[torch.Tensor | None] = []
    for lin in linears:
        params += [lin.weight, lin.bias]  # type: ignore[list-item]
    return tuple(_SeamColumns.apply(x, group, name, kind, *params))


class ColumnSeam(nn.Module):
    """The ``enter`` seam of a sharded block: ``copy_to_tp`` when called, and
    :meth:`project` for the projections that follow it (see the module docstring)."""

    def __init__(self, group: TPGroup, name: str, kind: str = COLLECTIVE) -> None:
        super().__init__()
        self.group, self.name, self.kind = group, name, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(x, self.group, self.name, self.kind)

    def project(self, x: torch.Tensor, linears: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
        """The projections ``linears`` of this seam's output (see :func:`project_columns`)."""
        return project_columns(x, self.group, self.name, self.kind, linears)
