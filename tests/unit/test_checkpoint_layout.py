"""Reassembling any slice of a tensor from parts split another way, reading only overlaps."""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from xronos.checkpoint.layout import SliceReader, TensorLayout, rank_file


def _cuts(draw: st.DrawFn, length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges tiling [0, length), empty ones allowed."""
    points = sorted(draw(st.lists(st.integers(0, length), min_size=parts - 1, max_size=parts - 1)))
    edges = [0, *points, length]
    return list(itertools.pairwise(edges))


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    shape = draw(st.lists(st.integers(0, 7), min_size=1, max_size=3))
    dim = draw(st.integers(0, len(shape) - 1))
    saved = _cuts(draw, shape[dim], draw(st.integers(1, 4)))
    box = [(a, a + draw(st.integers(0, n - a))) for n in shape for a in [draw(st.integers(0, n))]]
    return shape, dim, saved, box


@settings(max_examples=60, deadline=None)
@given(cases())
def test_any_box_reassembles_from_any_split(case: tuple) -> None:
    shape, dim, saved, box = case
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    with tempfile.TemporaryDirectory() as d:
        for rank, (a, b) in enumerate(saved):
            tensors = {"t": full.narrow(dim, a, b - a).contiguous()} if b > a else {}
            save_file(tensors, str(Path(d) / rank_file(rank)))
        layout = TensorLayout(tuple(shape), "float32", dim, tuple(saved))
        with SliceReader(Path(d), {"t": layout}) as reader:
            got = reader.read("t", box)
            want = full[tuple(slice(a, b) for a, b in box)]
            assert torch.equal(got, want)
            # only the wanted elements were read, however the box straddles the parts
            assert reader.bytes_read == want.numel() * 4


def test_layout_rejects_ranges_that_do_not_tile() -> None:
    with pytest.raises(ValueError, match="do not tile"):
        TensorLayout.from_json(
            {"shape": [6, 2], "dtype": "float32", "dim": 0, "ranges": [[0, 2], [3, 6]]}
        )
    layout = {"shape": [6, 2], "dtype": "float32", "dim": 0, "ranges": [[0, 2], [2, 2], [2, 6]]}
    assert TensorLayout.from_json(layout).ranges == ((0, 2), (2, 2), (2, 6))  # empty part ok
