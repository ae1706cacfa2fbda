"""Reading Hugging Face safetensors checkpoints slice by slice.

``safe_open(...).get_slice(name)[a:b]`` reads only the requested rows (the file is
memory-mapped), so a rank that holds 1/4 of a layer reads 1/4 of its bytes. Both a single
``model.safetensors`` and a sharded ``model.safetensors.index.json`` are supported.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from xronos.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsReader:
    """Name -> tensor (or slice of it) over one or many safetensors files."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self.bytes_read = 0
        self._handles: dict[str, Any] = {}
        index = self.dir / INDEX
        if index.is_file():
            try:
                self.where: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise UserError(f"{index}: malformed index ({e}); re-save the model") from e
        elif (self.dir / SINGLE).is_file():
            with safe_open(self.dir / SINGLE, framework="pt") as f:
                self.where = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise UserError(
                f"{self.dir}: no {SINGLE} or {INDEX}; Xronos loads safetensors checkpoints "
                "(convert .bin files with transformers' save_pretrained(safe_serialization=True))"
            )

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _file(self, name: str) -> Any:
        fname = self.where[name]
        if fname not in self._handles:
            path = self.dir / fname
            if not path.is_file():
                raise UserError(f"{path}: listed in {INDEX} but missing; re-download the model")
            self._handles[fname] = safe_open(path, framework="pt")
        return self._handles[fname]

    def shape(self, name: str) -> list[int]:
        return list(self._file(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int = 0) -> torch.Tensor:
        """The whole tensor, or elements ``[start, end)`` along ``dim``."""
        if name not in self.where:
            raise UserError(f"{self.dir}: tensor {name!r} missing from the checkpoint")
        sl = self._file(name).get_slice(name)
        if dim is None:
            t = sl[:]
        elif dim == 0:
            t = sl[start:end]
        else:
            t = sl[:, start:end]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
