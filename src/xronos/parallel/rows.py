"""The row-parallel seam fused with the projection before it: the forward all-reduce
travels in two halves, the first while the second is computed.

Unfused, a sharded block ends with its row-parallel projection (o; down) and then
``reduce_from_tp``: the device computes the whole partial output, then waits while it
travels. Fused, the tokens are cut in two (every row of the output is one token's)::

    forward:   y₁ = x₁ Wᵀ                    the first half of the tokens, this rank's part
               start all_reduce(y₁)          issued, not waited on
               y₂ = x₂ Wᵀ                    computed while y₁ travels
               start all_reduce(y₂)
               wait y₁, wait y₂              y = [y₁; y₂]: every rank's sum
    backward:  dx = dy W,  dW = dyᵀ x        whole, as unfused (the seam's backward is the
                                             identity, so no message)

Each output row is the unfused one's: the same row of products and the same two-operand sum
of the ranks' parts (the exchange's sum does not depend on their order). The backward runs
on the whole batch, so the weight gradient is written once, not once per half, as it would
be if the halves were separate passes (which costs a CPU ~18 % on the ``small`` preset).
What the cut costs is one more message per seam (its latency) and two GEMMs of half the rows
in place of one. Both halves' waits are recorded under the seam's name (``<name>.fwd``).

A projection that is not a plain bias-free ``nn.Linear`` (a LoRA-wrapped base), a step under
autocast, fewer than two tokens and a group running overlap lanes use the unfused seam.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from xronos.comm.mappings import TPGroup, reduce_from_tp, start_reduce_activation
from xronos.metrics.records import COLLECTIVE

PARTS = 2
"""Pieces the tokens are cut into: the first travels while the second computes."""


def halves(n: int, parts: int = PARTS) -> list[tuple[int, int]]:
    """``parts`` contiguous row ranges covering ``[0, n)``, the first ones no shorter."""
    step, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        end = start + step + (1 if k < extra else 0)
        out.append((start, end))
        start = end
    return out


def _tokens(x: torch.Tensor) -> int:
    """Rows of ``x`` (N, ..., K): one per token, whatever ``K`` (0 on a rank without columns)."""
    return math.prod(x.shape[:-1])


class _SeamRows(torch.autograd.Function):
    """Forward: the projection and its all-reduce, half by half. Backward: see the module
    docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: torch.Tensor, weight: torch.Tensor, group: TPGroup, name: str, kind: str
    ) -> torch.Tensor:
        x2 = x.reshape(_tokens(x), x.shape[-1])  # explicit: a rank may hold no columns
        pending = [
            start_reduce_activation(F.linear(x2[a:b], weight), group, name + ".fwd", kind)
            for a, b in halves(x2.shape[0])
        ]
        y = torch.cat([p.wait() for p in pending])
        ctx.save_for_backward(x, weight)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        n = _tokens(x)
        dy2 = dy.reshape(n, weight.shape[0])
        dx = (dy2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = dy2.t() @ x.reshape(n, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


def fusable(linear: nn.Module, x: torch.Tensor, group: TPGroup) -> bool:
    """Whether ``linear`` can run fused with the seam after it (see the module docstring)."""
    return (
        type(linear) is nn.Linear
        and linear.bias is None
        and not torch.is_autocast_enabled("cpu")
        and not group.lanes
        and _tokens(x) >= PARTS
    )


class RowSeam(nn.Module):
    """The ``exit`` seam of a sharded block: ``reduce_from_tp`` when called, and
    :meth:`project` for the projection before it (see the module docstring)."""

    def __init__(self, group: TPGroup, name: str, kind: str = COLLECTIVE) -> None:
        super().__init__()
        self.group, self.name, self.kind = group, name, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(x, self.group, self.name, self.kind)

    def project(self, x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        """``self(linear(x))``, fused where it can be."""
        if self.group.size == 1 or not fusable(linear, x, self.group):
            return self(linear(x))
        weight = linear.weight  # type: ignore[union-attr]
        return _SeamRows.apply(x, weight, self.group, self.name, self.kind)  # type: ignore[no-any-return]
