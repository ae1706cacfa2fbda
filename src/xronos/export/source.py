"""Rebuilding the full, single-device model that a checkpoint describes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from xronos.checkpoint import load_checkpoint, read_checkpoint_meta
from xronos.checkpoint.state import config_from_dict, lora_from_dict
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.model.llama import LlamaForCausalLM
from xronos.parallel.shard import build_model
from xronos.planner.plan import Plan


def model_info(meta: dict[str, Any]) -> dict[str, Any]:
    """``extra["model"]`` of a checkpoint (``{}`` if the run did not record it)."""
    info = (meta.get("extra") or {}).get("model") or {}
    return info if isinstance(info, dict) else {}


def source_dir(meta: dict[str, Any], override: str | os.PathLike[str] | None) -> Path | None:
    """The base model (a directory or a GGUF file): ``override`` if given, else the one the
    run recorded."""
    where = override if override is not None else model_info(meta).get("dir")
    return None if where is None else Path(where)


def _is_model(path: Path) -> bool:
    """A Hugging Face directory (with ``config.json``) or a GGUF file."""
    return (path / "config.json").is_file() or (path.is_file() and path.suffix == ".gguf")


def restore_full_model(
    ckpt_dir: Path, base_model_dir: str | os.PathLike[str] | None
) -> tuple[LlamaForCausalLM, ModelConfig, dict[str, Any]]:
    """The unsharded model of ``ckpt_dir`` on this process: frozen base weights rebuilt
    from their source (LoRA runs), trainable ones read from the checkpoint."""
    meta = read_checkpoint_meta(ckpt_dir)
    cfg = config_from_dict(meta["model_config"])
    lora = lora_from_dict(meta.get("lora"))
    model_dir: Path | None = None
    seed = int(model_info(meta).get("seed") or 0)
    if lora is not None:  # the base is not in the checkpoint: rebuild it
        model_dir = source_dir(meta, base_model_dir)
        if model_dir is None and "seed" not in model_info(meta):
            raise UserError(
                f"checkpoint {ckpt_dir} does not record its base model; pass the base "
                "model (--base-model DIR or FILE.gguf)"
            )
        if model_dir is not None and not _is_model(model_dir):
            raise UserError(
                f"base model {model_dir} of checkpoint {ckpt_dir} not found; pass the base "
                "model (--base-model DIR or FILE.gguf)"
            )
    dtype = getattr(torch, (meta.get("base") or {}).get("dtype", "float32"))
    plan, group = Plan.single(cfg), TPGroup()
    model = build_model(cfg, plan, group, model_dir=model_dir, seed=seed, lora=lora, dtype=dtype)
    load_checkpoint(ckpt_dir, model=model, optimizer=None, cfg=cfg, plan=plan, group=group)
    return model.eval(), cfg, meta
