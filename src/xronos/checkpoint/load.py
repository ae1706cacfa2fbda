"""Finding and loading checkpoints, on any number of ranks and under any Plan.

Loading never unpickles: tensors come from safetensors, everything else from JSON. Each
rank computes the slice of every saved tensor that its *new* Plan gives it
(``shard_spec``) and reads only the overlapping parts of the saving ranks' files.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xronos.comm.mappings import TPGroup
from xronos.comm.relay import RemoteCheckpoint, installed
from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.parallel.spec import ShardSpec, shard_spec
from xronos.planner.plan import Plan

from .layout import (
    COMPLETE,
    FORMAT,
    META,
    VERSION,
    Box,
    SliceReader,
    TensorLayout,
    full_box,
    read_json,
    read_layouts,
)
from .state import (
    base_fingerprint,
    compared_fields,
    describe_lora,
    lora_modules,
    same_fingerprint,
    trainable,
)

CHECKPOINTS = "checkpoints"

Slices = SliceReader | RemoteCheckpoint
"""Where a checkpoint's slices come from: its files here, or the coordinator's."""


@dataclass(frozen=True)
class Share:
    """A part of the model (a pipeline stage) restored from a checkpoint of the whole."""

    whole: frozenset[str]
    """The whole model's trainable parameter names: the checkpoint must hold these."""
    copies: frozenset[str]
    """Names held here whose optimizer state another rank keeps (the first stage's copy
    of a tied matrix): their values are restored, not their state."""
    lora: dict[str, Any] | None
    """The whole model's LoRA settings (:func:`~.state.describe_lora`)."""
    fingerprint: Callable[[], list[float] | None]
    """The whole model's base fingerprint (collective over every part)."""
    rank: int
    """This rank in the whole run's group: whose global RNG state it takes back."""


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_checkpoint` gives back besides the restored tensors."""

    step: int
    """Optimizer steps done when the checkpoint was written."""
    extra: dict[str, Any]
    """The caller's state passed to :func:`~xronos.checkpoint.save_checkpoint`."""


_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def checkpoint_path(run_dir: str | os.PathLike[str], step: int) -> Path:
    """``<run_dir>/checkpoints/step-<step, 8 digits>``: where the checkpoint of ``step`` goes."""
    return Path(run_dir) / CHECKPOINTS / f"step-{step:08d}"


def complete_checkpoints(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every complete checkpoint of ``run_dir`` as (step, directory), oldest first.
    Directories without a ``COMPLETE`` marker (a save that did not finish) and staging
    directories are left out."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(
        (int(m[1]), d)
        for d in root.iterdir()
        if (m := _STEP_DIR.match(d.name)) and d.is_dir() and (d / COMPLETE).is_file()
    )


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint of ``run_dir`` with the highest step, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def prune_checkpoints(run_dir: str | os.PathLike[str], keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints of ``run_dir`` (each loses
    its ``COMPLETE`` marker first, so a deletion cut short never looks complete); returns
    the deleted directories."""
    found = complete_checkpoints(run_dir)
    old = [d for _, d in found[: max(0, len(found) - keep)]]
    for d in old:
        (d / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(d, ignore_errors=True)
    return old


def read_checkpoint_meta(ckpt_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``meta.json`` of a complete checkpoint: ``step``, ``world_size``, ``plan`` (dict),
    ``model_config`` (ModelConfig fields), ``lora`` (r/alpha/dropout/target_modules or
    None), ``base`` (dtype, fingerprint) and the caller's ``extra``.

    Raises:
        UserError: not a checkpoint, incomplete, or damaged (a file of the wrong size).
    """
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        raise UserError(f"checkpoint {ckpt}: no such directory")
    if not (ckpt / COMPLETE).is_file():
        raise UserError(
            f"checkpoint {ckpt} is incomplete (no {COMPLETE} marker: its save did not finish); "
            "resume from an earlier checkpoint"
        )
    meta = read_json(ckpt / META, "metadata")
    if meta.get("format") != FORMAT or int(meta.get("version", -1)) > VERSION:
        raise UserError(
            f"checkpoint {ckpt}: format {meta.get('format')!r} version {meta.get('version')} "
            f"is not one this Xronos reads ({FORMAT} ≤ {VERSION}); upgrade Xronos"
        )
    sizes = read_json(ckpt / COMPLETE, "completion marker").get("files", {})
    for name, size in sizes.items():
        path = ckpt / name
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            raise UserError(
                f"checkpoint {ckpt} is damaged: {name} has {actual} bytes, {size} were "
                "written; resume from another checkpoint"
            )
    return meta


def load_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cfg: ModelConfig,
    plan: Plan,
    group: TPGroup,
    share: Share | None = None,
) -> Loaded:
    """Restore a checkpoint into this rank's freshly built shard; collective for LoRA runs.

    The saving world size and Plan may differ from ``group.size`` and ``plan``. The model
    must have been built from the same source (directory or preset + seed, same LoRA
    settings); its frozen base weights stay as built, its trainable parameters are
    overwritten. With an ``optimizer`` its AdamW state, the global torch RNG and the LoRA
    dropout generators are restored too (the step to continue from is the returned
    ``step``). With a ``share`` the model is one part of the whole (a pipeline stage, or
    a tensor-parallel shard of one: ``plan`` and ``group`` are the stage's); the
    checkpoint may come from any strategy.

    Returns:
        The step the checkpoint was written at and the ``extra`` dict given to
        :func:`~xronos.checkpoint.save_checkpoint`.
    Raises:
        UserError: incomplete/damaged checkpoint, one written for another model shape,
            LoRA configuration or base weights, or one without optimizer state when an
            ``optimizer`` is to be restored.
    """
    ckpt = Path(ckpt_dir)
    reader: Slices
    client = installed()
    if client is not None:  # a device with no files: the coordinator's checkpoint
        reader = RemoteCheckpoint(client, os.fspath(ckpt_dir))
        meta, params = reader.meta, reader.params
        layouts = {k: TensorLayout.from_json(v) for k, v in reader.layouts_json.items()}
    else:
        meta = read_checkpoint_meta(ckpt)
        layouts, params = read_layouts(ckpt)
        reader = SliceReader(ckpt, layouts)
    _check_config(ckpt, meta, cfg)
    _check_lora(ckpt, meta, share.lora if share is not None else describe_lora(model))
    names = frozenset(n for n, _ in trainable(model))
    if share is not None and not names <= share.whole:
        raise ValueError(
            f"a share holds parameters outside the whole: {sorted(names - share.whole)[:3]}"
        )
    _check_names(ckpt, params, share.whole if share is not None else names)
    if optimizer is not None and not meta.get("optimizer", any(params.values())):
        raise UserError(
            f"checkpoint {ckpt} holds the weights but no optimizer state (an older pipeline "
            "run's), so training cannot continue from it; export it with xronos export, or "
            "start a new run"
        )
    saved_print = (meta.get("base") or {}).get("fingerprint")
    if saved_print is not None:
        now = (
            share.fingerprint() if share is not None else base_fingerprint(model, cfg, plan, group)
        )
        if now is None or not same_fingerprint(saved_print, now):
            raise UserError(
                f"checkpoint {ckpt} was written for other base weights than this model's "
                f"({_source(meta)}); resume with the base model it was trained on"
            )
    copies = share.copies if share is not None else frozenset()
    with reader, torch.no_grad():
        for name, p in trainable(model):
            key = f"param/{name}"
            full = layouts[key].shape
            box = _box(full, shard_spec(name, cfg, plan, group.rank))
            value = reader.read(key, box)
            if tuple(value.shape) != tuple(p.shape):
                raise UserError(
                    f"checkpoint {ckpt}: {name} assembles to {list(value.shape)} but this "
                    f"model's shard is {list(p.shape)}; resume with the same model"
                )
            p.copy_(value)
            if optimizer is not None and name not in copies:
                state = _optim_state(reader, layouts, name, params[name], full, box)
                optimizer.state.pop(p, None)
                if state:
                    optimizer.state[p] = state
        if optimizer is not None:
            _restore_rng(reader, layouts, model, share.rank if share is not None else group.rank)
    return Loaded(step=int(meta["step"]), extra=dict(meta.get("extra") or {}))


def _box(full: tuple[int, ...], spec: ShardSpec | None) -> Box:
    box = full_box(full)
    if spec is not None:
        box[spec.dim] = (min(spec.start, full[spec.dim]), min(spec.end, full[spec.dim]))
    return box


def _optim_state(
    reader: Slices,
    layouts: dict[str, TensorLayout],
    name: str,
    kinds: list[str],
    full: tuple[int, ...],
    box: Box,
) -> dict[str, torch.Tensor]:
    """AdamW's state of one parameter; tensors shaped like the parameter are sliced like it.
    Each is made contiguous: a row-parallel shard's moments are a column slice of the
    saved ones, and the fused AdamW kernel walks its tensors as flat memory (measured: a
    strided ``exp_avg`` moved the weights by 3e-2 in one step, silently)."""
    state: dict[str, torch.Tensor] = {}
    for kind in kinds:
        key = f"optim/{kind}/{name}"
        like_param = len(full) > 0 and layouts[key].shape == full
        state[kind] = reader.read(key, box if like_param else None).contiguous()
    return state


def _restore_rng(
    reader: Slices, layouts: dict[str, TensorLayout], model: nn.Module, rank: int
) -> None:
    """The global torch RNG (this rank's, or rank 0's if the saving world was smaller) and
    the LoRA dropout generators (identical on every rank)."""
    key = f"rng/torch/{rank}" if f"rng/torch/{rank}" in layouts else "rng/torch/0"
    torch.set_rng_state(reader.read(key).contiguous())
    for name, m in lora_modules(model):
        m.dropout_gen.set_state(reader.read(f"rng/dropout/{name}").contiguous())


# -- compatibility -------------------------------------------------------------------------
def _fields(d: dict[str, Any], keys: list[str]) -> str:
    return ", ".join(f"{k}={d.get(k)}" for k in keys)


def _check_config(ckpt: Path, meta: dict[str, Any], cfg: ModelConfig) -> None:
    saved = {k: v for k, v in meta["model_config"].items() if k in compared_fields(cfg)}
    now = compared_fields(cfg)
    diff = [k for k in now if saved.get(k) != now[k]]
    if diff:
        raise UserError(
            f"checkpoint {ckpt} was written for a model with {_fields(saved, diff)} but this "
            f"model has {_fields(now, diff)}; resume with the model it was trained on "
            f"({_source(meta)})"
        )


def _lora_text(d: dict[str, Any] | None) -> str:
    if d is None:
        return "full fine-tuning (no LoRA)"
    return f"LoRA r={d['r']}, alpha={d['alpha']}, targets {','.join(d['target_modules'])}"


def _check_lora(ckpt: Path, meta: dict[str, Any], now: dict[str, Any] | None) -> None:
    saved = meta.get("lora")
    same = (saved is None and now is None) or (
        saved is not None
        and now is not None
        and int(saved["r"]) == now["r"]
        and abs(float(saved["alpha"]) - float(now["alpha"])) <= 1e-9 * abs(float(now["alpha"]))
        and sorted(saved["target_modules"]) == now["target_modules"]
    )
    if not same:
        raise UserError(
            f"checkpoint {ckpt} was written for {_lora_text(saved)} but this run uses "
            f"{_lora_text(now)}; resume with the same LoRA settings"
        )


def _check_names(ckpt: Path, params: dict[str, list[str]], names: frozenset[str]) -> None:
    extra, missing = sorted(set(params) - names), sorted(names - set(params))
    if extra or missing:
        raise UserError(
            f"checkpoint {ckpt} was written for other trainable parameters "
            f"(only in the checkpoint: {extra[:3]}, only in this model: {missing[:3]}); "
            "resume with the same model and LoRA settings"
        )


def _source(meta: dict[str, Any]) -> str:
    model = (meta.get("extra") or {}).get("model") or {}
    where = model.get("dir") or model.get("preset") or model.get("source")
    return f"model {where}" if where else "see its meta.json"
