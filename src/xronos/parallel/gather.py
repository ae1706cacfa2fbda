"""Reassemble full tensors from the shards that the ranks hold (tests, checkpoints, export).

gloo's ``all_gather`` needs equal shapes on every rank, so each shard is zero-padded to
the largest shard along its split dim, gathered, then trimmed and concatenated. K/V rows
of a KV group that several ranks hold are taken once, from the group's owner (each rank
contributes only its owned part: :func:`xronos.parallel.spec.owned_part`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.parallel.spec import owned_part
from xronos.planner.plan import Plan


def gather_tensor(
    local: torch.Tensor, dim: int, group: TPGroup, name: str = "gather"
) -> torch.Tensor:
    """Concatenate every rank's ``local`` along ``dim`` (sizes may differ, zero included)."""
    if group.size == 1:
        return local
    sizes = [int(s) for s in group.all_gather(torch.tensor([local.shape[dim]]), name + ".n")]
    pad = [0, 0] * (local.dim() - dim - 1) + [0, max(sizes) - local.shape[dim]]
    parts = group.all_gather(F.pad(local.detach(), pad), name)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=dim)


def gather_state(
    model: nn.Module, cfg: ModelConfig, plan: Plan, group: TPGroup, *, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of the model's parameters on every rank, by HF name."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        own, spec = owned_part(p, name, cfg, plan, group.rank)
        out[name] = (
            p.detach().clone() if spec is None else gather_tensor(own, spec.dim, group, name)
        )
    return out
