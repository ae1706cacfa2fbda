"""Which slice of each named parameter a rank holds under a Plan.

Words, defined once (Megatron's, not distributed-llama's):

* **column-parallel** ``Y = X A`` with ``A = [A_1 … A_R]`` split along its *output* dim:
  each rank computes a slice of ``Y``. In PyTorch's ``weight = Aᵀ (out, in)`` this is a
  split of ``weight`` along **dim 0**. Used for q/k/v, gate/up and the LM head.
* **row-parallel** ``A`` split along its *input* dim: each rank computes a partial ``Y``
  that an all-reduce sums. ``weight`` is split along **dim 1**. Used for o and down.

Head geometry of one layer, 8 query heads in 4 KV groups on 3 ranks (plan attn =
[3, 3, 2] query heads)::

    q_proj rows   | g0: q0 q1 | g1: q2 q3 | g2: q4 q5 | g3: q6 q7 |   (q_per_kv = 2)
                  '- rank 0 -----'- rank 1 -------'-- rank 2 ---'
    k/v_proj rows | g0: k0    | g1: k1    | g2: k2    | g3: k3    |
      rank 0 holds  k0 k1          (owns k0 k1)
      rank 1 holds     k1 k2       (owns k2)
      rank 2 holds           k3    (owns k3)

The unit is one query head. A rank holds the K/V heads of every KV group that any of its
query heads belongs to, so a group cut by a rank boundary (g1 above) is held — and its
K/V computed — by every rank that holds one of its query heads; each maps its local query
heads onto its local K/V heads (``Attention.q_offset``). The forward is the single-device
mathematics. In backward each sharing rank's K/V gradient (weight, bias, LoRA B) covers
only its own query heads: the gradients of these *shared rows* are summed over the ranks
that hold them (:mod:`xronos.parallel.shared`). Every KV group has one *owner*, the rank
holding its first query head: checkpoints, gathers and the gradient norm count a shared
row once, from its owner (:func:`owned_spec`). A rank with no query heads holds no K/V.

LoRA follows its base layer (peft's ``LoraParallelLinear``): on a column-parallel base
``lora_A`` is replicated and ``lora_B`` is split like the base's rows; on a row-parallel
base ``lora_A`` is split like the base's columns and ``lora_B`` is replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from xronos.config import ModelConfig
from xronos.planner.plan import Plan

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROW = ("o_proj", "down_proj")

_NAME = re.compile(r"(?:^|\.)(?P<module>\w+?)(?:\.lora_(?P<lora>[AB]))?\.(?P<kind>weight|bias)$")


@dataclass(frozen=True)
class ShardSpec:
    """Elements ``[start, end)`` of ``dim`` of the full tensor belong to this rank."""

    dim: int
    start: int
    end: int

    def slice_of(self, full_len: int) -> slice:
        return slice(self.start, min(self.end, full_len))


def kv_heads(cfg: ModelConfig, plan: Plan, rank: int, *, owned: bool = False) -> tuple[int, int]:
    """KV heads ``[start, end)`` that ``rank`` holds (those of every KV group one of its
    query heads belongs to), or, with ``owned``, those it owns (the groups whose first
    query head it holds: disjoint across ranks and covering every KV head)."""
    h0, h1 = plan.bounds("attn", rank, cfg.num_heads)
    q = cfg.q_per_kv
    if h0 == h1:  # no query heads: no K/V either
        return -(-h0 // q), -(-h0 // q)
    return (-(-h0 // q) if owned else h0 // q), -(-h1 // q)


def shared_kv_heads(cfg: ModelConfig, plan: Plan) -> tuple[int, ...]:
    """The KV heads that more than one rank holds (each a group cut by a rank boundary)."""
    count = [0] * cfg.num_kv_heads
    for r in range(plan.world_size):
        k0, k1 = kv_heads(cfg, plan, r)
        for g in range(k0, k1):
            count[g] += 1
    return tuple(g for g, c in enumerate(count) if c > 1)


def _range(
    cfg: ModelConfig, plan: Plan, rank: int, module: str, owned: bool = False
) -> tuple[int, int]:
    """Element range of ``module``'s partitioned dim (output for column, input for row)."""
    d = cfg.head_dim
    if module in ("q_proj", "o_proj"):
        h0, h1 = plan.bounds("attn", rank, cfg.num_heads)
        return h0 * d, h1 * d
    if module in ("k_proj", "v_proj"):
        k0, k1 = kv_heads(cfg, plan, rank, owned=owned)
        return k0 * d, k1 * d
    if module in ("gate_proj", "up_proj", "down_proj"):
        return plan.bounds("mlp", rank, cfg.intermediate_size)
    if module in ("lm_head", "embed_tokens"):
        return plan.bounds("vocab", rank, cfg.vocab_size)
    raise KeyError(module)


