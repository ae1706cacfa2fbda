"""A checkpoint shard sent tensor by tensor between two real gloo processes: rank 0 writes
it as it arrives and the file reads back equal; a shard that fails its SHA-256 check is
still received to the end (no sender left waiting) and then refused."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.unit.test_metrics_clock import _run_world
from xronos.checkpoint.stream import write_streamed
from xronos.comm import blobs
from xronos.errors import UserError

TAG = 7


def _shard() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "param/w": torch.randn(64, 32, generator=g),
        "optim/exp_avg/w": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "optim/step/w": torch.tensor(5.0),
        "param/none": torch.empty(0, 32),
    }


def _exchange(rank: int, world: int) -> dict[str, Any]:
    pg = dist.group.WORLD
    assert pg is not None
    results: dict[str, Any] = {}
    for corrupt in (False, True):
        if rank == 1:
            if corrupt:  # every digest the sender lists is wrong
                blobs.sha256 = lambda data=b"": hashlib.sha256(b"not the data")  # type: ignore[assignment,misc]
            blobs.send_tensors(_shard(), 0, pg, TAG, 30.0)
            blobs.sha256 = hashlib.sha256
        else:
            path = Path(tempfile.mkdtemp()) / "rank1.safetensors"
            entries, chunks = blobs.recv_tensors(1, pg, TAG, 30.0)
            try:
                write_streamed(path, entries, chunks, {"format": "pt"})
                back = load_file(path)
                results[str(corrupt)] = all(torch.equal(back[k], t) for k, t in _shard().items())
            except UserError as e:
                results[str(corrupt)] = str(e)
            finally:
                shutil.rmtree(path.parent)
        dist.barrier()  # both ranks get here only if every message was received
    return results


@pytest.mark.slow
def test_a_shard_arrives_tensor_by_tensor_and_a_corrupt_one_is_refused(tmp_path: Path) -> None:
    got = _run_world(_exchange, 2, tmp_path)[0]
    assert got["False"] is True
    assert "SHA-256" in got["True"] and "rank 1" in got["True"]
