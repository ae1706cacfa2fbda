"""Export a LoRA run as a PEFT adapter directory.

``adapter_config.json`` + ``adapter_model.safetensors`` with peft's key names
(``base_model.model.<HF parameter name>``, e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), holding the full
(unsharded) adapters assembled from the rank files. ``peft.PeftModel.from_pretrained``
loads it onto the base model; no base weights are read to produce it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from xronos.checkpoint import read_checkpoint_meta
from xronos.checkpoint.atomic import staged_dir
from xronos.checkpoint.layout import SliceReader, read_layouts
from xronos.errors import UserError
from xronos.export.source import model_info

PEFT_PREFIX = "base_model.model."
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def adapter_config(lora: dict[str, Any], base_model: str | None) -> dict[str, Any]:
    """peft's ``LoraConfig`` fields for a plain LoRA adapter (no DoRA, no rsLoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora["r"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": sorted(lora["target_modules"]),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": False,
        "revision": None,
    }


def export_peft(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    base_model: str | None = None,
) -> Path:
    """Write the adapters of ``ckpt_dir`` to ``out_dir`` (atomically) as a PEFT adapter.

    Args:
        ckpt_dir: a complete checkpoint of a LoRA run.
        out_dir: the adapter directory to create (an earlier adapter export is replaced).
        base_model: ``base_model_name_or_path`` to record; default: the run's model
            directory or preset name from the checkpoint's ``extra["model"]``.
    Raises:
        UserError: the run fine-tuned all weights, or the checkpoint is unusable.
    """
    ckpt = Path(ckpt_dir)
    meta = read_checkpoint_meta(ckpt)
    lora = meta.get("lora")
    if lora is None:
        raise UserError(
            f"checkpoint {ckpt}: this run fine-tuned all weights, so there is no adapter; "
            "export --format hf"
        )
    layouts, params = read_layouts(ckpt)
    with SliceReader(ckpt, layouts) as reader:
        tensors = {
            PEFT_PREFIX + name: reader.read(f"param/{name}").float().contiguous()
            for name in params
            if ".lora_A." in name or ".lora_B." in name
        }
    info = model_info(meta)
    base = base_model or info.get("dir") or info.get("preset") or info.get("source")
    with staged_dir(out_dir, {CONFIG, WEIGHTS, "README.md"}) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(adapter_config(lora, base), indent=2) + "\n")
    return Path(out_dir)
