"""LoRA: a frozen base weight plus a trainable low-rank update, in fp32.

::

        x ──────────────► W (out, in) ────────────────┐
        │                                              (+) ──► y = W x + (α/r) · B A x
        └─► dropout ─► A (r, in) ─► B (out, r) ─► ·α/r ┘

Parameter names follow peft (``q_proj.lora_A.weight``, ``q_proj.lora_B.weight``), so an
adapter exports without renaming. Under tensor parallelism A and B follow the base layer
(see ``xronos.parallel.spec``). Dropout draws its mask over the *full* input width from a
generator that advances identically on every rank, then keeps this rank's columns, so a
sharded run drops exactly what the single-device run drops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Adapter hyper-parameters (peft's names)."""

    r: int = 8
    """Rank of the update."""
    alpha: float = 16.0
    """Scale numerator: the update is multiplied by ``alpha / r``."""
    dropout: float = 0.0
    """Dropout probability on the adapter's input."""
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Linear layers (by their last name) that get an adapter."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


class LoRALinear(nn.Linear):
    """``nn.Linear`` with a LoRA update; the base ``weight``/``bias`` are frozen."""

    def __init__(self, base: nn.Linear, cfg: LoRAConfig, seed: int) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the base weight is adopted, not created
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, cfg.r, bias=False)
        self.lora_B = nn.Linear(cfg.r, base.out_features, bias=False)
        self.scaling = cfg.scaling
        self.dropout = cfg.dropout
        self.dropout_gen = torch.Generator().manual_seed(seed)
        self.full_in = base.in_features  # full input width (row-parallel shards slice it)
        self.in_range = (0, base.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        a_in = x.to(self.lora_A.weight.dtype)
        if self.dropout > 0 and self.training:
            keep = torch.rand((*x.shape[:-1], self.full_in), generator=self.dropout_gen)
            keep = keep[..., self.in_range[0] : self.in_range[1]] >= self.dropout
            a_in = a_in * keep / (1 - self.dropout)
        update = self.lora_B(self.lora_A(a_in)) * self.scaling
        return y + update.to(y.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``W + (α/r)·B A`` — what ``merge`` would write; idempotent, W is not changed."""
        delta = (self.lora_B.weight @ self.lora_A.weight) * self.scaling
        return self.weight + delta.to(self.weight.dtype)


def lora_init(a_full: torch.Tensor, gen: torch.Generator) -> None:
    """peft's default: A ~ kaiming_uniform(a=√5) i.e. U(±1/√in), B = 0 (done by caller)."""
    bound = 1.0 / math.sqrt(a_full.shape[1])
    a_full.uniform_(-bound, bound, generator=gen)


def add_lora(model: nn.Module, cfg: LoRAConfig, seed: int) -> list[str]:
    """Wrap every targeted Linear in ``model`` with a LoRALinear and freeze everything
    else. The adapters' values are set by ``build_model`` (``lora_init`` on the full
    tensor, then this rank's slice). Returns the wrapped module names."""
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped: list[str] = []
    targets: Sequence[str] = cfg.target_modules
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or isinstance(module, LoRALinear):
            continue
        if name.rsplit(".", 1)[-1] not in targets:
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        lora = LoRALinear(module, cfg, seed=seed + 7919 * (len(wrapped) + 1))
        setattr(parent, name.rsplit(".", 1)[-1], lora)
        wrapped.append(name)
    return wrapped
