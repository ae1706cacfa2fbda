"""What a device's part of the model needs in memory: the planner's byte counts.

Weights, their gradients and AdamW's two moments (fp32, four copies when the weights train;
the frozen weights alone under LoRA), and the activations a training step keeps for its
backward, per unit of each segment (:func:`unit_bytes`) and for what every device holds
whatever its units (:func:`base_bytes`). The activations are counted from the model's code;
a real step needs more while its backward runs, and the profiler scales the count to what a
whole step of the model measured on the device (:func:`memory_scale`).
"""

from __future__ import annotations

import math

from xronos.model.head import CHUNK_TOKENS
from xronos.planner.plan import segment_units
from xronos.profiler.measure import Shape

BYTES_FP32 = 4


def unit_bytes(shape: Shape, act_scale: float = 1.0) -> dict[str, int]:
    """Bytes per unit: weights (+ grads + two AdamW moments when trained) + activations,
    these times ``act_scale`` (what the whole step measured over this count, see
    :func:`memory_scale`)."""
    cfg = shape.cfg
    per_param = BYTES_FP32 if shape.lora is not None else 4 * BYTES_FP32
    tokens = shape.batch_size * shape.seq_len
    h = cfg.hidden_size
    # One query head: its q and o columns plus its share of its group's K/V. A device
    # whose range cuts a KV group also holds that group's whole K/V (at most one extra
    # group per cut side); that constant is not modelled per unit.
    head_width = math.ceil(cfg.kv_group_width / cfg.q_per_kv)
    attn_params = h * head_width + cfg.head_dim * h
    mlp_params = 3 * h * shape.mlp_chunk
    vocab_params = h * shape.vocab_chunk
    act = BYTES_FP32 * tokens * act_scale
    live = 1 if shape.recompute else cfg.num_layers  # layers whose activations are held
    # a vocabulary row's logits and their gradient, per token; checkpointing, per token of
    # at most one chunk (xronos.model.head)
    head_act = BYTES_FP32 * (min(tokens, CHUNK_TOKENS) if shape.recompute else tokens) * act_scale
    # saved per MLP column: gate, its SiLU, up and their product (the down projection's input)
    return {
        "attn": cfg.num_layers * attn_params * per_param + int(live * act * 2 * head_width),
        "mlp": cfg.num_layers * mlp_params * per_param + int(live * act * 4 * shape.mlp_chunk),
        "vocab": vocab_params * per_param + int(head_act * 2 * shape.vocab_chunk),
    }


def base_bytes(shape: Shape, act_scale: float = 1.0) -> int:
    """Bytes every device needs whatever its units: replicated weights and activations
    (these times ``act_scale``)."""
    cfg = shape.cfg
    per_param = BYTES_FP32 if shape.lora is not None else 4 * BYTES_FP32
    emb = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * per_param
    # per layer six hidden states; recomputing, the two regions' inputs and one layer's six
    per_token = 2 * cfg.num_layers + 6 if shape.recompute else 6 * cfg.num_layers
    acts = BYTES_FP32 * shape.batch_size * shape.seq_len * cfg.hidden_size * per_token
    return emb + int(acts * act_scale) + 64 * 2**20  # + the runtime itself


def whole_need(shape: Shape, act_scale: float = 1.0) -> int:
    """Bytes the whole model needs on one device (every unit of every segment)."""
    totals = segment_units(shape.cfg, shape.mlp_chunk, shape.vocab_chunk)
    units = unit_bytes(shape, act_scale)
    return base_bytes(shape, act_scale) + sum(units[s] * totals[s] for s in totals)


def memory_scale(shape: Shape, measured: int) -> float:
    """The factor on the activations' count that makes the whole model's need what one
    real step of it took (``measured``: its peak resident memory above the process before
    the model, :attr:`~xronos.profiler.whole.WholeStep.peak_bytes`); never below 1.

    The count is of the tensors a step keeps for its backward; a real step also holds the
    backward's own gradients of them while it runs and what the allocator keeps between
    them: on ``small`` at 8 × 512 tokens it peaked 35 % above the count (1,901 MiB against
    1,408), at 4 × 64 a few per cent. Never below: a measurement that read low (memory the
    process had freed and reused) must not make a plan that the count refuses."""
    fixed, full = whole_need(shape, 0.0), whole_need(shape, 1.0)
    if full <= fixed:
        return 1.0
    return max(1.0, (measured - fixed) / (full - fixed))
