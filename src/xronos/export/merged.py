"""Export a run as a merged Hugging Face model directory.

``config.json`` (``ModelConfig.to_hf_dict``), ``model.safetensors`` with every LoRA update
merged into its base weight (``W + (α/r)·B·A``; the tied LM head is not duplicated, as
transformers expects), the tokenizer and ``generation_config.json``.
``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from xronos.checkpoint.atomic import staged_dir
from xronos.checkpoint.layout import dtype_name
from xronos.config import ModelConfig
from xronos.data.tokenizer import Tokenizer
from xronos.export.source import restore_full_model, source_dir
from xronos.model.lora import LoRALinear

WEIGHTS = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
)
OUTPUT_FILES = {"config.json", WEIGHTS, "generation_config.json", *TOKENIZER_FILES}


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Hugging Face state dict of ``model`` with LoRA merged and the adapters dropped.
    ``named_parameters`` lists a tied LM head once (as the embedding)."""
    lora = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        owner, _, attr = name.rpartition(".")
        t = lora[owner].merged_weight() if attr == "weight" and owner in lora else p.detach()
        out[name] = t.contiguous()
    return out


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, object]:
    out = cfg.to_hf_dict()
    out["torch_dtype"] = out["dtype"] = dtype_name(dtype)  # v4 and v5 spellings agree
    return out


def export_hf(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    base_model_dir: str | os.PathLike[str] | None = None,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write the fine-tuned model of ``ckpt_dir`` to ``out_dir`` (atomically).

    Args:
        ckpt_dir: a complete checkpoint (LoRA or full fine-tuning).
        out_dir: the model directory to create (an earlier model export is replaced).
        base_model_dir: the base model directory; default: the one the run recorded in
            ``extra["model"]["dir"]``. A preset run (no directory) rebuilds its base from
            the recorded seed. Only a LoRA run needs the base weights.
        tokenizer: saved as ``tokenizer.json``; default: the base directory's tokenizer
            files are copied (none for a preset unless given here).
    Raises:
        UserError: the checkpoint is unusable or its base model cannot be found.
    """
    ckpt = Path(ckpt_dir)
    model, cfg, meta = restore_full_model(ckpt, base_model_dir)
    with torch.no_grad():
        state = merged_state_dict(model)
    dtype = next(iter(state.values())).dtype
    base = source_dir(meta, base_model_dir)
    with staged_dir(out_dir, OUTPUT_FILES) as tmp:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
        _generation_config(tmp, cfg, base)
        if tokenizer is not None:
            tokenizer.save(tmp)
        elif base is not None:
            for name in TOKENIZER_FILES:
                if (base / name).is_file():
                    shutil.copyfile(base / name, tmp / name)
    return Path(out_dir)


def _generation_config(out: Path, cfg: ModelConfig, base: Path | None) -> None:
    """The base model's ``generation_config.json``, else one with its special ids."""
    if base is not None and (base / "generation_config.json").is_file():
        shutil.copyfile(base / "generation_config.json", out / "generation_config.json")
        return
    gen = {
        k: v
        for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id))
        if v is not None
    }
    if gen:
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
