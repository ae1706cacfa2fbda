"""The LM head's product and its cross-entropy, as a training step runs them.

**A weight gradient that accumulates in place.** With tied embeddings the output embedding
``W (V, H)`` gets two gradients a step: the head's (``gᵀ · h``, from the product) and the
embedding lookup's (rows scattered into a zeroed ``(V, H)``). Autograd adds the second to
the first in place only when it holds the first's only reference to a dense, unshared
tensor; ``nn.Linear``'s gradient of ``W`` comes out of its ``mm`` backward through
transposes, and autograd then adds the two out of place: a fresh ``(V, H)`` written on every
step (``small``: 16 MB, 8.7 ms of a 0.45 s step on one core). :func:`head_logits` computes
the same product with a backward that returns the gradient as a fresh ``mm`` result, which
autograd accumulates in place. The forward is ``nn.Linear``'s product; the gradients are
the same products (``g · W`` and ``gᵀ · h``).

**The head in chunks of tokens** (:func:`chunked_loss_sum`, with activation
checkpointing). A step's logits are ``N × V`` floats, and the cross-entropy keeps them (or
their log-softmax) for its backward, which writes as many again: at long sequences the
largest tensors of a step (``small`` at 8 × 512 tokens: 4,088 × 32,000 × 4 B = 523 MB a
copy). In chunks of :data:`CHUNK_TOKENS` tokens the forward keeps, per token, only the
log-sum-exp of its logits and its target's logit (what the vocab-parallel cross-entropy
exchanges, :mod:`xronos.parallel.vocab`); the backward computes each chunk's logits again
and turns them into their gradient in place::

    forward   z_c = h_c Wᵀ;  lse_c, t_c from z_c      z_c dropped (the last chunk's kept)
              loss = Σ_n (lse_n − t_n)                lse, t gathered across ranks first
    backward  z_c = h_c Wᵀ  (again)                   dz_c = exp(z_c − lse_c) − onehot(y_c)
              dh_c = dz_c W,  dW += dz_cᵀ h_c

One product of the head more per chunk recomputed (all but the last), for at most two
chunks of logits alive at once instead of two or three step's worth. A step of one chunk
or fewer tokens keeps the head's own path: nothing to save there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

CHUNK_TOKENS = 512
"""Tokens a chunk of the chunked head (:func:`chunked_loss_sum`); a step of no more tokens
keeps the head's own path (:func:`chunks`)."""

Gather = Callable[[torch.Tensor], list[torch.Tensor]]
"""Every rank's ``(2, N)`` statistics from this rank's (:func:`one_rank` on one device)."""


def one_rank(stats: torch.Tensor) -> list[torch.Tensor]:
    """The :data:`Gather` of one device: its statistics are every rank's."""
    return [stats]


def _starts(tokens: int, rows: int) -> range:
    """Where each chunk of ``tokens`` begins (none for a rank without vocabulary rows)."""
    return range(0, tokens if rows else 0, CHUNK_TOKENS)


