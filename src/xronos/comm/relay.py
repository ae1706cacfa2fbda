"""The device side: ask the coordinator for the slices this rank needs.

A device with no files installs a :class:`RelayClient` (``xronos worker`` does, on every
rank but the coordinator); :func:`installed` tells the readers whether to read a path
locally or ask the coordinator for it::

    model weights   open_reader(path) ─► RemoteModelReader  ─► "model.shape" / "model.read"
    a checkpoint    load_checkpoint   ─► RemoteCheckpoint   ─► "ckpt.open"   / "ckpt.read"

Each request names a path the coordinator itself put in the job, and one tensor slice
(:mod:`xronos.run.relay_server` answers it);
each answer holds only that slice (safetensors bytes, SHA-256 checked).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from xronos.comm.blobs import Blob, blob_tensors, recv_blob, send_blob
from xronos.errors import UserError

REQUEST_TAG = 7101
RESPONSE_TAG = 7102
COORDINATOR = 0
"""The coordinator's global rank (``xronos worker`` makes it rank 0)."""


class RelayClient:
    """This device's line to the coordinator (one request at a time)."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.group, self.timeout_s = group, timeout_s
        self.bytes_received = 0
        self._lock = threading.Lock()

    def ask(self, op: str, **fields: Any) -> Blob:
        """Send one request and wait (bounded) for its answer."""
        with self._lock:
            request = Blob({"op": op, **fields})
            send_blob(request, COORDINATOR, self.group, REQUEST_TAG, self.timeout_s)
            if op == "bye":
                return Blob({})
            answer = recv_blob(COORDINATOR, self.group, RESPONSE_TAG, self.timeout_s)
        self.bytes_received += len(answer.payload)
        if "error" in answer.header:
            raise UserError(f"the coordinator could not serve {op}: {answer.header['error']}")
        return answer

    def tensor(self, op: str, **fields: Any) -> torch.Tensor:
        return blob_tensors(self.ask(op, **fields))["t"]

    def bye(self) -> None:
        """Tell the coordinator that this device needs nothing more."""
        self.ask("bye")


class RemoteModelReader:
    """The coordinator's model file or directory, read slice by slice (the interface of
    :class:`~xronos.model.safetensors_io.SafetensorsReader`)."""

    def __init__(self, client: RelayClient, path: str) -> None:
        self.client, self.path = client, path
        self._shapes: dict[str, list[int]] = {}

    def shape(self, name: str) -> list[int]:
        if name not in self._shapes:
            self._shapes[name] = self.client.ask("model.shape", path=self.path, name=name).header[
                "shape"
            ]
        return self._shapes[name]

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int = 0) -> torch.Tensor:
        return self.client.tensor(
            "model.read", path=self.path, name=name, dim=dim, start=start, end=end
        )

    def close(self) -> None:
        pass


class RemoteCheckpoint:
    """One of the coordinator's checkpoints: its metadata, layouts and slices (the
    interface of :class:`~xronos.checkpoint.layout.SliceReader` for reading)."""

    def __init__(self, client: RelayClient, path: str) -> None:
        self.client, self.path = client, path
        opened = client.ask("ckpt.open", path=path).header
        self.meta: dict[str, Any] = opened["meta"]
        self.layouts_json: dict[str, Any] = opened["layouts"]
        self.params: dict[str, list[str]] = opened["params"]

    def read(self, key: str, box: list[tuple[int, int]] | None = None) -> torch.Tensor:
        wanted = None if box is None else [list(b) for b in box]
        return self.client.tensor("ckpt.read", path=self.path, key=key, box=wanted)

    def close(self) -> None:
        pass

    def __enter__(self) -> RemoteCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_INSTALLED: list[RelayClient] = []


def install(client: RelayClient | None) -> None:
    """Make ``client`` this process's source of the coordinator's files (None: read
    locally again)."""
    _INSTALLED.clear()
    if client is not None:
        _INSTALLED.append(client)


def installed() -> RelayClient | None:
    """The relay this process reads through, or None (its files are local)."""
    return _INSTALLED[0] if _INSTALLED else None