def shard_spec(
    name: str, cfg: ModelConfig, plan: Plan, rank: int, *, owned: bool = False
) -> ShardSpec | None:
    """The slice of parameter ``name`` (Hugging Face naming) that ``rank`` holds, or None
    if the parameter is replicated. With ``owned``, the part of it that ``rank`` owns: the
    same, except that K/V rows of a shared KV group belong only to the group's owner, so
    the owned slices of all ranks tile the full tensor exactly once."""
    if plan.world_size == 1:
        return None
    m = _NAME.search(name)
    if m is None:
        return None
    module, lora, kind = m["module"], m["lora"], m["kind"]
    if module == "embed_tokens":
        if not cfg.tie_word_embeddings:
            return None  # untied: replicated embedding, no communication needed
        return ShardSpec(0, *_range(cfg, plan, rank, module))
    if module in COLUMN:
        if lora == "A":
            return None
        return ShardSpec(0, *_range(cfg, plan, rank, module, owned))
    if module in ROW:
        if lora == "B" or kind == "bias":
            return None
        return ShardSpec(1, *_range(cfg, plan, rank, module))
    return None


def owned_spec(name: str, cfg: ModelConfig, plan: Plan, rank: int) -> ShardSpec | None:
    """``shard_spec(..., owned=True)``: the slice of ``name`` that ``rank`` owns."""
    return shard_spec(name, cfg, plan, rank, owned=True)


def owned_part(
    t: torch.Tensor, name: str, cfg: ModelConfig, plan: Plan, rank: int
) -> tuple[torch.Tensor, ShardSpec | None]:
    """The owned part of ``rank``'s local ``t`` (a parameter, its gradient or an AdamW
    moment of ``name``) and where it lies in the full tensor; None = replicated."""
    held, own = shard_spec(name, cfg, plan, rank), owned_spec(name, cfg, plan, rank)
    if held is None or own is None:
        return t, None
    return t.narrow(held.dim, own.start - held.start, own.end - own.start), own


def kv_rows(name: str) -> bool:
    """True for tensors split along K/V heads (k/v weight, bias and LoRA B): the ones whose
    rows of a shared KV group several ranks hold."""
    m = _NAME.search(name)
    return m is not None and m["module"] in ("k_proj", "v_proj") and m["lora"] != "A"


def partial_grad(name: str) -> bool:
    """True for replicated parameters whose gradient is a per-rank partial sum that must be
    all-reduced: LoRA A on a column-parallel base, LoRA B on a row-parallel base, and
    Qwen3's per-head q/k norms (each rank normalises only its own heads; a shared K head's
    ``k_norm`` gradient is split among its sharing ranks like its K rows', so the same sum
    completes it). The rows of shared KV groups are summed separately
    (:mod:`xronos.parallel.shared`)."""
    m = _NAME.search(name)
    if m is None:
        return False
    module, lora = m["module"], m["lora"]
    if module in ("q_norm", "k_norm"):
        return True
    return (module in COLUMN and lora == "A") or (module in ROW and lora == "B")
