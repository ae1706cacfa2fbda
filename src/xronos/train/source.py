"""Where a model's weights come from, and building this rank's part of it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig, resolve_model_config
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
    """Hugging Face directory, or None for seeded preset weights."""
    seed: int = 0
    """Preset master-weight seed and LoRA init seed."""
    lora: LoRAConfig | None = None
    """Adapters, or None for full fine-tuning."""
    name: str = ""
    """What the user called the model (a preset name or a path)."""

    @classmethod
    def from_name(cls, model: str, seed: int = 0, lora: LoRAConfig | None = None) -> ModelSource:
        """A preset name or a Hugging Face directory -> where the weights come from."""
        cfg = resolve_model_config(model)
        model_dir = str(Path(model).resolve()) if Path(model).is_dir() else None
        return cls(cfg=cfg, model_dir=model_dir, seed=seed, lora=lora, name=model)

    def build(self, plan: Plan, group: TPGroup) -> LlamaForCausalLM:
        """This rank's tensor-parallel shard under ``plan`` (the whole model on one rank)."""
        return build_model(
            self.cfg, plan, group, model_dir=self.model_dir, seed=self.seed, lora=self.lora
        )
