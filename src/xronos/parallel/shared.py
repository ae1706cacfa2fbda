"""Summing the gradients of shared K/V rows among the ranks that hold them.

A KV group cut by a rank boundary is held by every rank that holds one of its query heads
(:mod:`xronos.parallel.spec`). Each of them computes the group's K/V from the same
weights, but in backward only the part of ``dK``/``dV`` that flows from its *own* query
heads reaches it, so its gradient of the group's K/V weight rows (bias, LoRA B) is a
partial sum; the full gradient is the sum over the sharing ranks (``dW = dKᵀ X`` is
linear in ``dK``).

gloo has no cheap all-reduce over changing subsets of ranks, so the sum rides on the
step's one flat all-reduce: every rank lays out the rows of *every* shared group (the same
layout everywhere, from the plan alone), fills the groups it holds and leaves zeros
elsewhere; after the all-reduce each rank copies back its groups' rows::

    shared groups       g1         g4             (from the plan)
    buffer (per tensor) [ g1 rows | g4 rows ]     zero where a rank does not hold the group
    rank 1 fills        [ dK_1(g1)|    0    ]
    rank 2 fills        [ dK_2(g1)| dK_2(g4)]
    all-reduce          [ Σ (g1)  | Σ (g4)  ]     -> rows of g1 back on ranks 1, 2; ...

Shapes: a tensor of ``[n_kv_local · head_dim, *rest]`` (weight ``[., hidden]``, bias
``[.]``, LoRA B ``[., r]``) contributes ``len(shared) · head_dim · prod(rest)`` elements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from xronos.config import ModelConfig
from xronos.parallel.spec import kv_heads, kv_rows, owned_spec, shard_spec, shared_kv_heads
from xronos.planner.plan import Plan


@dataclass(frozen=True)
class _Entry:
    param: nn.Parameter
    offset: int
    """Start of this tensor's part of the buffer."""
    rows: tuple[tuple[int, int], ...]
    """Per shared group: (first local row, index of the group among the shared), for the
    groups this rank holds."""
    row_numel: int
    """Elements in one row (``prod(rest)``)."""


class SharedRows:
    """Where the gradients of shared K/V rows go in the flat all-reduce buffer.

    Args:
        named: the trainable parameters, by Hugging Face name, in the same order on every
            rank (the model's ``named_parameters`` order).
        cfg: model shape.
        plan: the plan the model was built under.
        rank: this rank.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        cfg: ModelConfig,
        plan: Plan,
        rank: int,
    ) -> None:
        d = cfg.head_dim
        shared = shared_kv_heads(cfg, plan) if plan.world_size > 1 else ()
        k0, k1 = kv_heads(cfg, plan, rank)
        self.entries: list[_Entry] = []
        self.owned_rows: dict[int, tuple[int, int]] = {}
        offset = 0
        for name, p in named if shared else ():
            if not kv_rows(name):
                continue
            row_numel = math.prod(p.shape[1:])
            rows = tuple(((g - k0) * d, j) for j, g in enumerate(shared) if k0 <= g < k1)
            self.entries.append(_Entry(p, offset, rows, row_numel))
            offset += len(shared) * d * row_numel
            if rows:
                held, own = shard_spec(name, cfg, plan, rank), owned_spec(name, cfg, plan, rank)
                assert held is not None and own is not None
                self.owned_rows[id(p)] = (own.start - held.start, own.end - own.start)
        self.size = offset
        self._rows = d

    def holds(self, p: nn.Parameter) -> bool:
        """Whether this rank holds shared rows of ``p`` (its gradient is partial until
        :meth:`unpack`)."""
        return id(p) in self.owned_rows

    def owned(self, p: nn.Parameter, t: torch.Tensor) -> torch.Tensor:
        """The rows of ``t`` (``p``'s gradient) that this rank owns: a shared row counts
        once in the global gradient norm."""
        if id(p) not in self.owned_rows:
            return t
        start, n = self.owned_rows[id(p)]
        return t.narrow(0, start, n)

    def pack(self, buf: torch.Tensor) -> None:
        """Copy the held shared rows' gradients into ``buf`` (``[size]``, zero-filled)."""
        d = self._rows
        for e in self.entries:
            if e.param.grad is None:
                continue
            for row, j in e.rows:
                n = d * e.row_numel
                start = e.offset + j * n
                buf[start : start + n].copy_(e.param.grad.narrow(0, row, d).reshape(-1))

    def unpack(self, buf: torch.Tensor) -> None:
        """Write the summed rows of ``buf`` back into the gradients of the held rows."""
        d = self._rows
        for e in self.entries:
            if not e.rows:
                continue
            if e.param.grad is None:
                e.param.grad = torch.zeros_like(e.param)
            for row, j in e.rows:
                n = d * e.row_numel
                start = e.offset + j * n
                e.param.grad.narrow(0, row, d).copy_(
                    buf[start : start + n].view_as(e.param.grad.narrow(0, row, d))
                )


def shared_rows(
    named: Sequence[tuple[str, nn.Parameter]], cfg: ModelConfig, plan: Plan, rank: int
) -> SharedRows:
    """:class:`SharedRows` of the trainable parameters ``named`` under ``plan``."""
    return SharedRows(named, cfg, plan, rank)
