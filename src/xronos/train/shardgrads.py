"""What a tensor-parallel shard's gradients need after its backward passes, before the norm.

Some gradients are per-rank partial sums (LoRA A on column-parallel bases, LoRA B on
row-parallel bases, Qwen3's q/k norms: :func:`~xronos.parallel.spec.partial_grad`) and the
rows of KV groups that several ranks hold are too (:mod:`xronos.parallel.shared`). One
all-reduce of one flat buffer completes them all (:meth:`ShardGrads.sync`).

For the global norm, a sharded parameter counts on every rank and a replicated one on the
group's rank 0 only (its gradient is the same everywhere); a shared row counts once, on
its owner (:meth:`ShardGrads.countable`).

Used by the tensor-parallel :class:`~xronos.train.trainer.Trainer` and by a hybrid's
tensor-parallel pipeline stage (:mod:`xronos.pipeline.runner`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.parallel.shared import shared_rows
from xronos.parallel.spec import partial_grad, shard_spec
from xronos.planner.plan import Plan


class ShardGrads:
    """The partial gradients of one shard and the weight of each in the global norm.

    Args:
        named: the trainable parameters by Hugging Face name, in the model's order (the
            same order on every rank of ``group``).
        cfg: model shape.
        plan: the plan the shard was built under (``plan.world_size == group.size``).
        group: the tensor-parallel group.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        cfg: ModelConfig,
        plan: Plan,
        group: TPGroup,
    ) -> None:
        self.group = group
        self.partial = [p for n, p in named if group.size > 1 and partial_grad(n)]
        self.shared = shared_rows(named, cfg, plan, group.rank)
        self.norm_weight = [
            1.0 if shard_spec(n, cfg, plan, group.rank) is not None or group.rank == 0 else 0.0
            for n, _ in named
        ]
        """Per parameter of ``named``: 1 if it counts in the global norm on this rank."""

    def late(self, p: nn.Parameter) -> bool:
        """Whether ``p``'s gradient is final only after :meth:`sync`."""
        return any(p is q for q in self.partial) or self.shared.holds(p)

    def sync(self) -> None:
        """Sum the partial gradients and the shared rows over the group (one all-reduce;
        every rank of the group calls it)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.partial]
        if not grads and not self.shared.size:
            return
        dtype = grads[0].dtype if grads else torch.float32
        flat = torch.cat(
            [g.reshape(-1) for g in grads] + [torch.zeros(self.shared.size, dtype=dtype)]
        )
        n_partial = flat.numel() - self.shared.size
        self.shared.pack(flat[n_partial:])
        self.group.all_reduce(flat, "grads.partial")
        offset = 0
        for p, g in zip(self.partial, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        self.shared.unpack(flat[n_partial:])

    def countable(self, p: nn.Parameter, g: torch.Tensor) -> torch.Tensor:
        """The part of ``g`` (``p``'s gradient) that this rank counts in the norm."""
        return self.shared.owned(p, g)
