"""Profiling inside the workers: each device measures itself, then all profiles are shared.

Profiles are cached on disk by (device spec, model shape, batch shape, training mode,
unit sizes, torch version), so a second run on the same cluster starts training at once.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from xronos.comm import exchange
from xronos.comm.groups import new_group
from xronos.comm.mappings import TPGroup
from xronos.errors import UserError
from xronos.planner.comm import LinkModel, star_links, tp_traffic
from xronos.planner.plan import segment_units
from xronos.planner.profile import CostCurve, DeviceProfile
from xronos.profiler.bytes import base_bytes, memory_scale, unit_bytes, whole_need
from xronos.profiler.measure import SPLIT_PASSES, SegmentTimes, Shape, measure_segments
from xronos.profiler.overlap import measure_overlap
from xronos.profiler.update import measure_update
from xronos.profiler.whole import split_to_whole, step_peak, time_whole_step


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "xronos" / "profiles"


def profile_key(device: dict[str, Any], shape: Shape) -> str:
    blob = json.dumps(
        {
            "device": device,
            "model": {k: v for k, v in shape.cfg.to_hf_dict().items() if k != "architectures"},
            "batch": [shape.batch_size, shape.seq_len],
            "chunks": [shape.mlp_chunk, shape.vocab_chunk],
            "lora": asdict(shape.lora) if shape.lora else None,
            **({"recompute": True} if shape.recompute else {}),
            "torch": torch.__version__,
            "attn_unit": "query head",  # profiles of KV-group units are not reused
            # older profiles are not reused
            "measures": [
                "split by 4",
                "sync",
                "whole step",
                "tied embedding",
                "update",
                "bulk link",
                "pair exchange",  # two ranks' all-reduce: one exchange, not gloo's ring
                "whole step: the trainer's, after 2 warm-up steps",
                "whole step: the median of 3",
                "layer segments: unit points timed interleaved",
                "sync: its rounds pay the emulated link latency",
                "split: the cut timed in the line's rounds",
                "split: shared out from the whole step cut",
                "whole step: 3 warm-up steps; the median of 3 that agree within 10 %",
                "memory: four MLP activations a column; scaled to the whole step's peak",
                "lines: a warm-up round; implausible points timed again",
                "overlap loss",
            ],
            "optimizer": "adamw fused",  # the step's optimizer, as the update is timed
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def load_cached(keys: list[str]) -> list[DeviceProfile] | None:
    """All profiles for ``keys`` from the cache, or None if any is missing."""
    out = []
    for key in keys:
        path = cache_dir() / f"{key}.json"
        if not path.is_file():
            return None
        try:
            out.append(DeviceProfile.from_dict(json.loads(path.read_text())))
        except (json.JSONDecodeError, UserError):
            return None
    return out


def store_cached(profiles: list[DeviceProfile]) -> None:
    from xronos.utils import atomic_write_text

    for p in profiles:
        if p.key:
            atomic_write_text(cache_dir() / f"{p.key}.json", json.dumps(p.to_dict(), indent=2))


def usable_memory(cap_bytes: int | None) -> int:
    """The device's memory cap, or what the host has available."""
    if cap_bytes:
        return int(cap_bytes)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def time_allreduce(group: TPGroup, numel: int, repeats: int = 5) -> float:
    """Seconds of one all-reduce of ``numel`` fp32 values on this group (min of repeats,
    each started after a barrier so that waiting for a straggler is not counted)."""
    if group.size == 1:
        return 0.0
    t = torch.zeros(numel)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier(group=group.pg)
        t0 = time.perf_counter()
        exchange.all_reduce(t, group.pg)  # what the step's collectives run
        group.link_wait(t, "all_reduce")  # link latency emulated in the communication layer
        best = min(best, time.perf_counter() - t0)
    return best


