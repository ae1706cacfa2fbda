"""One training step on this rank's shard: same code for one device and many.

Per step, besides the per-layer collectives inside forward and backward:

1. one all-reduce of the flattened gradients that are per-rank partial sums
   (LoRA A on column-parallel bases, LoRA B on row-parallel bases, Qwen3 q/k norms) and,
   in the same buffer, of the rows of KV groups that several ranks share (K/V weights,
   biases, LoRA B; zero where a rank does not hold a group: :mod:`xronos.parallel.shared`),
2. one all-reduce of the squared gradient norm for clipping by the *global* norm
   (sharded parameters count on every rank, replicated ones and shared rows once).

Each parameter's gradient norm is taken during the last micro-batch's backward, as soon
as that gradient is final (a post-accumulate-grad hook), not in one pass after it: the
work then falls inside the segments the planner balances, in proportion to each rank's
units, instead of piling up before the norm all-reduce where no split can even it out.

Loss = Σ cross-entropy over label tokens / global count of label tokens in the step
(all micro-batches of gradient accumulation together); a fully masked step gives 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.model.llama import LlamaForCausalLM
from xronos.parallel.shared import shared_rows
from xronos.parallel.spec import partial_grad, shard_spec
from xronos.planner.plan import Plan
from xronos.train.batches import Batch, label_count
from xronos.train.optim import OptimConfig, adamw, update


class _BackwardNorms:
    """Gradient norms taken by post-accumulate-grad hooks while ``active``, by position."""

    def __init__(self) -> None:
        self.taken: dict[int, torch.Tensor] = {}
        self.active = False

    def hook(self, k: int) -> Callable[[torch.Tensor], None]:
        def take(p: torch.Tensor) -> None:
            if self.active and p.grad is not None:
                self.taken[k] = torch.linalg.vector_norm(p.grad.detach())

        return take


class Trainer:
    """AdamW on the local shards with global-norm clipping and exact loss normalisation."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        cfg: ModelConfig,
        plan: Plan,
        group: TPGroup,
        opt: OptimConfig,
    ) -> None:
        self.model, self.group, self.opt_cfg = model, group, opt
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.partial = [p for n, p in named if group.size > 1 and partial_grad(n)]
        self.shared = shared_rows(named, cfg, plan, group.rank)
        # A replicated parameter's gradient is identical on every rank: count it once.
        self.norm_weight = [
            1.0 if shard_spec(n, cfg, plan, group.rank) is not None or group.rank == 0 else 0.0
            for n, _ in named
        ]
        self.optimizer = adamw(self.params, opt)
        self.steps_done = 0
        self.lr = opt.lr
        # Norms taken in backward (see the module docstring). The hooks hold only this
        # small record, not the trainer: no cycle keeps the process group alive.
        self._norms = _BackwardNorms()
        partial = {id(p) for p in self.partial} | {
            id(p) for p in self.params if self.shared.holds(p)
        }
        for k, (p, w) in enumerate(zip(self.params, self.norm_weight, strict=True)):
            if w and id(p) not in partial:
                p.register_post_accumulate_grad_hook(self._norms.hook(k))

    def step(self, micro_batches: Sequence[Batch]) -> tuple[float, float]:
        """Forward, backward and update over ``micro_batches``; returns (loss, grad norm)."""
        self.model.train()
        denom = float(max(label_count(micro_batches), 1))
        total = 0.0
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if self.opt_cfg.bf16
            else contextlib.nullcontext()
        )
        self._norms.taken.clear()
        for k, (ids, labels) in enumerate(micro_batches):
            with autocast:
                loss_sum = self.model.loss_sum(ids, labels)
            self._norms.active = k == len(micro_batches) - 1
            try:
                (loss_sum / denom).backward()
            finally:
                self._norms.active = False
            total += float(loss_sum.detach())
        self._sync_partial_grads()
        norm = self._global_norm()
        self.lr = update(self.optimizer, self.params, self.opt_cfg, norm, self.steps_done)
        self.steps_done += 1
        return total / denom, norm

    def _sync_partial_grads(self) -> None:
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

    def _global_norm(self) -> float:
        # The rest: partial gradients (final only after their all-reduce) and any gradient
        # the last backward did not touch.
        rest = [
            self.shared.owned(p, p.grad.detach())
            for k, (p, w) in enumerate(zip(self.params, self.norm_weight, strict=True))
            if p.grad is not None and w and k not in self._norms.taken
        ]
        # Per-tensor norms in fp32, their squares summed in fp64 in parameter order.
        late = iter(torch._foreach_norm(rest)) if rest else iter(())
        taken = self._norms.taken
        norms = [
            taken[k] if k in taken else next(late)
            for k, (p, w) in enumerate(zip(self.params, self.norm_weight, strict=True))
            if p.grad is not None and w
        ]
        taken.clear()
        sq = (
            torch.stack(norms).double().pow(2).sum().reshape(1)
            if norms
            else torch.zeros(1, dtype=torch.float64)
        )
        self.group.all_reduce(sq, "grads.norm")
        return float(sq.sqrt())
