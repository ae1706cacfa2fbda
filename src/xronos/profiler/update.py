"""Timing the step's end: the gradient norm and the AdamW update, per part of the model.

Every segment's profiled time already contains its parameters' update (the profiler times
forward + backward + update), which is right for tensor parallelism, where each device
updates its shard inside the step. A pipeline updates once, after its whole schedule, while
the other stages wait on the norm's all-reduce: the planner takes the update out of the
micro-batches and adds the slowest stage's update to the step
(:mod:`xronos.planner.pipesearch`). This module measures it on the device, inside its
limits: one decoder layer's trained tensors as they are (with LoRA, many small adapters),
and the embedding and the head by the per-parameter rate of the layer's large tensors.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from xronos.model.llama import LlamaForCausalLM
from xronos.model.lora import add_lora
from xronos.profiler.measure import Shape, best_time
from xronos.train.optim import new_adamw


def trained_shapes(shape: Shape) -> dict[str, list[tuple[int, ...]]]:
    """The trained tensors' shapes of one decoder layer (``layer``), the token embedding
    (``embed``) and the final norm with the LM head (``head``; a tied model's head is the
    embedding matrix, which a pipeline's last stage owns and updates: the first stage's
    ``embed`` update is then not paid)."""
    cfg = dataclasses.replace(shape.cfg, num_layers=1)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
        if shape.lora is not None:
            add_lora(model, shape.lora, seed=0)
    out: dict[str, list[tuple[int, ...]]] = {"layer": [], "embed": [], "head": []}
    for name, p in model.named_parameters():  # a tied LM head is listed once, as the embedding
        if not p.requires_grad:
            continue
        if name.startswith("model.layers."):
            out["layer"].append(tuple(p.shape))
        elif name.startswith("model.embed_tokens."):
            out["embed"].append(tuple(p.shape))
            if cfg.tie_word_embeddings:
                out["head"].append(tuple(p.shape))
        else:  # the final norm, an untied LM head
            out["head"].append(tuple(p.shape))
    return out


def time_tensors_update(shapes: list[tuple[int, ...]], repeats: int = 2) -> float:
    """Seconds of the step's end over tensors of ``shapes``: per-tensor fp32 norms of the
    gradients, then one AdamW step (its state made by a first, untimed step)."""
    if not shapes:
        return 0.0
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt = new_adamw(params, lr=1e-6)
    grads = [p.grad for p in params if p.grad is not None]

    def step() -> None:
        torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        opt.step()

    return best_time(step, repeats=repeats, warmup=1)


def measure_update(shape: Shape, repeats: int = 3) -> dict[str, float]:
    """Seconds of the step-end update of one layer, the embedding and the head (see the
    module docstring); 0 for a part that does not train."""
    parts = trained_shapes(shape)
    layer = time_tensors_update(parts["layer"], repeats)
    numel = {k: sum(math.prod(s) for s in v) for k, v in parts.items()}
    # the rate of the layer's tensors prices the big matrices (memory-bound, like the layer's)
    rate = layer / numel["layer"] if numel["layer"] else 0.0
    return {"layer": layer, "embed": rate * numel["embed"], "head": rate * numel["head"]}
