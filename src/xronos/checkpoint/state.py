"""What a rank contributes to a checkpoint, and the descriptions that guard a resume.

Saved: every *trainable* parameter (all of them for full fine-tuning, the adapters for
LoRA) and its AdamW state, split exactly like the parameter (AdamW is elementwise, so a
slice of its state belongs to the same slice of the parameter and resharding is exact).
Each rank saves its *owned* slice (``owned_spec``): the K/V rows of a KV group that
several ranks hold are saved once, by the group's owner (their values and AdamW state are
identical on every sharing rank, whose gradients were summed), so the saved slices tile
every tensor and load onto any other plan.
Frozen weights are not saved: they are rebuilt from the model source (directory or
seeded preset), and a fingerprint of them guards against resuming on other base weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.model.lora import LoRAConfig, LoRALinear
from xronos.parallel.spec import owned_part, owned_spec
from xronos.planner.plan import Plan

from .layout import TensorLayout, dtype_name

#: ModelConfig fields that do not change the parameters or the mathematics of a step.
_NOT_COMPARED = ("extra", "bos_token_id", "eos_token_id", "max_position_embeddings")
_FINGERPRINT_CHUNK = 1 << 20


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a checkpoint saves, in ``named_parameters`` order (as the Trainer)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@dataclass
class RankState:
    """This rank's tensors for its checkpoint file, and (used on rank 0) the index."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    layouts: dict[str, TensorLayout] = field(default_factory=dict)
    params: dict[str, list[str]] = field(default_factory=dict)

    def add(
        self,
        key: str,
        t: torch.Tensor,
        rank: int,
        ranges: list[tuple[int, int]] | None = None,
        dim: int | None = None,
        owner: int = 0,
    ) -> None:
        """Record tensor ``key``: split along ``dim`` by ``ranges`` (this rank holds
        ``ranges[rank]``), or whole in rank ``owner``'s file."""
        t = t.detach()
        if dim is None or ranges is None:
            self.layouts[key] = TensorLayout(tuple(t.shape), dtype_name(t.dtype), rank=owner)
            if rank == owner:
                self.tensors[key] = t.contiguous()
            return
        start, end = ranges[rank]
        if t.shape[dim] != end - start:
            raise RuntimeError(f"{key}: local length {t.shape[dim]} != plan range {start}:{end}")
        full = list(t.shape)
        full[dim] = ranges[-1][1]
        self.layouts[key] = TensorLayout(tuple(full), dtype_name(t.dtype), dim, tuple(ranges))
        if end > start:
            self.tensors[key] = t.contiguous()


def collect(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cfg: ModelConfig,
    plan: Plan,
    rank: int,
) -> RankState:
    """This rank's parameters, optimizer state and RNG states, keyed as in ``layout``."""
    out = RankState()
    for name, p in trainable(model):
        specs = [owned_spec(name, cfg, plan, r) for r in range(plan.world_size)]
        ranges = None if specs[0] is None else [(s.start, s.end) for s in specs if s is not None]
        dim = None if specs[0] is None else specs[0].dim
        out.add(f"param/{name}", owned_part(p, name, cfg, plan, rank)[0], rank, ranges, dim)
        states = optimizer.state.get(p, {}) if optimizer is not None else {}
        out.params[name] = sorted(states)
        for kind, value in sorted(states.items()):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {kind!r} of {name} is not a tensor")
            split = value.dim() > 0 and value.shape == p.shape
            out.add(
                f"optim/{kind}/{name}",
                owned_part(value, name, cfg, plan, rank)[0] if split else value,
                rank,
                ranges if split else None,
                dim if split else None,
            )
    for r in range(plan.world_size):  # every rank's own global RNG, in its own file
        out.add(f"rng/torch/{r}", torch.get_rng_state(), rank, owner=r)
    for name, m in lora_modules(model):  # advances identically on every rank: save once
        out.add(f"rng/dropout/{name}", m.dropout_gen.get_state(), rank)
    return out


# -- descriptions that a resume must match -------------------------------------------------
def config_dict(cfg: ModelConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**d)


