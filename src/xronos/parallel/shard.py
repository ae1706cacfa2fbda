"""Build a model that holds only this rank's slices, and wire its communication seams.

The flow (docs/architecture.md): ``Plan -> build_model(cfg, plan, group, source) -> session``, in
three steps, as torchtitan builds and then parallelises:

1. :func:`build_meta`: the full single-device model on the ``meta`` device (no memory).
2. :func:`materialise`: every parameter at its *local* shape, its values taken from the
   source: a seeded preset (every rank draws the same master tensor and keeps its slice,
   so 1 rank and N ranks start bit-identical) or a safetensors checkpoint (each rank
   reads only its slices).
3. :func:`apply_tp`: the ``enter``/``exit`` seams of every block become
   ``copy_to_tp``/``reduce_from_tp``, and the LM head (and, if tied, the embedding)
   becomes vocab-parallel; or :func:`apply_pp_stage` for a pipeline stage.

A pipeline stage (``layers=(a, b)``, ``embed=``, ``head=``) materialises only its decoder
layers ``[a, b)`` and, if asked, the embedding and/or the final norm + LM head; the parts
other stages hold become :class:`Absent` (no parameters), so parameter names stay Hugging
Face's. Preset values are still drawn for every parameter in order, so a stage holds exactly
the values the single-device model holds. With tied embeddings a head stage also holds the
embedding matrix (its LM head weight).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch import nn

from xronos.comm.mappings import ReduceFromTP, TPGroup
from xronos.comm.relay import RemoteModelReader, installed
from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.model.llama import Attention, Block, LlamaForCausalLM, LMHead
from xronos.model.lora import LoRAConfig, LoRALinear, add_lora, lora_init
from xronos.model.readers import ModelReader, open_model_reader
from xronos.model.rope import RotaryEmbedding
from xronos.parallel.columns import ColumnSeam
from xronos.parallel.spec import ShardSpec, shard_spec
from xronos.parallel.vocab import VocabParallelEmbedding, VocabParallelHead
from xronos.planner.plan import Plan, segment_kind


def _preset_tensor(name: str, shape: torch.Size, gen: torch.Generator, std: float) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=gen) * std


def _take(t: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    if spec is None:
        return t
    return t.narrow(spec.dim, spec.start, max(0, min(spec.end, t.shape[spec.dim]) - spec.start))


def _set_param(model: nn.Module, name: str, value: torch.Tensor, trainable: bool) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, attr, nn.Parameter(value.contiguous(), requires_grad=trainable))
    if isinstance(owner, nn.Linear) and attr == "weight":
        owner.out_features, owner.in_features = value.shape


class Absent(nn.Module):
    """A part of the model that another pipeline stage holds: no parameters, cannot run."""

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("this part of the model is held by another pipeline stage")


def stage_holds(
    name: str, cfg: ModelConfig, layers: tuple[int, int], embed: bool, head: bool
) -> bool:
    """Whether a pipeline stage materialises parameter ``name``."""
    if name.startswith("model.layers."):
        return layers[0] <= int(name.split(".")[2]) < layers[1]
    if name.startswith("model.embed_tokens."):
        return embed or (head and cfg.tie_word_embeddings)
    return head  # model.norm.*, lm_head.*


def _drop_absent(
    model: LlamaForCausalLM, cfg: ModelConfig, layers: tuple[int, int], embed: bool, head: bool
) -> None:
    """Replace the parts this stage does not hold (still on ``meta``) by :class:`Absent`."""
    for i in range(cfg.num_layers):
        if not layers[0] <= i < layers[1]:
            model.model.layers[i] = Absent()
    if not (embed or (head and cfg.tie_word_embeddings)):
        model.model.embed_tokens = Absent()  # type: ignore[assignment]
    if not head:
        model.model.norm = Absent()  # type: ignore[assignment]
        model.lm_head = Absent()  # type: ignore[assignment]
        model.head = Absent()  # type: ignore[assignment]


def build_meta(cfg: ModelConfig, lora: LoRAConfig | None = None, seed: int = 0) -> LlamaForCausalLM:
    """The whole single-device model on the ``meta`` device: every parameter at its full
    shape, no memory, no values (LoRA adapters added when ``lora`` is given)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.rotary = RotaryEmbedding(cfg)  # a buffer computed from the config, not loaded
    if lora is not None:
        add_lora(model, lora, seed=seed)
    return model