def time_pairs(
    group: TPGroup, numels: list[int], repeats: int = 3
) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """One-way times of messages of ``numels`` fp32 values between every pair of ranks.

    Pairs take turns (a barrier between them, so no two exchanges share the wire); for pair
    ``(i, j)``, ``i < j``, rank ``i`` sends to ``j`` and ``j`` sends the same back, and half the
    fastest round trip is the one-way time. Collective: call on every rank.

    Args:
        group: the ranks; every pair of them is measured.
        numels: message sizes (fp32 values), at least two for a line through them.

    Returns:
        ``{(i, j): [(bytes, seconds), ...]}`` for the pairs this rank led (``i`` = this
        rank); gather them to have every pair.
    """
    out: dict[tuple[int, int], list[tuple[int, float]]] = {}
    if group.size == 1:
        return out
    # Messages go over a group of their own: gloo counts them in a group's sequence number,
    # which the collectives' consistency check compares, and only two ranks send at a time.
    ranks = dist.get_process_group_ranks(group.pg) if group.pg is not None else []
    ranks = ranks or list(range(group.size))
    # Every rank of the world joins the new group when the group is the world: a group made
    # by its members alone is named after its ranks, and one made again after the first was
    # destroyed would find the first one's stale addresses.
    local = len(ranks) < dist.get_world_size()
    p2p = new_group(ranks, local=local)
    try:
        for i, j in itertools.combinations(range(group.size), 2):
            if group.rank in (i, j):
                peer = ranks[j if group.rank == i else i]
                points = [
                    (4 * n, _round_trip(group, p2p, peer, n, repeats, group.rank == i) / 2)
                    for n in numels
                ]
                if group.rank == i:
                    out[(i, j)] = points
            dist.barrier(group=group.pg)
    finally:
        dist.destroy_process_group(p2p)
    return out


def _round_trip(
    group: TPGroup, pg: dist.ProcessGroup, peer: int, numel: int, repeats: int, lead: bool
) -> float:
    """Fastest of ``repeats`` round trips of ``numel`` fp32 values with global rank ``peer``
    (the leader sends first, the other answers). Links emulated in the communication layer
    delay each message on arrival, as they delay the strategies' messages."""
    t = torch.zeros(numel)
    links = group.links if group.delays() is not None else None
    me = dist.get_rank()

    def arrived() -> None:
        if links is not None:
            links.wait(links.message_delay(peer, me, 4 * numel))

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        if lead:
            dist.send(t, dst=peer, group=pg)
            dist.recv(t, src=peer, group=pg)
            arrived()
        else:
            dist.recv(t, src=peer, group=pg)
            arrived()
            dist.send(t, dst=peer, group=pg)
        best = min(best, time.perf_counter() - t0)
    return best


SYNC_ROUND_S = 0.02
"""Mean compute per round of the barrier measurement: about the time between two
all-reduces of a tensor-parallel step of a small model on a slow device."""
SYNC_SPREAD = (0.3, 1.6, 0.7, 1.2, 0.4, 1.9, 0.9, 1.0, 0.5, 1.5, 0.8, 1.2) * 2
"""Each round's length as a fraction of the mean (the same on every device): a step's
barriers are unevenly spaced, so a device that runs in bursts meets them at every phase of
its bursts, not at one it would lock into with equal rounds."""
SYNC_PASSES = 3
"""Passes of :data:`SYNC_SPREAD` the barrier measurement takes the median of: one
preemption of a few tens of ms in a pass of ~0.5 s moves its mean wait by a millisecond,
which a step of ~20 barriers would pay twenty times over in the prediction."""


