"""Byte blobs between two ranks over a gloo process group, checked by a hash.

One blob is two point-to-point messages with the same tag: the sizes (JSON header bytes,
payload bytes) and then the header and the payload in one buffer. The header carries the
payload's SHA-256, checked on arrival; tensors travel in the payload as safetensors bytes
(never pickle). Every wait is bounded, except a server's wait for the next request.

A shard of a checkpoint travels tensor by tensor instead (:func:`send_tensors`,
:func:`recv_tensors`): a JSON header names each tensor's dtype, shape and SHA-256, and each
tensor's bytes follow in a message of their own, so neither side holds more than one
tensor beyond what it has anyway.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from dataclasses import dataclass
from hashlib import sha256
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from xronos.errors import UserError


@dataclass(frozen=True)
class Blob:
    """One message: a JSON header and the bytes it describes."""

    header: dict[str, Any]
    payload: bytes = b""
    sender: int = -1
    """The global rank it came from (on receipt)."""


def tensors_blob(
    header: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> Blob:
    """``tensors`` as safetensors bytes (with ``metadata``) under ``header``."""
    payload = save_tensors({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    return Blob(header, payload)


def blob_tensors(blob: Blob) -> dict[str, torch.Tensor]:
    """The tensors of a blob made by :func:`tensors_blob`."""
    return load_tensors(blob.payload)


def _wait(work: Any, timeout_s: float | None) -> None:
    if timeout_s is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout_s))


def send_blob(
    blob: Blob, dst: int, group: dist.ProcessGroup, tag: int, timeout_s: float | None
) -> None:
    """Send ``blob`` to global rank ``dst``."""
    head = json.dumps(blob.header | {"sha256": sha256(blob.payload).hexdigest()}).encode()
    sizes = torch.tensor([len(head), len(blob.payload)], dtype=torch.int64)
    body = torch.frombuffer(bytearray(head + blob.payload), dtype=torch.uint8)
    _wait(dist.isend(sizes, dst, group=group, tag=tag), timeout_s)
    _wait(dist.isend(body, dst, group=group, tag=tag), timeout_s)


def recv_blob(src: int | None, group: dist.ProcessGroup, tag: int, timeout_s: float | None) -> Blob:
    """The next blob from global rank ``src`` (None: from any rank, waiting as long as
    the group's timeout allows). Raises ``UserError`` when its hash does not match."""
    sizes = torch.empty(2, dtype=torch.int64)
    if src is None:
        sender = dist.recv(sizes, None, group=group, tag=tag)
    else:
        _wait(dist.irecv(sizes, src, group=group, tag=tag), timeout_s)
        sender = src
    n_head, n_payload = (int(x) for x in sizes.tolist())
    body = torch.empty(n_head + n_payload, dtype=torch.uint8)
    _wait(dist.irecv(body, sender, group=group, tag=tag), timeout_s)
    raw = body.numpy().tobytes()
    header = json.loads(raw[:n_head])
    payload = raw[n_head:]
    if header.pop("sha256", None) != sha256(payload).hexdigest():
        raise UserError(
            f"a message from rank {sender} failed its SHA-256 check ({n_payload} bytes): "
            "the network altered it; check the link between the devices"
        )
    return Blob(header, payload, sender)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in row-major order as a flat uint8 tensor (no copy where ``t`` is
    contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def send_tensors(
    tensors: dict[str, torch.Tensor],
    dst: int,
    group: dist.ProcessGroup,
    tag: int,
    timeout_s: float | None,
) -> None:
    """Send ``tensors`` to global rank ``dst`` one at a time (:func:`recv_tensors`)."""
    entries = [
        [
            k,
            str(t.dtype).removeprefix("torch."),
            list(t.shape),
            sha256(byte_view(t).numpy().data).hexdigest(),
        ]
        for k, t in tensors.items()
    ]
    head = json.dumps(entries).encode()
    _wait(
        dist.isend(torch.tensor([len(head)], dtype=torch.int64), dst, group=group, tag=tag),
        timeout_s,
    )
    _wait(
        dist.isend(torch.frombuffer(bytearray(head), dtype=torch.uint8), dst, group=group, tag=tag),
        timeout_s,
    )
    for t in tensors.values():
        if t.numel():
            _wait(dist.isend(byte_view(t), dst, group=group, tag=tag), timeout_s)


def recv_tensors(
    src: int, group: dist.ProcessGroup, tag: int, timeout_s: float | None
) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], Iterator[memoryview]]:
    """The tensors :func:`send_tensors` sends from global rank ``src``: their names, dtypes
    and shapes, and an iterator over their bytes, each received as it is asked for. Run it
    to the end: it receives every tensor even after a failed SHA-256 check, and then raises
    ``UserError``."""
    size = torch.empty(1, dtype=torch.int64)
    _wait(dist.irecv(size, src, group=group, tag=tag), timeout_s)
    head = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(dist.irecv(head, src, group=group, tag=tag), timeout_s)
    listed = json.loads(head.numpy().tobytes())
    entries = [(k, getattr(torch, dtype), tuple(shape)) for k, dtype, shape, _ in listed]

    def chunks() -> Iterator[memoryview]:
        bad = []
        for (name, dtype, shape), (_, _, _, digest) in zip(entries, listed, strict=True):
            n = torch.Size(shape).numel() * dtype.itemsize
            buf = torch.empty(n, dtype=torch.uint8)
            if n:
                _wait(dist.irecv(buf, src, group=group, tag=tag), timeout_s)
            data = buf.numpy().data
            if sha256(data).hexdigest() != digest:
                bad.append(name)
            yield data
        if bad:
            raise UserError(
                f"tensors from rank {src} failed their SHA-256 check ({', '.join(bad[:3])}): "
                "the network altered them; check the link between the devices"
            )

    return entries, chunks()