def materialise(
    model: LlamaForCausalLM,
    cfg: ModelConfig,
    plan: Plan,
    rank: int,
    *,
    model_dir: str | Path | None = None,
    seed: int = 0,
    trainable_base: bool = True,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.02,
    keep: Callable[[str], bool] = lambda name: True,
) -> None:
    """Give every parameter that ``keep`` names its values at the slice ``plan`` gives
    ``rank``: a checkpoint's slice (each rank reads only its own), or the slice of a seeded
    master tensor (every rank draws the same stream, so 1 and N ranks start bit-identical).
    LoRA A is drawn from its own stream, B starts at zero. Parameters not kept stay on
    ``meta``; the preset streams still advance past them."""
    base_gen = torch.Generator().manual_seed(seed)
    lora_gen = torch.Generator().manual_seed(seed + 1)
    reader = open_reader(model_dir) if model_dir is not None else None
    try:
        for name, p in list(model.named_parameters()):
            spec = shard_spec(name, cfg, plan, rank)
            if ".lora_" in name:
                full = torch.zeros(p.shape)
                if ".lora_A." in name:
                    lora_init(full, lora_gen)  # drawn even when not kept: same stream
                if keep(name):
                    _set_param(model, name, _take(full, spec), trainable=True)
            elif not keep(name):
                if reader is None:  # advance the preset stream past this tensor
                    _preset_tensor(name, p.shape, base_gen, init_std)
            elif reader is not None:
                t = _read(reader, name, spec)
                want = list(_take(torch.empty(p.shape, device="meta"), spec).shape)
                if list(t.shape) != want:
                    raise UserError(
                        f"{model_dir}: tensor {name!r} has shape {list(t.shape)} where "
                        f"config.json implies {want}; the checkpoint and config.json disagree"
                    )
                _set_param(model, name, t.to(dtype), trainable=trainable_base)
            else:
                t = _take(_preset_tensor(name, p.shape, base_gen, init_std), spec)
                _set_param(model, name, t.to(dtype), trainable=trainable_base)
    finally:
        if reader is not None:
            reader.close()


def apply_pp_stage(
    model: LlamaForCausalLM, cfg: ModelConfig, layers: tuple[int, int], embed: bool, head: bool
) -> None:
    """Make ``model`` a pipeline stage: the parts other stages hold become :class:`Absent`;
    a head stage of a tied model keeps the embedding matrix as its LM head weight."""
    _drop_absent(model, cfg, layers, embed, head)


def apply_tp(model: LlamaForCausalLM, cfg: ModelConfig, plan: Plan, group: TPGroup) -> None:
    """Make a materialised shard tensor-parallel over ``group``: attention layers learn
    where their query heads start within their first KV group, LoRA layers which input
    columns they hold, and with more than one rank the seams become Megatron's
    conjugate pairs and the LM head (and a tied embedding) vocab-parallel."""
    if cfg.tie_word_embeddings and not isinstance(model.lm_head, Absent):
        model.lm_head.weight = model.model.embed_tokens.weight
    h0, h1 = plan.bounds("attn", group.rank, cfg.num_heads)
    for m in model.modules():
        if isinstance(m, Attention):  # its first query head within its first KV group
            m.q_offset = h0 % cfg.q_per_kv if h1 > h0 else 0
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            spec = shard_spec(name + ".weight", cfg, plan, group.rank)
            m.in_range = (spec.start, spec.end) if spec and spec.dim == 1 else (0, m.full_in)
    if group.size > 1:
        wire_seams(model, cfg, plan, group)