class _HeadProduct(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, h: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(h, w)
        return h @ w.t()

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        h, w = ctx.saved_tensors  # type: ignore[attr-defined]
        need_h, need_w = ctx.needs_input_grad  # type: ignore[attr-defined]
        return (g @ w if need_h else None), (g.t() @ h if need_w else None)


def plain(lm_head: nn.Module, h: torch.Tensor) -> bool:
    """Whether ``lm_head`` is a plain bias-free ``nn.Linear`` with fp32 weight and ``h`` an
    fp32 input outside autocast (what :func:`head_logits` and :func:`chunked_loss_sum`
    take; an adapter's wrapper, a bias, other dtypes keep the module's own path)."""
    return (
        type(lm_head) is nn.Linear
        and lm_head.bias is None
        and lm_head.weight.dtype == torch.float32
        and h.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
    )


def head_logits(lm_head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``lm_head(h)`` for ``h (…, H)``: through :class:`_HeadProduct` where ``lm_head`` is
    :func:`plain`, else the module itself."""
    if not plain(lm_head, h):
        return lm_head(h)  # type: ignore[no-any-return]
    flat = h.reshape(-1, h.shape[-1])
    return _HeadProduct.apply(flat, lm_head.weight).reshape(*h.shape[:-1], -1)  # type: ignore[no-any-return]


class _ChunkedHeadCE(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        h: torch.Tensor,
        w: torch.Tensor,
        targets: torch.Tensor,
        v0: int,
        gather: Gather,
    ) -> torch.Tensor:
        # h: (N, H); w: (V_r, H) rows [v0, v0 + V_r); targets: (N,) with -100 = ignored
        n, rows = h.shape[0], w.shape[0]
        valid = targets != -100
        local = targets - v0
        owned = valid & (local >= 0) & (local < rows)
        idx = torch.where(owned, local, torch.zeros_like(local))
        lse_r = h.new_full((n,), float("-inf"))
        t_r = h.new_zeros(n)
        z = h.new_empty(0, rows)
        for s in _starts(n, rows):
            c = slice(s, s + CHUNK_TOKENS)
            z = h[c] @ w.t()
            lse_r[c] = torch.logsumexp(z, dim=-1)
            t_r[c] = z.gather(1, idx[c].unsqueeze(1)).squeeze(1)
        stats = torch.stack([lse_r, t_r * owned])  # (2, N)
        gathered = torch.stack(gather(stats))  # (R, 2, N)
        lse = torch.logsumexp(gathered[:, 0], dim=0)
        loss = ((lse - gathered[:, 1].sum(0)) * valid).sum()
        ctx.save_for_backward(h, w, lse, idx, owned, valid, z)  # z: the last chunk's logits
        return loss

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        h, w, lse, idx, owned, valid, last = ctx.saved_tensors  # type: ignore[attr-defined]
        need_h, need_w = ctx.needs_input_grad[:2]  # type: ignore[attr-defined]
        dh = torch.zeros_like(h) if need_h else None
        dw = torch.zeros_like(w) if need_w else None
        starts = _starts(h.shape[0], w.shape[0])
        for s in reversed(starts):  # the last chunk first: its logits were kept
            c = slice(s, s + CHUNK_TOKENS)
            if s == starts[-1]:  # kept: not changed in place (a second backward reads it)
                z = last - lse[c].unsqueeze(1)
            else:
                z = (h[c] @ w.t()).sub_(lse[c].unsqueeze(1))
            z.exp_()
            z.scatter_add_(1, idx[c].unsqueeze(1), -owned[c].to(z.dtype).unsqueeze(1))
            z.mul_(valid[c].to(z.dtype).unsqueeze(1) * g)
            if dh is not None:
                dh[c] = z @ w
            if dw is not None:
                dw.addmm_(z.t(), h[c])
        return dh, dw, None, None, None


def chunks(chunked: bool, lm_head: nn.Module, h: torch.Tensor, tokens: int) -> bool:
    """Whether a head asked to compute its loss ``chunked`` does, for ``tokens`` tokens of
    hidden states ``h``: a :func:`plain` head, in training, more than one chunk."""
    return chunked and tokens > CHUNK_TOKENS and torch.is_grad_enabled() and plain(lm_head, h)


def chunked_loss_sum(
    h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, v0: int, gather: Gather
) -> torch.Tensor:
    """Summed cross-entropy over ``targets`` != -100 (``(N,)``) of the logits ``h Wᵀ``
    (``h (N, H)``, this rank's rows ``[v0, v0 + V_r)`` of the head ``w``), in chunks of
    :data:`CHUNK_TOKENS` tokens (module docstring); ``gather``: every rank's statistics."""
    return _ChunkedHeadCE.apply(h, w, targets, v0, gather)  # type: ignore[no-any-return]
