"""One training step on this rank's shard: same code for one device and many.

Per step, besides the per-layer collectives inside forward and backward:

1. one all-reduce of the flattened gradients that are per-rank partial sums
   (:mod:`xronos.train.shardgrads`: LoRA A on column-parallel bases, LoRA B on
   row-parallel bases, Qwen3 q/k norms) and,
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

**Overlap** (a group with lanes, :meth:`~xronos.comm.mappings.TPGroup.with_lanes`): each
micro-batch is cut in two halves along the batch, and two threads run them at once, each in
its own lane, so that one half computes while the other half's all-reduce is on the wire.
Each half returns its gradients (``torch.autograd.grad``) and they are added in lane order,
so every rank sums the same numbers in the same order; the norms are then all taken after
the backward passes. A micro-batch of one sequence, or LoRA with dropout (whose masks are
drawn in call order), runs as without overlap.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from xronos.comm.mappings import TPGroup, lane
from xronos.config import ModelConfig
from xronos.metrics.recorder import current_recorder
from xronos.metrics.records import LANE
from xronos.model.llama import LlamaForCausalLM
from xronos.planner.plan import Plan
from xronos.train.batches import Batch, label_count
from xronos.train.optim import OptimConfig, adamw, update
from xronos.train.shardgrads import ShardGrads

T = TypeVar("T")

SLOW_FIRST_STEPS = 3
"""Steps a freshly built model runs slower than the rest (the allocator still growing,
page faults, AdamW's moments created); a step that is timed to stand for a model's step
comes after this many untimed ones. Measured on ``ci-2dev``: the profiler's whole model
took 0.76, 0.74, 0.61, 0.60, 0.71, 0.67 s in steps 1-6 on the full-speed device and 2.64,
1.92, 1.34, 1.56, 1.38, 1.38 s on the 0.4 one; after two untimed steps three profiles timed
the fast device's next step at 0.462-0.466 s and the two after it at 0.396-0.406 s; the
13 : 3 plan's full-speed shard took 0.553, 0.423, 0.321, 0.312, 0.315, 0.318, 0.306, 0.303 s
in steps 1-8."""


def run_lanes(first: Callable[[], T], second: Callable[[], T]) -> tuple[T, T]:
    """``first()`` on this thread and ``second()`` on another, at once; both results, or
    the first error (after both have ended: a lane never outlives its step)."""
    box: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(second())
        except BaseException as e:  # re-raised on the calling thread
            errors.append(e)

    thread = threading.Thread(target=run, name="xronos-lane1", daemon=True)
    thread.start()
    try:
        a = first()
    finally:
        thread.join()
    if errors:
        raise errors[0]
    return a, box[0]


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
        self.grads = ShardGrads(named, cfg, plan, group)
        # A replicated parameter's gradient is identical on every rank: count it once.
        self.norm_weight = self.grads.norm_weight
        self.optimizer = adamw(self.params, opt)
        # LoRA dropout draws its masks from one generator per module, in call order: two
        # lanes drawing at once would not draw the single-device run's masks.
        self.lanes = bool(group.lanes) and not any(
            getattr(m, "dropout", 0.0) > 0 for m in model.modules() if hasattr(m, "dropout_gen")
        )
        self.steps_done = 0
        self.lr = opt.lr
        # Norms taken in backward (see the module docstring). The hooks hold only this
        # small record, not the trainer: no cycle keeps the process group alive.
        self._norms = _BackwardNorms()
        for k, (p, w) in enumerate(zip(self.params, self.norm_weight, strict=True)):
            if w and not self.grads.late(p):
                p.register_post_accumulate_grad_hook(self._norms.hook(k))

    def step(self, micro_batches: Sequence[Batch]) -> tuple[float, float]:
        """Forward, backward and update over ``micro_batches``; returns (loss, grad norm)."""
        self.model.train()
        denom = float(max(label_count(micro_batches), 1))
        self._norms.taken.clear()
        if self.lanes and all(ids.shape[0] >= 2 for ids, _ in micro_batches):
            total = self._overlapped(micro_batches, denom)
        else:
            total = self._sequential(micro_batches, denom)
        self.grads.sync()
        norm = self._global_norm()
        self.lr = update(self.optimizer, self.params, self.opt_cfg, norm, self.steps_done)
        self.steps_done += 1
        return total / denom, norm

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.opt_cfg.bf16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _sequential(self, micro_batches: Sequence[Batch], denom: float) -> float:
        total = 0.0
        for k, (ids, labels) in enumerate(micro_batches):
            with self._autocast():
                loss_sum = self.model.loss_sum(ids, labels)
            self._norms.active = k == len(micro_batches) - 1
            try:
                (loss_sum / denom).backward()
            finally:
                self._norms.active = False
            total += float(loss_sum.detach())
        return total

    def _half(
        self, k: int, ids: torch.Tensor, labels: torch.Tensor, denom: float
    ) -> tuple[float, tuple[torch.Tensor | None, ...]]:
        """Forward and backward of one half in lane ``k``: its loss sum and gradients."""
        with lane(k), current_recorder().compute(f"L{k}", LANE):
            with self._autocast():
                loss_sum = self.model.loss_sum(ids, labels)
            grads = torch.autograd.grad(loss_sum / denom, self.params, allow_unused=True)
        return float(loss_sum.detach()), grads

    def _overlapped(self, micro_batches: Sequence[Batch], denom: float) -> float:
        """Every micro-batch as two halves in two lanes (see the module docstring)."""
        acc: list[torch.Tensor | None] = [p.grad for p in self.params]
        total = 0.0
        for ids, labels in micro_batches:
            first, second = ids.tensor_split(2), labels.tensor_split(2)
            halves = run_lanes(
                functools.partial(self._half, 0, first[0], second[0], denom),
                functools.partial(self._half, 1, first[1], second[1], denom),
            )
            for loss_sum, grads in halves:  # lane order: the same sums on every rank
                total += loss_sum
                for i, g in enumerate(grads):
                    if g is not None:
                        prev = acc[i]
                        acc[i] = g if prev is None else prev + g
        for p, g in zip(self.params, acc, strict=True):
            p.grad = g
        return total

    def _global_norm(self) -> float:
        # The rest: partial gradients (final only after their all-reduce) and any gradient
        # the last backward did not touch.
        rest = [
            self.grads.countable(p, p.grad.detach())
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