def build_model(
    cfg: ModelConfig,
    plan: Plan,
    group: TPGroup,
    *,
    model_dir: str | Path | None = None,
    seed: int = 0,
    lora: LoRAConfig | None = None,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.02,
    layers: tuple[int, int] | None = None,
    embed: bool = True,
    head: bool = True,
    recompute: bool = False,
) -> LlamaForCausalLM:
    """This rank's shard of the model, ready to train or generate:
    :func:`build_meta` → :func:`materialise` → :func:`apply_tp` or :func:`apply_pp_stage`.

    Args:
        cfg: model shape.
        plan: units per device; ``plan.world_size`` must equal ``group.size``.
        group: the tensor-parallel group (size 1 = plain single-device model).
        model_dir: Hugging Face directory or GGUF file to load from; None = seeded preset
            weights.
        seed: master-weight seed for presets and the LoRA initialisation seed.
        lora: adapter config; None = full fine-tuning (every parameter trainable).
        dtype: dtype of the base weights (LoRA adapters are always fp32).
        layers: pipeline stage: hold only decoder layers ``[start, end)`` (None = all).
        embed: pipeline stage: hold the token embedding.
        head: pipeline stage: hold the final norm and the LM head (and, if tied, the
            embedding matrix it shares).
        recompute: activation checkpointing in every block (:mod:`xronos.model.recompute`).

    A stage on a group of several ranks (a hybrid's tensor-parallel stage) is both: the
    parts it holds are sharded by ``plan`` over ``group``.
    """
    if plan.world_size != group.size:
        raise ValueError(f"plan has {plan.world_size} devices but the group has {group.size}")
    plan.check(cfg)
    stage = layers is not None or not embed or not head
    held = layers if layers is not None else (0, cfg.num_layers)
    model = build_meta(cfg, lora, seed)
    materialise(
        model,
        cfg,
        plan,
        group.rank,
        model_dir=model_dir,
        seed=seed,
        trainable_base=lora is None,
        dtype=dtype,
        init_std=init_std,
        keep=lambda name: not stage or stage_holds(name, cfg, held, embed, head),
    )
    if stage:
        apply_pp_stage(model, cfg, held, embed, head)
    apply_tp(model, cfg, plan, group)
    for block in model.model.layers:
        if isinstance(block, Block):  # not a pipeline stage's absent layer
            block.recompute = recompute
    if isinstance(model.head, LMHead | VocabParallelHead):  # not a stage's absent head
        model.head.chunked = recompute
    return model


def open_reader(path: str | Path) -> ModelReader:
    """The reader of a checkpoint: a ``.gguf`` file, else a Hugging Face directory; on a
    device that holds no files (:mod:`xronos.comm.relay`), the coordinator's, slice by slice."""
    client = installed()
    if client is not None:
        return RemoteModelReader(client, str(path))
    return open_model_reader(path)


def _read(reader: ModelReader, name: str, spec: ShardSpec | None) -> torch.Tensor:
    if spec is None:
        return reader.read(name)
    full_len = reader.shape(name)[spec.dim]
    return reader.read(name, spec.dim, spec.start, min(spec.end, full_len))


def wire_seams(model: LlamaForCausalLM, cfg: ModelConfig, plan: Plan, group: TPGroup) -> None:
    """Install the collectives: two conjugate pairs per block, a vocab-parallel head (on
    the parts this rank holds: a tensor-parallel pipeline stage has :class:`Absent` ones)."""
    for i, layer in enumerate(cast("list[Block]", model.model.layers)):
        if isinstance(layer, Absent):
            continue
        attn, mlp = segment_kind("attn", i), segment_kind("mlp", i)
        layer.self_attn.enter = ColumnSeam(group, f"L{i}.attn.in", attn)
        layer.self_attn.exit = ReduceFromTP(group, f"L{i}.attn.out", attn)
        layer.mlp.enter = ColumnSeam(group, f"L{i}.mlp.in", mlp)
        layer.mlp.exit = ReduceFromTP(group, f"L{i}.mlp.out", mlp)
    v0, _ = plan.bounds("vocab", group.rank, cfg.vocab_size)
    if not isinstance(model.lm_head, Absent):
        model.head = VocabParallelHead(model.lm_head, v0, cfg.vocab_size, group)
    if cfg.tie_word_embeddings and not isinstance(model.model.embed_tokens, Absent):
        model.model.embed_tokens = VocabParallelEmbedding(  # type: ignore[assignment]
            model.model.embed_tokens.weight, v0, group
        )