def measure_sync(group: TPGroup, round_s: float = SYNC_ROUND_S) -> float:
    """The mean wait per barrier beyond the slowest device's mean arrival, when every device
    brings the same mean compute to it (:attr:`DeviceProfile.sync_s`). Collective.

    Each device sizes a fixed kernel to ``round_s`` of its own speed and runs rounds of it
    (lengths :data:`SYNC_SPREAD`), each closed by a one-float all-reduce, timing its own
    compute apart from the whole pass. A pass's barrier cost is its mean round minus the
    slowest device's mean compute minus the all-reduce's own time (the slowest rank's): a
    device that runs in bursts (a CFS quota) or is preempted arrives late at random, and the
    barrier waits for the latest. Compute and rounds come from the same pass, so the host's
    drift between two passes does not enter; the median of :data:`SYNC_PASSES` passes is
    returned, the same on every rank."""
    if group.size == 1:
        return 0.0
    a, out, flag = torch.randn(96, 96), torch.empty(96, 96), torch.zeros(1)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 10 * round_s:
        for _ in range(20):
            torch.mm(a, a, out=out)
        n += 20
    work = max(1, int(n / (time.perf_counter() - t0) * round_s))

    def one_pass() -> tuple[float, float]:
        """(mean compute, mean round) of one pass on this device."""
        dist.barrier(group=group.pg)
        compute, start = 0.0, time.perf_counter()
        for f in SYNC_SPREAD:
            t0 = time.perf_counter()
            for _ in range(max(1, round(work * f))):
                torch.mm(a, a, out=out)
            compute += time.perf_counter() - t0
            exchange.all_reduce(flag, group.pg)  # the step's collective, as in latency
            group.link_wait(flag, "all_reduce")  # emulated link latency included
        return compute / len(SYNC_SPREAD), (time.perf_counter() - start) / len(SYNC_SPREAD)

    passes = [one_pass() for _ in range(SYNC_PASSES)]
    latency = time_allreduce(group, 1)
    ranks = group.gather_object((passes, latency))
    slowest = max(lat for _, lat in ranks)
    waits = [
        max(r[i][1] for r, _ in ranks) - max(r[i][0] for r, _ in ranks) - slowest
        for i in range(SYNC_PASSES)
    ]
    return max(0.0, statistics.median(waits))


BULK_FACTOR = 4
"""The bulk message of the link measurement, in activations (:mod:`xronos.planner.comm`)."""


