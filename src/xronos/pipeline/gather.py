"""The whole model from a pipeline's stages, on every rank (evaluation, checkpoints,
tests)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from xronos.comm.mappings import TPGroup
from xronos.parallel.shard import build_meta, stage_holds
from xronos.train.source import ModelSource


def gather_stages(
    source: ModelSource,
    ranges: Sequence[tuple[int, int]],
    mine: Mapping[str, torch.Tensor] | None,
    stage: int,
    leaders: Sequence[int],
    group: TPGroup,
    to: int | None = None,
    trained: bool = False,
) -> dict[str, torch.Tensor]:
    """Every stage's parameters by Hugging Face name (collective over ``group``).

    Args:
        source: the model (its config, LoRA and seed give every name and shape).
        ranges: each stage's decoder layers.
        mine: this rank's stage, whole (None on a TP stage's members but its leader).
        stage: this rank's stage.
        leaders: the global rank of each stage's leader, who sends it.
        group: the pipeline's group; with ``to``, the group of its point-to-point
            messages (they would put a collective group's sequence numbers out of step).
        to: gather on this stage's leader alone (the others return an empty dict and
            hold no more than their stage), or None: on every rank (a broadcast per stage).
        trained: the trainable parameters alone (LoRA: the adapters; the frozen base is
            the source's, which the receiver builds itself).

    Names and shapes come from the config (a ``meta`` model), so each stage sends one flat
    fp32 vector from its leader and nothing is pickled.
    """
    cfg = source.cfg
    full = build_meta(cfg, source.lora, source.seed)
    shapes = {n: p.shape for n, p in full.named_parameters() if p.requires_grad or not trained}
    last = len(ranges) - 1
    # last stage first: a tied matrix is the last stage's (the first stage's copy is only
    # current in the rows of the step's tokens: :mod:`xronos.pipeline.tied`)
    parts: list[tuple[int, list[str]]] = []
    taken: set[str] = set()
    for s, rng in reversed(list(enumerate(ranges))):
        names = [
            n for n in shapes if n not in taken and stage_holds(n, cfg, rng, s == 0, s == last)
        ]
        taken.update(names)
        parts.append((s, names))
    receiver = None if to is None else leaders[to]
    me = dist.get_rank()
    if receiver is not None and me != receiver:
        for s, names in parts:
            if s == stage and mine is not None and s != to:
                flat = torch.cat([mine[n].reshape(-1).float() for n in names])
                dist.send(flat, dst=receiver, group=group.pg)
        return {}
    out: dict[str, torch.Tensor] = {}
    for s, names in parts:
        if s == stage and mine is not None:
            if receiver is not None:  # this stage's own tensors: no copy needed
                out.update({n: mine[n].detach().float() for n in names})
                continue
            flat = torch.cat([mine[n].reshape(-1).float() for n in names])
        else:
            flat = torch.empty(sum(shapes[n].numel() for n in names), dtype=torch.float32)
        if receiver is None:
            dist.broadcast(flat, src=leaders[s], group=group.pg)
        else:
            dist.recv(flat, src=leaders[s], group=group.pg)
        for n, part in zip(names, flat.split([shapes[n].numel() for n in names]), strict=True):
            out[n] = part.view(shapes[n]).clone()
    return out
