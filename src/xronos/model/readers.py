"""Opening a model's weights on this machine: a GGUF file or a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from xronos.model.gguf_io import GGUFReader
from xronos.model.safetensors_io import SafetensorsReader


class ModelReader(Protocol):
    """What building a shard reads: tensor shapes and slices by Hugging Face name."""

    def shape(self, name: str) -> list[int]: ...

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int = 0) -> torch.Tensor:
        """The whole tensor (``dim`` None), or elements ``[start, end)`` along ``dim``."""
        ...

    def close(self) -> None: ...


def open_model_reader(path: str | Path) -> SafetensorsReader | GGUFReader:
    """The reader of a checkpoint: a ``.gguf`` file, else a Hugging Face directory."""
    return GGUFReader(path) if Path(path).is_file() else SafetensorsReader(path)
