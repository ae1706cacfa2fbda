"""What a worker is asked to do: plain picklable data, the same on every rank."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from xronos.config import ModelConfig
from xronos.engine.trainer import Batch, OptimConfig
from xronos.model.lora import LoRAConfig
from xronos.planner.plan import Plan


class BatchSource(Protocol):
    """Yields lists of micro-batches (one list per optimizer step), deterministically."""

    def steps(self, start_step: int) -> Iterator[list[Batch]]: ...


@dataclass(frozen=True)
class RandomBatches:
    """Random token ids (for benchmarks and tests): step ``k`` is a pure function of
    (seed, k), so every strategy and every rank sees the same data."""

    vocab_size: int
    batch_size: int
    seq_len: int
    grad_accum: int = 1
    seed: int = 0
    repeat: bool = False
    """Yield the same step every time (a memorisation task whose loss must fall)."""

    def steps(self, start_step: int) -> Iterator[list[Batch]]:
        step = start_step
        while True:
            key = 0 if self.repeat else step
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
            micro = []
            for _ in range(self.grad_accum):
                ids = torch.randint(
                    0, self.vocab_size, (self.batch_size, self.seq_len), generator=gen
                )
                micro.append((ids, ids.clone()))
            yield micro
            step += 1


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
        from pathlib import Path

        from xronos.config import resolve_model_config

        cfg = resolve_model_config(model)
        model_dir = str(Path(model).resolve()) if Path(model).is_dir() else None
        return cls(cfg=cfg, model_dir=model_dir, seed=seed, lora=lora, name=model)


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """A fine-tuning run as every rank sees it."""

    model: ModelSource
    plan: Plan
    optim: OptimConfig
    data: Any
    """A BatchSource."""
    steps: int
    """Optimizer steps to run."""
    return_state: bool = False
    """Return the gathered final parameters (tests)."""
    record: bool = True
    """Record collective spans for the idle/transfer analysis."""
