"""Which slice of each named parameter a rank holds under a Plan.

Words, defined once (Megatron's, not distributed-llama's):

* **column-parallel** ``Y = X A`` with ``A = [A_1 … A_R]`` split along its *output* dim:
  each rank computes a slice of ``Y``. In PyTorch's ``weight = Aᵀ (out, in)`` this is a
  split of ``weight`` along **dim 0**. Used for q/k/v, gate/up and the LM head.
* **row-parallel** ``A`` split along its *input* dim: each rank computes a partial ``Y``
  that an all-reduce sums. ``weight`` is split along **dim 1**. Used for o and down.

Head geometry of one layer with 4 KV groups on 3 ranks (plan attn = [2, 1, 1])::

    q_proj rows   | g0: q0 q1 | g1: q2 q3 | g2: q4 q5 | g3: q6 q7 |   (q_per_kv = 2)
    k/v_proj rows | g0: k0    | g1: k1    | g2: k2    | g3: k3    |
                  '------ rank 0 ---------'-- rank 1 --'-- rank 2 --'

LoRA follows its base layer (peft's ``LoraParallelLinear``): on a column-parallel base
``lora_A`` is replicated and ``lora_B`` is split like the base's rows; on a row-parallel
base ``lora_A`` is split like the base's columns and ``lora_B`` is replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


def _range(cfg: ModelConfig, plan: Plan, rank: int, module: str) -> tuple[int, int]:
    """Element range of ``module``'s partitioned dim (output for column, input for row)."""
    d = cfg.head_dim
    if module in ("q_proj", "o_proj"):
        g0, g1 = plan.bounds("attn", rank, cfg.num_kv_heads)
        return g0 * cfg.q_per_kv * d, g1 * cfg.q_per_kv * d
    if module in ("k_proj", "v_proj"):
        g0, g1 = plan.bounds("attn", rank, cfg.num_kv_heads)
        return g0 * d, g1 * d
    if module in ("gate_proj", "up_proj", "down_proj"):
        return plan.bounds("mlp", rank, cfg.intermediate_size)
    if module in ("lm_head", "embed_tokens"):
        return plan.bounds("vocab", rank, cfg.vocab_size)
    raise KeyError(module)


def shard_spec(name: str, cfg: ModelConfig, plan: Plan, rank: int) -> ShardSpec | None:
    """The slice of parameter ``name`` (Hugging Face naming) that ``rank`` holds, or None
    if the parameter is replicated."""
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
        return ShardSpec(0, *_range(cfg, plan, rank, module))
    if module in ROW:
        if lora == "B" or kind == "bias":
            return None
        return ShardSpec(1, *_range(cfg, plan, rank, module))
    return None


def partial_grad(name: str) -> bool:
    """True for replicated parameters whose gradient is a per-rank partial sum that must be
    all-reduced: LoRA A on a column-parallel base, LoRA B on a row-parallel base, and
    Qwen3's per-head q/k norms (each rank normalises only its own heads)."""
    m = _NAME.search(name)
    if m is None:
        return False
    module, lora = m["module"], m["lora"]
    if module in ("q_norm", "k_norm"):
        return True
    return (module in COLUMN and lora == "A") or (module in ROW and lora == "B")
