"""The coordinator serves the other ranks the slices of its files over the process group
(:mod:`xronos.comm.relay`, :mod:`xronos.run.relay_server`), each answer hash-checked."""

from __future__ import annotations

import datetime
import json
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist.world import WorkerContext, run_world
from tests.hf_models import make_checkpoint
from xronos.comm.blobs import Blob, recv_blob, send_blob
from xronos.comm.relay import RelayClient, RemoteModelReader, install
from xronos.errors import UserError
from xronos.model.readers import open_model_reader
from xronos.run.relay_server import RelayServer

NAME = "model.layers.0.mlp.down_proj.weight"


def _serve(ctx: WorkerContext, model: str) -> dict[str, Any]:
    relay = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    if ctx.rank == 0:
        server = RelayServer(relay, {1, 2}, {model}, timeout_s=30).start()
        done = server.close(60)
        return {"done": done, "sent": server.bytes_sent, "error": repr(server.error)}
    client = RelayClient(relay, timeout_s=30)
    install(client)
    try:
        remote = RemoteModelReader(client, model)
        full = remote.shape(NAME)
        width = full[1] // 2  # each rank asks for its half of the columns
        start = (ctx.rank - 1) * width
        got = remote.read(NAME, 1, start, start + width)
        with open_model_reader(model) as local:  # the same slice read here, for the check
            want = local.read(NAME, 1, start, start + width)
        try:
            remote.read(NAME.replace("down", "nowhere"))
            missing = ""
        except UserError as e:
            missing = str(e)
        try:
            RemoteModelReader(client, "/etc").shape(NAME)
            outside = ""
        except UserError as e:
            outside = str(e)
        return {
            "equal": torch.equal(got, want),
            "shape": list(got.shape),
            "full": full,
            "received": client.bytes_received,
            "missing": missing,
            "outside": outside,
        }
    finally:
        client.bye()
        install(None)


@pytest.mark.slow
def test_each_rank_receives_only_the_slice_it_asks_for(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, vocab=96, hidden=64, intermediate=96, layers=1)
    server, *clients = run_world(_serve, 3, str(tmp_path))
    assert server["done"], server
    for r, c in enumerate(clients, start=1):
        assert c["equal"], f"rank {r}: the relayed slice differs from the file's"
        assert c["shape"] == [64, 48] and c["full"] == [64, 96]
        # one fp32 half of the matrix (64 × 48 × 4 bytes) plus the safetensors header of
        # each answer: far less than the whole matrix (64 × 96 × 4)
        assert 64 * 48 * 4 <= c["received"] < 64 * 96 * 4
        assert server["sent"][r] == c["received"]
        assert "nowhere" in c["missing"]
        assert "not a file of this job" in c["outside"]


def _tampered(ctx: WorkerContext, _: Any) -> str:
    pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    if ctx.rank == 1:  # a header whose digest does not match its payload
        head = json.dumps({"sha256": sha256(b"the weights").hexdigest()}).encode()
        body = head + b"the weighTs"
        dist.send(torch.tensor([len(head), 11], dtype=torch.int64), 0, group=pg, tag=9)
        dist.send(torch.frombuffer(bytearray(body), dtype=torch.uint8), 0, group=pg, tag=9)
        send_blob(Blob({"ok": 1}, b"intact"), 0, pg, tag=9, timeout_s=30)
        return ""
    try:
        recv_blob(1, pg, tag=9, timeout_s=30)
        first = "accepted"
    except UserError as e:
        first = str(e)
    intact = recv_blob(1, pg, tag=9, timeout_s=30)
    assert intact.payload == b"intact" and intact.header == {"ok": 1}
    return first


@pytest.mark.slow
def test_an_altered_message_fails_its_hash_check() -> None:
    result = run_world(_tampered, 2)[0]
    assert "failed its SHA-256 check" in result
