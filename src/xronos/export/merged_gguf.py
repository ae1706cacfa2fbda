"""Export a run as one GGUF file for llama.cpp and ollama: the merged fine-tuned model
(:func:`~xronos.export.merged.merged_state_dict`), its configuration and the run's own
tokenizer (vocabulary, merges, special ids, whether BOS is added, pre-tokenizer, chat
template), written by :func:`~xronos.export.gguf.write_gguf`."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from xronos.data.tokenizer import Tokenizer
from xronos.export.gguf import GGUFDtype, write_gguf
from xronos.export.merged import hf_config, merged_state_dict
from xronos.export.source import restore_full_model

GGUF_FILE = "model.gguf"


def gguf_path(out: str | os.PathLike[str]) -> Path:
    """``out`` itself if it names a ``.gguf`` file, else ``out/model.gguf``."""
    path = Path(out)
    return path if path.suffix.lower() == ".gguf" else path / GGUF_FILE


def export_gguf(
    ckpt_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer,
    base_model: str | os.PathLike[str] | None = None,
    dtype: GGUFDtype = "f16",
) -> Path:
    """Write the fine-tuned model of ``ckpt_dir`` as a GGUF file (atomically).

    Args:
        ckpt_dir: a complete checkpoint (LoRA or full fine-tuning).
        out: a ``.gguf`` file, or a directory to hold ``model.gguf``.
        tokenizer: the model's tokenizer (byte-level BPE), stored in the file's metadata.
        base_model: the base model (directory or GGUF file); default: the one the run
            recorded. Only a LoRA run needs it.
        dtype: storage of the matrices: ``"f16"`` (default), ``"q8_0"`` or ``"f32"``.
    Raises:
        UserError: unusable checkpoint, missing base model, unsupported tokenizer or dtype.
    """
    model, cfg, _ = restore_full_model(Path(ckpt_dir), base_model)
    with torch.no_grad():
        state = {k: v.float() for k, v in merged_state_dict(model).items()}
    path = gguf_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = {"bos": tokenizer.bos_id, "eos": tokenizer.eos_id, "pad": tokenizer.pad_id}
    return write_gguf(
        path,
        state,
        hf_config(cfg, torch.float32),
        tokenizer.backend,
        tokenizer.chat_template,
        dtype,
        special_ids={k: v for k, v in ids.items() if v is not None},
    )
