"""Safetensors files written one tensor at a time read back, with their metadata, in any
safetensors reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from xronos.checkpoint.stream import header, write_tensors


def test_streamed_file_reads_back_every_dtype_and_shape(tmp_path: Path) -> None:
    tensors = {
        "param/w": torch.randn(3, 5),
        "optim/exp_avg/w": torch.randn(7).to(torch.bfloat16),
        "optim/step/w": torch.tensor(3.0),  # a 0-dim tensor
        "rng/torch/0": torch.get_rng_state(),  # uint8
        "param/empty": torch.empty(0, 4),  # a device with no units of a segment
        "param/half": torch.randn(2, 3).half(),
        "ids": torch.arange(5),
        "mask": torch.tensor([True, False]),
        "sliced": torch.randn(6, 4)[:, 1:3],  # not contiguous
    }
    path = tmp_path / "rank0.safetensors"
    write_tensors(path, tensors, {"format": "pt", "xronos": "test"})
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt", "xronos": "test"}


def test_the_header_is_padded_to_eight_bytes_and_an_unknown_dtype_is_refused() -> None:
    raw = header([("a", torch.float32, (3,))], {"k": "v"})
    assert (len(raw) - 8) % 8 == 0 and int.from_bytes(raw[:8], "little") == len(raw) - 8
    with pytest.raises(TypeError, match="complex64"):
        header([("z", torch.complex64, (2,))], {})
