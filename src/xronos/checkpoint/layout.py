"""On-disk layout of a reshardable checkpoint, and reading any slice of it back.

::

    checkpoints/step-00000120/
      rank0.safetensors   rank 0's slice of every split tensor + the whole tensors it owns
      rank1.safetensors   rank 1's slice of every split tensor (+ its own RNG state)
      ...
      index.json          per tensor key: full shape, dtype, split dim, each rank's [start, end)
      meta.json           step, plan, model config, LoRA, base fingerprint, caller's ``extra``
      COMPLETE            written last; a directory without it is not a checkpoint

Under tensor parallelism rank 0 owns every whole (replicated) tensor; in a pipeline each
stage's leader owns its stage's (:mod:`xronos.pipeline.checkpoint`).

Tensor keys: ``param/<name>`` (Hugging Face parameter name), ``optim/<state>/<name>``
(AdamW ``exp_avg``/``exp_avg_sq`` split like the parameter, ``step`` whole),
``rng/torch/<rank>`` and ``rng/dropout/<module>`` (generator states as uint8).

A split tensor of full length ``L`` along ``dim`` is stored as one part per saving rank;
the parts are contiguous and cover ``[0, L)``. Reading a box (a ``[start, end)`` per dim)
touches only the parts that overlap it, and of each only the overlap
(``safe_open(...).get_slice``)::

    saved (3 ranks)   |---- r0 ----|-- r1 --|--- r2 ---|
    wanted (rank 1/2)          |=========|
    read                       |r0| r1  |
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from xronos.errors import UserError

FORMAT = "xronos-checkpoint"
VERSION = 1
INDEX = "index.json"
META = "meta.json"
COMPLETE = "COMPLETE"

Box = list[tuple[int, int]]
"""One ``[start, end)`` per dim of a tensor."""


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def full_box(shape: Sequence[int]) -> Box:
    return [(0, int(n)) for n in shape]


@dataclass(frozen=True)
class TensorLayout:
    """Where the pieces of one logical (full) tensor live."""

    shape: tuple[int, ...]
    """Full shape."""
    dtype: str
    """torch dtype name, e.g. ``float32``."""
    dim: int | None = None
    """Split dim; None = the whole tensor lies in ``rank``'s file."""
    ranges: tuple[tuple[int, int], ...] = ()
    """Every saving rank's ``[start, end)`` along ``dim`` (split tensors only)."""
    rank: int = 0
    """File holding a whole tensor."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype}
        if self.dim is None:
            out["rank"] = self.rank
        else:
            out["dim"], out["ranges"] = self.dim, [list(r) for r in self.ranges]
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorLayout:
        dim = d.get("dim")
        layout = cls(
            shape=tuple(int(n) for n in d["shape"]),
            dtype=str(d["dtype"]),
            dim=None if dim is None else int(dim),
            ranges=tuple((int(a), int(b)) for a, b in d.get("ranges", ())),
            rank=int(d.get("rank", 0)),
        )
        if layout.dim is not None:
            ends = [0] + [b for _, b in layout.ranges]
            starts = [a for a, _ in layout.ranges] + [layout.shape[layout.dim]]
            if ends != starts or any(a > b for a, b in layout.ranges):
                raise ValueError(f"ranges {layout.ranges} do not tile {layout.shape[layout.dim]}")
        return layout


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path.parent}: {what} {path.name} is missing; not a checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: damaged {what} ({e}); resume from another checkpoint") from e
    if not isinstance(data, dict):
        raise UserError(f"{path}: damaged {what}; resume from another checkpoint")
    return data


def read_layouts(ckpt_dir: Path) -> tuple[dict[str, TensorLayout], dict[str, list[str]]]:
    """``index.json`` -> (tensor key -> layout, parameter name -> its optimizer states)."""
    index = read_json(ckpt_dir / INDEX, "index")
    try:
        layouts = {k: TensorLayout.from_json(v) for k, v in index["tensors"].items()}
        params = {str(k): [str(s) for s in v] for k, v in index["params"].items()}
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(
            f"{ckpt_dir / INDEX}: damaged index ({e}); resume from another checkpoint"
        ) from e
    return layouts, params


class SliceReader:
    """Reads boxes of the logical tensors of a checkpoint from its rank files."""

    def __init__(self, ckpt_dir: Path, layouts: dict[str, TensorLayout]) -> None:
        self.dir, self.layouts = ckpt_dir, layouts
        self.bytes_read = 0
        self._files: dict[int, tuple[Any, set[str]]] = {}

    def _file(self, rank: int) -> tuple[Any, set[str]]:
        if rank not in self._files:
            path = self.dir / rank_file(rank)
            try:
                handle = safe_open(str(path), framework="pt")
                self._files[rank] = (handle, set(handle.keys()))
            except Exception as e:  # safetensors raises its own error types
                raise UserError(f"{path}: unreadable ({e}); resume from another checkpoint") from e
        return self._files[rank]

    def _piece(self, rank: int, key: str, box: Box) -> torch.Tensor:
        f, keys = self._file(rank)
        if key not in keys:
            raise UserError(
                f"{self.dir / rank_file(rank)}: tensor {key!r} is missing; "
                "resume from another checkpoint"
            )
        # a 0-dim tensor has an empty box; anything else is read slice by slice
        t = f.get_slice(key)[tuple(slice(a, b) for a, b in box)] if box else f.get_tensor(key)
        self.bytes_read += t.numel() * t.element_size()
        return t  # type: ignore[no-any-return]

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        """Elements ``box`` (default: all) of the full tensor ``key``, in its saved dtype."""
        layout = self.layouts[key]
        box = full_box(layout.shape) if box is None else box
        if len(box) != len(layout.shape) or any(
            not 0 <= a <= b <= n for (a, b), n in zip(box, layout.shape, strict=True)
        ):
            raise ValueError(f"{key}: box {box} outside shape {list(layout.shape)}")
        if layout.dim is None:
            return self._piece(layout.rank, key, box)
        d = layout.dim
        out = torch.empty([b - a for a, b in box], dtype=getattr(torch, layout.dtype))
        lo_want, hi_want = box[d]
        for rank, (start, end) in enumerate(layout.ranges):
            lo, hi = max(start, lo_want), min(end, hi_want)
            if lo >= hi:
                continue
            part = list(box)
            part[d] = (lo - start, hi - start)
            out.narrow(d, lo - lo_want, hi - lo).copy_(self._piece(rank, key, part))
        return out

    def close(self) -> None:
        self._files.clear()

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