def measure_links(group: TPGroup, numel: int) -> tuple[LinkModel | None, LinkModel | None]:
    """This rank's star link and the group's all-reduce line (None, None on one rank).

    Messages and all-reduces of ``numel / 16`` and ``numel`` fp32 values (the activation and
    a sixteenth of it) are timed, and messages of ``BULK_FACTOR · numel`` for the link's
    sustained rate; see :mod:`xronos.planner.comm` for the model. An
    all-reduce lasts until its last rank leaves, so at each size the slowest rank's time
    counts, and every rank fits the same line. Collective.
    """
    if group.size == 1:
        return None, None
    sizes = [max(1, numel // 16), numel]
    times = group.gather_object([time_allreduce(group, n) for n in sizes])
    ar = LinkModel.fit([(4 * n, max(t[i] for t in times)) for i, n in enumerate(sizes)])
    mine = time_pairs(group, [*sizes, BULK_FACTOR * numel])
    pairs: dict[tuple[int, int], LinkModel] = {}
    for led in group.gather_object(mine):
        for k, (*line, bulk) in led.items():
            pairs[k] = LinkModel.fit(line).with_bulk(4 * numel, *bulk)
    return star_links(group.size, pairs)[group.rank], ar


def profile_self(
    name: str, shape: Shape, group: TPGroup, memory_cap: int | None, key: str
) -> DeviceProfile:
    """Measure this device (call on every rank at once: the all-reduce is collective)."""
    measured = scaled(measure_segments(shape), shape, group, memory_cap)
    cfg = shape.cfg
    tokens = shape.batch_size * shape.seq_len
    numel = tokens * cfg.hidden_size
    link, ar_fit = measure_links(group, numel)
    names = group.gather_object(name)
    tied = cfg.tie_word_embeddings and shape.lora is None  # its gradient travels whole
    return DeviceProfile(
        name=name,
        segments=measured.curves,
        replicated_s=measured.replicated_s,
        split_s=measured.split_s,
        embed_s=measured.embed_s,
        embed_split_s=measured.embed_split_s,
        update_s=measure_update(shape),
        step_scale=measured.scale,
        tied_grad_bytes=4 * cfg.vocab_size * cfg.hidden_size if tied else 0,
        sync_s=measure_sync(group),  # collective, as the next: the same order on every rank
        overlap_loss=measure_overlap(group, tokens, cfg.hidden_size),
        allreduce_s=time_allreduce(group, numel),
        allreduces_per_step=4 * cfg.num_layers + 3,
        link=link,
        allreduce_fit=ar_fit,
        allreduce_group=tuple(names) if ar_fit is not None else (),
        traffic=tp_traffic(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            tokens=tokens,
            tied_embeddings=cfg.tie_word_embeddings,
        ),
        memory_bytes=usable_memory(memory_cap),
        unit_bytes=unit_bytes(shape, measured.memory_scale),
        base_bytes=base_bytes(shape, measured.memory_scale),
        memory_scale=measured.memory_scale,
        key=key,
    )


WHOLE_STEP_MAX_S = 3.0
"""Above this predicted step a device does not time a whole step (it takes the others'
ratio): profiling stays a few seconds on a slow device."""


def scaled(
    parts: SegmentTimes, shape: Shape, group: TPGroup, memory_cap: int | None
) -> SegmentTimes:
    """``parts`` scaled so that their sum for the whole model is a real step's time.

    The segments are timed apart; a real step also runs the model's own Python, the loss
    and one optimizer over every parameter, and its layers share the caches. Each device
    times one whole step where it holds the model and it takes at most
    :data:`WHOLE_STEP_MAX_S`; the ratio real / parts scales every cost (a device that did
    not time one takes the median ratio of those that did; none: 1). The same rounds time
    the step cut into :data:`~xronos.profiler.measure.SPLIT_PASSES` micro-batches: what a
    micro-batch adds to the whole model then replaces the segments' own cuts, shared among
    them (and the embedding) in proportion to their times (:func:`split_to_whole`).
    The step's peak memory scales the activations' bytes
    (:func:`~xronos.profiler.bytes.memory_scale`; a device without it takes the others'
    median, none: 1); a capped device whose step is too slow to time steps untimed for it
    (:func:`~xronos.profiler.whole.step_peak`). Collective."""
    totals = segment_units(shape.cfg, shape.mlp_chunk, shape.vocab_chunk)
    predicted = parts.replicated_s + sum(c(totals[s]) for s, c in parts.curves.items())
    room = usable_memory(memory_cap)
    fits = room == 0 or whole_need(shape) <= room
    timed = 0 < predicted <= WHOLE_STEP_MAX_S and fits
    whole = time_whole_step(shape, SPLIT_PASSES) if timed else None  # ≤ 1 sequence a pass
    ratio = None if whole is None else whole.seconds / predicted
    grown = None if whole is None else whole.peak_bytes
    if whole is None and fits and memory_cap:  # too slow to time, and memory may bind
        grown = step_peak(shape)
    mem = None if grown is None else memory_scale(shape, grown)
    both = group.gather_object((ratio, mem))
    k, km = (_own_or_median(mine, [r[i] for r in both]) for i, mine in enumerate((ratio, mem)))
    out = SegmentTimes(
        {s: CostCurve(c.a * k, c.b * k) for s, c in parts.curves.items()},
        parts.replicated_s * k,
        {s: v * k for s, v in parts.split_s.items()},
        scale=k,
        embed_s=parts.embed_s * k,
        embed_split_s=parts.embed_split_s * k,
        memory_scale=km,
    )
    if whole is None or whole.per_pass_s is None:
        return out
    return split_to_whole(out, whole.per_pass_s, totals)


def _own_or_median(mine: float | None, every: list[float | None]) -> float:
    """This device's measurement; where it has none, the median of the others'; none: 1."""
    if mine is not None:
        return mine
    known = [x for x in every if x is not None]
    return statistics.median(known) if known else 1.0


def share_profiles(mine: DeviceProfile, group: TPGroup) -> list[DeviceProfile]:
    """Every rank's profile on every rank, in rank order."""
    return [DeviceProfile.from_dict(d) for d in group.gather_object(mine.to_dict())]


def profile_worker(ctx: Any, arg: tuple[Shape, int | None, str]) -> dict[str, Any]:
    """Launcher entry: profile this device (inside its limits) and return the profile."""
    shape, memory_cap, key = arg
    return profile_self(ctx.device, shape, ctx.group, memory_cap, key).to_dict()
