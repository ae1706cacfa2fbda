"""Writing a checkpoint collectively and atomically.

Every rank of the group calls :func:`save_checkpoint` at the same point of training::

    rank 0's pid ──all-reduce──► every rank: staging dir  <ckpt>.tmp-<pid>
    rank 0: create it                               ─┐
    each rank: its shard as safetensors bytes ──►    │ each phase ends in an all-reduce of
    rank 0: write + fsync rank<r>.safetensors of all │ a failure flag: a failure anywhere
    rank 0: write + fsync index.json, meta.json      │ stops every rank (no one hangs)
    rank 0: rename staging dir -> <ckpt>, COMPLETE  ─┘

Only rank 0 writes: the other ranks send it their shards (SHA-256 checked on arrival),
so the devices need no shared filesystem and nothing of the run lands on them. A crash at
any point leaves either no ``<ckpt>`` or one without ``COMPLETE``; both are ignored by
:func:`~xronos.checkpoint.latest_checkpoint`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from xronos.comm.blobs import recv_tensors, send_tensors
from xronos.comm.groups import new_group
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.model.llama import LlamaForCausalLM
from xronos.planner.plan import Plan
from xronos.utils import atomic_write_text

from .atomic import fsync_dir, fsync_file, replace_dir, staging_path
from .layout import COMPLETE, FORMAT, INDEX, META, VERSION, rank_file, write_json
from .state import (
    RankState,
    base_dtype,
    base_fingerprint,
    collect,
    config_dict,
    config_hash,
    describe_lora,
)
from .stream import write_streamed, write_tensors

SHARD_TAG = 7201
"""Point-to-point tag of the shards sent to rank 0."""


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    *,
    model: LlamaForCausalLM,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    cfg: ModelConfig,
    plan: Plan,
    group: TPGroup,
    extra: dict[str, Any],
) -> None:
    """Write this group's training state to ``ckpt_dir``; collective, every rank calls it.

    Args:
        ckpt_dir: the checkpoint directory to create (replaced if it exists), usually
            :func:`~xronos.checkpoint.checkpoint_path` ``(run_dir, step)``.
        model: this rank's shard.
        optimizer: its optimizer (AdamW moments are saved), or None for weights only.
        step: optimizer steps done so far (what a resumed run continues from).
        cfg, plan, group: the model shape, the Plan the shard was built with, the group.
        extra: JSON-serialisable caller state (model source, data position, ...), returned
            by :func:`~xronos.checkpoint.load_checkpoint`. Rank 0's copy is written.
    Raises:
        UserError: the checkpoint could not be written (disk full, no permission).
    """
    local = collect(model, optimizer, cfg, plan, group.rank)
    meta = checkpoint_meta(
        step=step,
        world_size=group.size,
        layout=plan.to_dict(),
        cfg=cfg,
        lora=describe_lora(model),
        base={"dtype": base_dtype(model), "fingerprint": base_fingerprint(model, cfg, plan, group)},
        optimizer=optimizer is not None,
        extra=extra,
    )
    write_checkpoint(ckpt_dir, local, meta, group)


def checkpoint_meta(
    *,
    step: int,
    world_size: int,
    layout: dict[str, Any],
    cfg: ModelConfig,
    lora: dict[str, Any] | None,
    base: dict[str, Any],
    optimizer: bool,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """``meta.json`` of a checkpoint: ``layout`` is how the saving ranks split the model
    (a Plan's, a pipeline's or a hybrid's dict, written as ``plan``), ``base`` the frozen
    weights' dtype and fingerprint, ``optimizer`` whether AdamW's state is saved (a
    checkpoint without it can be exported, not resumed)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "world_size": world_size,
        "plan": layout,
        "model_config": config_dict(cfg),
        "config_hash": config_hash(cfg),
        "lora": lora,
        "base": base,
        "optimizer": optimizer,
        "extra": json.loads(json.dumps(extra)),  # fails alike on every rank if not JSON
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_checkpoint(
    ckpt_dir: str | os.PathLike[str], local: RankState, meta: dict[str, Any], group: TPGroup
) -> None:
    """Write ``meta`` and every rank's ``local`` state to ``ckpt_dir`` (collective over
    ``group``, whose rank 0 writes every file); rank 0's ``local`` holds the index of
    every tensor, the others' their own tensors.

    Raises:
        UserError: the checkpoint could not be written (disk full, no permission).
    """
    final = Path(ckpt_dir)
    pid = torch.tensor([os.getpid() if group.rank == 0 else 0], dtype=torch.int64)
    group.all_reduce(pid, "ckpt.pid")
    staged = staging_path(final, int(pid.item()))

    def cleanup() -> None:
        if group.rank == 0:
            shutil.rmtree(staged, ignore_errors=True)

    lead = group.rank == 0
    _phase(group, final, "ckpt.prepare", lambda: _prepare(final, staged) if lead else None, cleanup)
    _phase(group, final, "ckpt.write", lambda: _write(staged, group, local, meta), cleanup)
    _phase(
        group, final, "ckpt.commit", lambda: _commit(staged, final, meta) if lead else None, cleanup
    )


def _phase(
    group: TPGroup, final: Path, name: str, fn: Callable[[], None], cleanup: Callable[[], None]
) -> None:
    """Run ``fn`` on this rank, then agree with the others on whether all succeeded."""
    error: Exception | None = None
    try:
        fn()
    except Exception as e:
        error = e
    failed = torch.tensor([0.0 if error is None else 1.0])
    group.all_reduce(failed, name)
    if error is None and failed.item() == 0:
        return
    cleanup()
    if isinstance(error, OSError):
        raise UserError(
            f"could not write checkpoint {final}: {error.strerror or error} "
            f"({error.filename or final}); free disk space or fix the run directory's permissions"
        ) from error
    if error is not None:
        raise error
    raise RuntimeError(f"checkpoint {final}: another rank failed while writing it")


def _prepare(final: Path, staged: Path) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f"{final.name}.tmp-*"):  # left by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    staged.mkdir()


