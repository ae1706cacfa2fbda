"""Link latency on real gloo ranks (loopback): a group whose devices have 20 ms links waits
at least the modelled latency in every all-reduce and all-gather, a pipeline message
arrives no sooner than both links allow, and the results do not change."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.world import WorkerContext, run_world
from xronos.comm.links import LinkDelays
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.pipeline.schedule import P2P
from xronos.profiler.run import time_allreduce

LATENCY_S = 0.02
# 2 ranks exchange their tensors (xronos.comm.exchange): one round for an all-reduce and an
# all-gather alike; each message crosses both links.
ALLREDUCE_S = 1 * (LATENCY_S + LATENCY_S)
ALLGATHER_S = 1 * (LATENCY_S + LATENCY_S)


def _collectives(ctx: WorkerContext, latency_s: float) -> dict[str, Any]:
    group = replace(ctx.group, links=LinkDelays((latency_s,) * ctx.world_size))
    x = torch.arange(6, dtype=torch.float32) * (ctx.rank + 1)
    rec = SpanRecorder(ctx.rank, ctx.device)
    rec.start_step(0)
    with use_recorder(rec):
        sums = []
        for i in range(3):
            y = x.clone()
            group.all_reduce(y, f"ar{i}")
            sums.append(y)
        gathered = group.all_gather(x, "ag")
    record = rec.end_step()
    assert record is not None
    spans = {s.name: s.duration for s in record.collectives}
    # the profiler's all-reduce timing sees the same latency as training does
    profiled = time_allreduce(group, 6)
    return {"sums": sums, "gathered": gathered, "spans": spans, "profiled": profiled}


def test_collectives_wait_the_modelled_latency_and_results_are_unchanged() -> None:
    slow = run_world(_collectives, 2, LATENCY_S)
    fast = run_world(_collectives, 2, 0.0)
    for rank in range(2):
        spans = slow[rank]["spans"]
        # Lower bounds on sleeps (the recorded span holds the real collective plus the
        # modelled wait), not speed assertions.
        for i in range(3):
            assert spans[f"ar{i}"] >= ALLREDUCE_S, (rank, spans)
        assert spans["ag"] >= ALLGATHER_S, (rank, spans)
        assert slow[rank]["profiled"] >= ALLREDUCE_S
        for a, b in zip(slow[rank]["sums"], fast[rank]["sums"], strict=True):
            assert torch.equal(a, b)  # latency moves no data: bit-identical
        assert all(
            torch.equal(a, b)
            for a, b in zip(slow[rank]["gathered"], fast[rank]["gathered"], strict=True)
        )
    x = torch.arange(6, dtype=torch.float32)
    assert torch.equal(slow[0]["sums"][0], x * 3)  # rank 0's x + rank 1's 2x


def _pipeline_message(ctx: WorkerContext, latencies: tuple[float, ...]) -> dict[str, Any]:
    pg = dist.new_group([0, 1], backend="gloo")
    group = replace(ctx.group, links=LinkDelays(latencies)).on(pg)
    p2p = P2P(group, ctx.devices, timeout_s=30)
    t = torch.arange(4, dtype=torch.float32)
    buf = torch.zeros(4)
    if ctx.rank == 1:
        p2p.post_recv("act/mb0/0->1", 0, buf, tag=0)
    ctx.group.barrier()  # on the world group: the p2p group counts only its messages
    out: dict[str, Any] = {}
    if ctx.rank == 0:
        out["sent"] = time.monotonic()  # the clock is shared by processes on one host
        p2p.send("act/mb0/0->1", 1, t, tag=0)
    else:
        out["data"] = p2p.wait_recv("act/mb0/0->1").clone()
        out["arrived"] = time.monotonic()
    p2p.drain()
    return out


def test_pipeline_message_arrives_after_both_links_latency() -> None:
    latencies = (0.01, 0.03)
    sender, receiver = run_world(_pipeline_message, 2, latencies)
    assert torch.equal(receiver["data"], torch.arange(4, dtype=torch.float32))
    # one way through the sender's and the receiver's link: 10 ms + 30 ms (a lower bound)
    assert receiver["arrived"] - sender["sent"] >= sum(latencies)


def _subgroup(ctx: WorkerContext, latencies: tuple[float, ...]) -> tuple[float, ...] | None:
    pg = dist.new_group([0, 2], backend="gloo")  # every rank takes part in making it
    if ctx.rank == 1:
        return None
    world = replace(ctx.group, links=LinkDelays(latencies))
    sub = replace(world, rank=dist.get_rank(pg), size=2).on(pg)
    delays = sub.delays()
    assert delays is not None
    x = torch.ones(3)
    sub.all_reduce(x, "sub")
    assert torch.equal(x, torch.full((3,), 2.0))
    return delays.latency_s


def test_a_subgroup_waits_for_its_own_members_links() -> None:
    # links are indexed by global rank; the subgroup {0, 2} must use devices 0 and 2's
    out = run_world(_subgroup, 3, (0.001, 0.5, 0.003))
    assert out == [(0.001, 0.003), None, (0.001, 0.003)]
