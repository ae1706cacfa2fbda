"""RMSNorm's hand-written backward against autograd of the Hugging Face formula."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from xronos.model.norm import _RMSNormFn, rms_norm

EPS = 1e-6


def _composite(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm, differentiated by autograd."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return w * x32.to(x.dtype)


def _grads(
    f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = f(x, w)
    y.backward(g)
    assert x.grad is not None and w.grad is not None
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("shape", [(4, 64, 512), (2, 3, 5, 32)])  # hidden; per-head (qk_norm)
def test_fp32_matches_the_composite(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 3.0
    w = 1.0 + 0.1 * torch.randn(shape[-1], generator=gen)
    g = torch.randn(shape, generator=gen)
    y0, dx0, dw0 = _grads(_composite, x, w, g)
    y1, dx1, dw1 = _grads(lambda a, b: rms_norm(a, b, EPS), x, w, g)
    assert torch.equal(y1, y0)  # the forward is the formula's, operation for operation
    # The input gradient sums the same terms in another order: a few ulps of fp32 on
    # values of order 1 (1e-5 relative would be ~100 ulps).
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw1, dw0, rtol=1e-5, atol=1e-5)
    assert not torch.equal(dx1, torch.zeros_like(dx1))


def test_the_backward_is_the_derivative() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFn.apply(a, b, EPS), (x, w))


def test_a_frozen_weight_gets_no_gradient_and_other_dtypes_take_the_formula() -> None:
    x = torch.randn(2, 8, 16, requires_grad=True)
    w = torch.ones(16)  # frozen (LoRA fine-tuning)
    rms_norm(x, w, EPS).sum().backward()
    assert x.grad is not None and w.grad is None
    xb = torch.randn(2, 8, 16).to(torch.bfloat16)
    wb = torch.ones(16, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(xb, wb, EPS), _composite(xb, wb))