def _write(staged: Path, group: TPGroup, local: RankState, meta: dict[str, Any]) -> None:
    """Rank 0 writes every rank's file (the others send theirs), tensor by tensor as they
    arrive (:mod:`.stream`: a shard is never held twice); a failed write does not stop it
    receiving the rest, so no sender is left waiting."""
    metadata = {"format": "pt", "xronos": FORMAT}
    if group.rank != 0:
        send_tensors(local.tensors, _global(group, 0), _pg(group), SHARD_TAG, None)
        return
    error: Exception | None = None
    try:
        write_tensors(staged / rank_file(0), local.tensors, metadata)
    except Exception as e:  # re-raised once every shard has arrived
        error = e
    for r in range(1, group.size):
        entries, chunks = recv_tensors(_global(group, r), _pg(group), SHARD_TAG, None)
        try:
            if error is None:
                write_streamed(staged / rank_file(r), entries, chunks, metadata)
        except Exception as e:
            error = e
        try:
            for _ in chunks:  # the rest of this rank's tensors, after a failed write
                pass
        except Exception as e:
            error = error or e
    if error is not None:
        raise error
    index = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": meta["world_size"],
        "tensors": {k: v.to_json() for k, v in local.layouts.items()},
        "params": local.params,
    }
    for name, data in ((INDEX, index), (META, meta)):
        write_json(staged / name, data)
        fsync_file(staged / name)


_SHARD_GROUPS: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup] = {}


def _members(group: TPGroup) -> list[int]:
    pg = group.pg if group.pg is not None else dist.group.WORLD
    assert pg is not None, "a checkpoint of several ranks needs their process group"
    return dist.get_process_group_ranks(pg)


def _pg(group: TPGroup) -> dist.ProcessGroup:
    """A process group over ``group``'s ranks for the shards alone (made on first use by
    every member, which all save together): point-to-point messages on the training
    group would put its ranks' collective sequence numbers out of step."""
    key = (id(dist.group.WORLD), tuple(_members(group)))
    if key not in _SHARD_GROUPS:
        _SHARD_GROUPS[key] = new_group(key[1], local=True)
    return _SHARD_GROUPS[key]


def _global(group: TPGroup, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank``."""
    return _members(group)[rank]


def _commit(staged: Path, final: Path, meta: dict[str, Any]) -> None:
    sizes = {f.name: f.stat().st_size for f in sorted(staged.iterdir())}
    missing = [rank_file(r) for r in range(meta["world_size"]) if rank_file(r) not in sizes]
    if missing:
        raise RuntimeError(f"checkpoint {final}: {', '.join(missing)} not written")
    replace_dir(staged, final)
    marker = {"step": meta["step"], "files": sizes}
    atomic_write_text(final / COMPLETE, json.dumps(marker, indent=1) + "\n")
    fsync_dir(final)