def compared_fields(cfg: ModelConfig) -> dict[str, Any]:
    d = config_dict(cfg)
    return {k: v for k, v in d.items() if k not in _NOT_COMPARED}


def config_hash(cfg: ModelConfig) -> str:
    text = json.dumps(compared_fields(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe_lora(model: nn.Module) -> dict[str, Any] | None:
    """The adapters' hyper-parameters as read off the model, or None (full fine-tuning)."""
    mods = lora_modules(model)
    if not mods:
        return None
    m = mods[0][1]
    r = int(m.lora_A.weight.shape[0])
    alpha = round(m.scaling * r, 9)
    return {
        "r": r,
        "alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "dropout": m.dropout,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n, _ in mods}),
    }


def lora_from_dict(d: dict[str, Any] | None) -> LoRAConfig | None:
    if d is None:
        return None
    return LoRAConfig(
        r=int(d["r"]),
        alpha=float(d["alpha"]),
        dropout=float(d["dropout"]),
        target_modules=tuple(d["target_modules"]),
    )


def _chunks(p: torch.Tensor) -> Iterator[torch.Tensor]:
    yield from p.detach().reshape(-1).split(_FINGERPRINT_CHUNK)


def frozen_sums(
    model: nn.Module,
    cfg: ModelConfig,
    plan: Plan,
    rank: int,
    counted: Callable[[str], bool] = lambda name: True,
) -> torch.Tensor:
    """``[Σx, Σx², Σ|x|, n]`` in float64 over the frozen weights of ``model`` (a shard of
    rank ``rank`` under ``plan``) that ``counted`` accepts, each element counted by one
    rank of the plan (a replicated weight by rank 0, a shared K/V row by its owner); ``n``:
    how many frozen tensors were counted (0: nothing is frozen). Summed over every rank
    that holds a part of the model, the first three are :func:`base_fingerprint`."""
    acc = torch.zeros(4, dtype=torch.float64)
    for name, p in model.named_parameters():
        if p.requires_grad or not counted(name):
            continue
        acc[3] += 1
        own, spec = owned_part(p, name, cfg, plan, rank)
        if spec is None and rank != 0:
            continue  # replicated: rank 0 counts it (a shared K/V row: its owner)
        for c in _chunks(own):
            x = c.double()
            acc[:3] += torch.stack([x.sum(), x.pow(2).sum(), x.abs().sum()])
    return acc


def fingerprint_of(acc: torch.Tensor) -> list[float] | None:
    """The fingerprint of :func:`frozen_sums` summed over the ranks (None: nothing frozen)."""
    return [float(v) for v in acc[:3]] if acc[3] > 0 else None


def base_fingerprint(
    model: nn.Module, cfg: ModelConfig, plan: Plan, group: TPGroup
) -> list[float] | None:
    """``[Σx, Σx², Σ|x|]`` over the frozen weights (each element counted once across the
    group), in float64; None when nothing is frozen. Collective when frozen weights exist
    (every rank of a group holds the same model, so all take the same branch)."""
    if all(p.requires_grad for p in model.parameters()):
        return None
    acc = frozen_sums(model, cfg, plan, group.rank)
    group.all_reduce(acc, "ckpt.fingerprint")
    return fingerprint_of(acc)


def same_fingerprint(a: list[float], b: list[float]) -> bool:
    """Equal up to float64 reassociation. Different splits sum in a different order, which
    moves each sum by ≲ 1e-13 of Σ|x| for any realistic size; 1e-9 of Σ|x| leaves a wide
    margin, while another base model (other weights throughout) differs at O(1)."""
    scale = max(abs(a[2]), abs(b[2]), abs(a[1]), abs(b[1]), 1e-30)
    return all(abs(x - y) <= 1e-9 * scale for x, y in zip(a, b, strict=True))


def base_dtype(model: nn.Module) -> str:
    """dtype of the frozen weights (of all weights for full fine-tuning)."""
    for p in model.parameters():
        if not p.requires_grad:
            return dtype_name(p.dtype)
    return dtype_name(next(model.parameters()).dtype)
