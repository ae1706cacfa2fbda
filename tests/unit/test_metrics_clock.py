"""Clock offsets and record shipping between two real gloo processes on this host."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from xronos.metrics import (
    SpanRecorder,
    StepRecord,
    estimate_clock_offset,
    pack_records,
    packed_size,
    unpack_records,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, fn: Callable[[int, int], Any], world: int, port: int, out: str) -> None:
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        result = fn(rank, world)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run_world(fn: Callable[[int, int], Any], world: int, tmp_path: Path) -> list[Any]:
    """Run ``fn(rank, world)`` in ``world`` spawned gloo processes; return their results."""
    mp.spawn(_entry, args=(fn, world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _offset_and_gather(rank: int, world: int) -> dict[str, Any]:
    offset = estimate_clock_offset(rounds=16)
    rec = SpanRecorder(rank=rank, device=f"dev{rank}")
    rec.start_step(0)
    for k in range(rank + 1):  # ranks record different numbers of events
        with rec.collective(f"recv:act/mb{k}"):
            pass
    record = rec.end_step()
    assert record is not None
    packed = pack_records([record.shifted(offset.offset_s)], max_events=4)
    gathered = [packed.new_zeros(packed_size(1, 4)) for _ in range(world)]
    dist.all_gather(gathered, packed)
    return {
        "offset_s": offset.offset_s,
        "rtt_s": offset.rtt_s,
        "records": [r.to_dict() for t in gathered for r in unpack_records(t)],
    }


@pytest.mark.slow
def test_clock_offset_is_zero_on_one_host_and_records_gather(tmp_path: Path) -> None:
    results = _run_world(_offset_and_gather, 2, tmp_path)
    assert results[0]["offset_s"] == 0.0
    offset, rtt = results[1]["offset_s"], results[1]["rtt_s"]
    # Both processes read the same CLOCK_MONOTONIC, so the true offset is 0 and the NTP
    # estimate's error is bounded by rtt/2 exactly (t0 <= t1 <= t2 <= t3); 1e-9 s covers
    # float rounding of times ~1e5 s.
    assert abs(offset) <= rtt / 2 + 1e-9
    # The minimum-RTT sample of 16 loopback ping-pongs is tens to hundreds of µs; 5 ms
    # leaves room for a loaded 2-core machine that preempts all but one round.
    assert abs(offset) < 5e-3

    for result in results:  # every rank unpacked both ranks' records intact
        records = [StepRecord.from_dict(d) for d in result["records"]]
        assert [(r.rank, r.device, len(r.collectives)) for r in records] == [
            (0, "dev0", 1),
            (1, "dev1", 2),
        ]
        assert [s.name for s in records[1].collectives] == ["recv:act/mb0", "recv:act/mb1"]
