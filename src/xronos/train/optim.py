"""AdamW settings, the learning-rate schedule and global-norm clipping: one definition each,
shared by every strategy's step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW and clipping settings."""

    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    warmup_steps: int = 0
    """Linear warm-up steps, then constant."""
    bf16: bool = False
    """Run forward/backward under bf16 autocast (weights and LoRA stay fp32)."""


def adamw(params: Sequence[torch.Tensor], opt: OptimConfig) -> torch.optim.AdamW:
    """The optimizer every strategy uses."""
    return torch.optim.AdamW(
        list(params), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
    )


def lr_factor(opt: OptimConfig, steps_done: int) -> float:
    """Linear warm-up over ``opt.warmup_steps`` optimizer steps, then 1."""
    w = opt.warmup_steps
    return min(1.0, (steps_done + 1) / w) if w > 0 else 1.0


def clip_to(params: Sequence[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale the gradients of ``params`` down to ``max_norm`` when their global ``norm``
    exceeds it (0 disables clipping)."""
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)


def update(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    opt: OptimConfig,
    norm: float,
    steps_done: int,
) -> float:
    """The tail of every step: clip by the global ``norm``, set the scheduled learning
    rate, AdamW, drop the gradients. Returns the learning rate used."""
    clip_to(params, norm, opt.max_grad_norm)
    lr = opt.lr * lr_factor(opt, steps_done)
    for g in optimizer.param_groups:
        g["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr
