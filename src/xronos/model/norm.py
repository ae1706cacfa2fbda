"""RMSNorm with a hand-written backward: half the passes over the activation.

Every device of a tensor-parallel group normalises the whole hidden state before each
block (the norms are replicated, not split), so their cost is paid once per device: on a
device a tenth as fast, ten times over. Autograd's graph of the Hugging Face formula
(``w * (x * rsqrt(mean(x²) + eps))``) keeps and revisits five intermediates; the backward
below needs the normalised input and the per-row scale only::

    forward:   r  = rsqrt(mean(x²) + eps)          one value per row
               x̂  = x · r,   y = x̂ · w
    backward:  g' = g · w
               dx = (g' − x̂ · mean(g' · x̂)) · r
               dw = Σ_rows g · x̂

The forward is the formula's, operation for operation, so outputs are bit-identical to
the composite; the input gradient is the same expression with its terms in another order
(within a unit in the last place of fp32). Measured on one core (batch 4 × 64, hidden
512): 0.33–0.38 ms forward + backward against 0.83–0.87 ms for the composite. Inputs or
weights other than fp32 take the composite formula (its casts are part of the
Hugging Face result).
"""

from __future__ import annotations

import torch
from torch import nn


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        xh = x * r
        ctx.save_for_backward(xh, r, weight)
        return weight * xh

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:  # type: ignore[override]
        xh, r, weight = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gw = g * weight
            dx = (gw - xh * (gw * xh).mean(-1, keepdim=True)) * r
        if ctx.needs_input_grad[1]:
            dw = (g * xh).reshape(-1, xh.shape[-1]).sum(0)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x², -1) + eps))``, computed in fp32 as Hugging Face's
    Llama does (see the module docstring for the backward)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return _RMSNormFn.apply(x, weight, eps)  # type: ignore[no-any-return]
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
