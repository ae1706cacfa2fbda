"""Activation checkpointing: a block keeps its inputs and computes the rest again in backward.

Training holds every block's intermediate tensors (the projections' inputs and outputs,
the attention's, the MLP's gate and up products) from its forward until its backward,
for every layer at once: on a long sequence they outweigh the weights. With
``Block.recompute`` on (``--gradient-checkpointing``, as Hugging Face's
``gradient_checkpointing_enable()``), each of a block's two regions — the norm and the
attention up to the ``exit`` seam, the norm and the MLP up to theirs — saves only its input
and runs its forward again when backward reaches it (``torch.utils.checkpoint``,
non-reentrant). The ``exit`` seams' forward all-reduces stay outside the regions, so
computing again sends no message again; the ``enter`` seams' backward all-reduces run once,
in the regions' backward. A step computes each block's forward twice (about a third more
work); losses and gradients are the same, bit for bit (tested).

LoRA dropout draws its masks from one generator per module (``dropout_gen``, see
:mod:`xronos.model.lora`), which torch's checkpoint does not restore: a region puts its own
modules' generators back where they stood before its forward while it computes again, so it
draws the same masks, and then where they stood before it computed again: other regions and
other micro-batches (a pipeline runs several forwards before a backward) have drawn since.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Region = Callable[[torch.Tensor], torch.Tensor]


def recomputed(owner: nn.Module, region: Region) -> Region:
    """``region`` (a function of one tensor) checkpointed: its output, keeping only its
    input for backward. ``owner`` holds every module in it that draws dropout masks, and
    no other: its generators are the ones put back. Make one per forward call."""
    found = (getattr(m, "dropout_gen", None) for m in owner.modules())
    gens = [g for g in found if isinstance(g, torch.Generator)]
    before = [g.get_state() for g in gens]
    forwarded = False

    def replay(x: torch.Tensor) -> torch.Tensor:
        nonlocal forwarded
        if not forwarded:  # the forward
            forwarded = True
            return region(x)
        now = [g.get_state() for g in gens]  # other passes may have drawn since
        for g, state in zip(gens, before, strict=True):  # computed again: the same masks
            g.set_state(state)
        try:
            return region(x)
        finally:
            for g, state in zip(gens, now, strict=True):
                g.set_state(state)

    def run(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(replay, x, use_reentrant=False)  # type: ignore[no-any-return]

    return run
