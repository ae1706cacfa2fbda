"""The coordinator side: answer the devices' requests for slices, in a thread of its own.

The server runs beside training on its own process group (gloo connections of their own,
so it never takes part in a training collective) and answers until every device has said
``bye``. It serves only the paths the coordinator put in the job — the model and the
checkpoint a run resumes from — and only the slice each request names; requests are JSON,
never pickle.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch.distributed as dist

from xronos.checkpoint import read_checkpoint_meta
from xronos.checkpoint.layout import SliceReader, read_layouts
from xronos.comm.blobs import Blob, recv_blob, send_blob, tensors_blob
from xronos.comm.relay import REQUEST_TAG, RESPONSE_TAG
from xronos.errors import UserError
from xronos.model.readers import open_model_reader


class RelayServer:
    """Serves ``allowed`` paths to the global ranks ``clients`` over ``group``."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        clients: set[int],
        allowed: set[str],
        timeout_s: float,
        prefixes: tuple[str, ...] = (),
    ) -> None:
        """``allowed``: the paths it serves; ``prefixes``: and every path that starts with
        one of them (the checkpoints that move a run to a new plan)."""
        self.group, self.waiting, self.allowed = group, set(clients), allowed
        self.prefixes = prefixes
        self.timeout_s = timeout_s
        self.bytes_sent: dict[int, int] = {r: 0 for r in clients}
        self.error: BaseException | None = None
        self._models: dict[str, Any] = {}
        self._ckpts: dict[str, SliceReader] = {}
        self._thread = threading.Thread(target=self._serve, name="xronos-relay", daemon=True)

    def start(self) -> RelayServer:
        if self.waiting:
            self._thread.start()
        return self

    def close(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every device's ``bye``; True when all came."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive() and not self.waiting

    def _serve(self) -> None:
        try:
            while self.waiting:
                request = recv_blob(None, self.group, REQUEST_TAG, None)
                if request.header.get("op") == "bye":
                    self.waiting.discard(request.sender)
                    continue
                answer = self._answer(request.header)
                send_blob(answer, request.sender, self.group, RESPONSE_TAG, self.timeout_s)
                self.bytes_sent[request.sender] = self.bytes_sent.get(request.sender, 0) + len(
                    answer.payload
                )
        except BaseException as e:  # a lost device: the training loop reports it
            self.error = e
        finally:
            for m in self._models.values():
                m.close()
            for c in self._ckpts.values():
                c.close()

    def _answer(self, req: dict[str, Any]) -> Blob:
        op, path = req.get("op"), str(req.get("path"))
        try:
            if path not in self.allowed and not path.startswith(self.prefixes or ("\0",)):
                raise UserError(f"{path!r} is not a file of this job")
            if op == "model.shape":
                return Blob({"shape": list(self._model(path).shape(str(req["name"])))})
            if op == "model.read":
                reader, name, dim = self._model(path), str(req["name"]), req.get("dim")
                t = (
                    reader.read(name)
                    if dim is None
                    else reader.read(name, int(dim), int(req["start"]), int(req["end"]))
                )
                return tensors_blob({}, {"t": t})
            if op == "ckpt.open":
                layouts, params = read_layouts(Path(path))
                return Blob(
                    {
                        "meta": read_checkpoint_meta(path),
                        "layouts": {k: v.to_json() for k, v in layouts.items()},
                        "params": params,
                    }
                )
            if op == "ckpt.read":
                box = req.get("box")
                t = self._ckpt(path).read(
                    str(req["key"]), None if box is None else [(int(a), int(b)) for a, b in box]
                )
                return tensors_blob({}, {"t": t})
            raise UserError(f"unknown request {op!r}")
        except (UserError, KeyError, ValueError, OSError) as e:
            return Blob({"error": str(e) or type(e).__name__})

    def _model(self, path: str) -> Any:
        if path not in self._models:
            self._models[path] = open_model_reader(path)
        return self._models[path]

    def _ckpt(self, path: str) -> SliceReader:
        if path not in self._ckpts:
            layouts, _ = read_layouts(Path(path))
            self._ckpts[path] = SliceReader(Path(path), layouts)
        return self._ckpts[path]
