"""A safetensors file written one tensor at a time.

``safetensors.torch.save`` builds the whole file in memory, so a rank saving its shard
holds it twice, and the rank that writes every shard (rank 0) more than that -- on a
device with a memory cap, enough to be killed. Here the header is computed from the
tensors' dtypes and shapes, and each tensor's bytes follow it straight from memory (or
from the network, :func:`~xronos.comm.blobs.recv_tensors`): besides what the rank holds
anyway, writing costs one tensor at most. The file is the format's own (an 8-byte
little-endian header length, the JSON header padded with spaces to a multiple of 8, then
the data in header order), read by any safetensors reader.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from xronos.comm.blobs import byte_view

from .atomic import fsync_file

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""torch dtypes and their names in a safetensors header."""
SYNC_EVERY = 64 * 2**20
"""Bytes written between two flushes to disk: pages not yet written out count against
the writer's memory cap, and the kernel cannot drop them to make room."""


def header(
    entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
) -> bytes:
    """The length prefix and the JSON header of a file holding ``entries`` (name, dtype,
    shape) in this order."""
    table: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in DTYPES:
            raise TypeError(f"{name}: dtype {dtype} has no safetensors name")
        n = torch.Size(shape).numel() * dtype.itemsize
        table[name] = {
            "dtype": DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_streamed(
    path: Path,
    entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    chunks: Iterable[memoryview | bytes],
    metadata: dict[str, str],
) -> None:
    """Write ``path``: the header of ``entries``, then ``chunks`` (each entry's bytes, in
    order) as they come; fsynced."""
    with open(path, "wb") as f:
        f.write(header(entries, metadata))
        unsynced = 0
        for chunk in chunks:
            f.write(chunk)
            unsynced += len(chunk)
            if unsynced >= SYNC_EVERY:  # written-out pages can be dropped under a memory cap
                f.flush()
                os.fsync(f.fileno())
                unsynced = 0
    fsync_file(path)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """``tensors`` as a safetensors file at ``path``, one tensor in memory at a time."""
    entries = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    write_streamed(path, entries, (byte_view(t).numpy().data for t in tensors.values()), metadata)
