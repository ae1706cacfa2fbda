"""Pipeline checkpoints: each stage saves what it owns, in the format every strategy reads.

A pipeline (or hybrid) checkpoint is an ordinary reshardable checkpoint
(:mod:`xronos.checkpoint`) whose saving ranks split the model by stage instead of by
units: each stage's parameters, their AdamW state and its dropout generators lie whole in
its rank's file (a tensor-parallel stage: split among its members as in a TP checkpoint),
and every rank's global RNG in its own. So a pipeline run resumes on another pipeline, a
hybrid or tensor parallelism, and the other way round, and exports like any run::

    a hybrid: stage 0 (layer 0) on rank 0, stage 1 (layers 1-3, norm, tied head) as TP
    on ranks 1 and 2
      rank0.safetensors   layer 0 whole, its AdamW moments; rank 0's RNG
      rank1.safetensors   rank 1's slices of layers 1-3 and of the tied matrix (and of
                          their moments), the norms whole; rank 1's RNG
      rank2.safetensors   rank 2's slices; rank 2's RNG

A tied matrix trains on the last stage (:mod:`xronos.pipeline.tied`): the last stage
saves it with its moments; the first stage's copy is restored as a value only. Nothing is
gathered: rank 0 writes the other ranks' tensors one by one as they arrive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xronos.checkpoint.layout import TensorLayout
from xronos.checkpoint.load import Loaded, Share, load_checkpoint
from xronos.checkpoint.save import checkpoint_meta, write_checkpoint
from xronos.checkpoint.state import (
    RankState,
    base_dtype,
    collect,
    describe_lora,
    fingerprint_of,
    frozen_sums,
    trainable,
)
from xronos.parallel.shard import build_meta, stage_holds
from xronos.pipeline.runner import PipelineRunner


def copies(runner: PipelineRunner) -> frozenset[str]:
    """Names this stage holds but another owns: the first stage's copy of a tied matrix."""
    if runner.tied is None or runner.tied.owner:
        return frozenset()
    return frozenset(n for n, p in runner.model.named_parameters() if p is runner.tied.weight)


def stage_state(runner: PipelineRunner) -> RankState:
    """This rank's tensors and their layouts over the pipeline's ranks: its stage's
    (:func:`~xronos.checkpoint.state.collect` under the stage's plan), every rank of a
    stage in the group's rank order, a whole tensor in the stage leader's file."""
    members, n = runner.layout.groups[runner.stage], runner.group.size
    local = collect(runner.model, runner.optimizer, runner.cfg, runner.stage_plan, runner.member)
    skip = copies(runner)
    out = RankState(params={k: v for k, v in local.params.items() if k not in skip})
    for key, lay in local.layouts.items():
        kind, _, name = key.rpartition("/")
        if name in skip and kind.split("/")[0] in ("param", "optim"):
            continue
        wide = key
        if kind == "rng/torch":  # each rank's global RNG, under its rank in the pipeline
            wide = f"rng/torch/{members[int(name)]}"
        if lay.dim is None:
            out.layouts[wide] = TensorLayout(lay.shape, lay.dtype, rank=members[lay.rank])
        else:
            out.layouts[wide] = TensorLayout(lay.shape, lay.dtype, lay.dim, _widen(lay, members, n))
        if key in local.tensors:
            out.tensors[wide] = local.tensors[key]
    return out


def _widen(lay: TensorLayout, members: tuple[int, ...], n: int) -> tuple[tuple[int, int], ...]:
    """A stage's split (one range per member) as one range per pipeline rank: the
    others' empty, so the ranges still tile the tensor in rank order."""
    out, pos = [], 0
    for r in range(n):
        if r in members:
            start, end = lay.ranges[members.index(r)]
            if start != pos:
                raise RuntimeError(f"stage ranges {lay.ranges} out of the members' order")
            out.append((start, end))
            pos = end
        else:
            out.append((pos, pos))
    return tuple(out)


def fingerprint(runner: PipelineRunner) -> list[float] | None:
    """The whole model's base fingerprint (collective over the pipeline): each stage
    counts the frozen weights that no earlier stage holds (a frozen tied matrix lies on
    both end stages), a TP stage each element once among its members."""
    ranges, cfg, last = runner.pplan.layer_ranges, runner.cfg, len(runner.pplan.layer_ranges) - 1

    def first_holder(name: str) -> int:
        return next(j for j, r in enumerate(ranges) if stage_holds(name, cfg, r, j == 0, j == last))

    acc = frozen_sums(
        runner.model,
        cfg,
        runner.stage_plan,
        runner.member,
        lambda name: first_holder(name) == runner.stage,
    )
    runner.group.all_reduce(acc, "ckpt.fingerprint")
    return fingerprint_of(acc)


def save_stages(
    runner: PipelineRunner, path: Path, layout: dict[str, Any], extra: dict[str, Any]
) -> None:
    """Write the pipeline's checkpoint of ``runner.steps_done`` steps to ``path``
    (collective; the group's rank 0 writes every file). ``layout``: the pipeline's or
    the hybrid's plan, recorded as the checkpoint's ``plan``."""
    source = runner.source
    local = stage_state(runner)
    base = {"dtype": base_dtype(runner.model), "fingerprint": fingerprint(runner)}
    parts = runner.group.gather_object((local.layouts, local.params))
    if runner.group.rank == 0:
        for layouts, params in parts:
            local.layouts.update(layouts)
            local.params.update(params)
    whole = build_meta(source.cfg, source.lora, source.seed)
    meta = checkpoint_meta(
        step=runner.steps_done,
        world_size=runner.group.size,
        layout=layout,
        cfg=source.cfg,
        lora=describe_lora(whole),
        base=base,
        optimizer=True,
        extra=extra,
    )
    write_checkpoint(path, local, meta, runner.group)


def load_stages(runner: PipelineRunner, path: str) -> Loaded:
    """Restore this stage from a checkpoint of any strategy (collective over the
    pipeline): its parameters, their AdamW state, its dropout generators and this
    rank's global RNG; sets ``runner.steps_done``."""
    source = runner.source
    whole = build_meta(source.cfg, source.lora, source.seed)
    share = Share(
        whole=frozenset(n for n, _ in trainable(whole)),
        copies=copies(runner),
        lora=describe_lora(whole),
        fingerprint=lambda: fingerprint(runner),
        rank=runner.group.rank,
    )
    loaded = load_checkpoint(
        path,
        model=runner.model,
        optimizer=runner.optimizer,
        cfg=runner.cfg,
        plan=runner.stage_plan,
        group=runner.tp_group,
        share=share,
    )
    runner.steps_done = loaded.step
    return loaded
