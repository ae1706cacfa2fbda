"""Where a model's weights come from, and building this rank's part of it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.model.gguf_resolve import resolve_model_config
from xronos.model.llama import LlamaForCausalLM
from xronos.model.lora import LoRAConfig
from xronos.parallel.shard import build_model
from xronos.planner.plan import Plan


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Where the weights come from."""

    cfg: ModelConfig
    """Resolved model shape."""
    model_dir: str | None = None
    """Hugging Face directory or GGUF file, or None for seeded preset weights."""
    seed: int = 0
    """Preset master-weight seed and LoRA init seed."""
    lora: LoRAConfig | None = None
    """Adapters, or None for full fine-tuning."""
    name: str = ""
    """What the user called the model (a preset name or a path)."""
    base_dtype: torch.dtype = torch.float32
    """dtype the base weights are held in (LoRA adapters stay fp32)."""
    recompute: bool = False
    """Activation checkpointing in every block (:mod:`xronos.model.recompute`)."""

    @classmethod
    def from_name(cls, model: str, seed: int = 0, lora: LoRAConfig | None = None) -> ModelSource:
        """A preset name, a Hugging Face directory or a GGUF file -> where the weights come
        from."""
        cfg = resolve_model_config(model)
        path = Path(model)
        model_dir = str(path.resolve()) if path.is_dir() or path.is_file() else None
        return cls(cfg=cfg, model_dir=model_dir, seed=seed, lora=lora, name=model)

    def build(self, plan: Plan, group: TPGroup) -> LlamaForCausalLM:
        """This rank's tensor-parallel shard under ``plan`` (the whole model on one rank)."""
        return build_model(
            self.cfg,
            plan,
            group,
            model_dir=self.model_dir,
            seed=self.seed,
            lora=self.lora,
            dtype=self.base_dtype,
            recompute=self.recompute,
        )
