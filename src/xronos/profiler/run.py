"""Profiling inside the workers: each device measures itself, then all profiles are shared.

Profiles are cached on disk by (device spec, model shape, batch shape, training mode,
unit sizes, torch version), so a second run on the same cluster starts training at once.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from xronos.comm.mappings import TPGroup
from xronos.errors import UserError
from xronos.planner.comm import LinkModel, star_links, tp_traffic
from xronos.planner.profile import DeviceProfile
from xronos.profiler.measure import Shape, base_bytes, measure_segments, unit_bytes


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
            "torch": torch.__version__,
            "attn_unit": "query head",  # profiles of KV-group units are not reused
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
        dist.all_reduce(t, group=group.pg)
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
    p2p = dist.new_group(ranks, backend="gloo", use_local_synchronization=local)
    try:
        for i, j in itertools.combinations(range(group.size), 2):
            if group.rank in (i, j):
                peer = ranks[j if group.rank == i else i]
                points = [
                    (4 * n, _round_trip(p2p, peer, n, repeats, group.rank == i) / 2) for n in numels
                ]
                if group.rank == i:
                    out[(i, j)] = points
            dist.barrier(group=group.pg)
    finally:
        dist.destroy_process_group(p2p)
    return out


def _round_trip(pg: dist.ProcessGroup, peer: int, numel: int, repeats: int, lead: bool) -> float:
    """Fastest of ``repeats`` round trips of ``numel`` fp32 values with global rank ``peer``
    (the leader sends first, the other answers)."""
    t = torch.zeros(numel)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        if lead:
            dist.send(t, dst=peer, group=pg)
            dist.recv(t, src=peer, group=pg)
        else:
            dist.recv(t, src=peer, group=pg)
            dist.send(t, dst=peer, group=pg)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_links(group: TPGroup, numel: int) -> tuple[LinkModel | None, LinkModel | None]:
    """This rank's star link and the group's all-reduce line (None, None on one rank).

    Messages and all-reduces of ``numel / 16`` and ``numel`` fp32 values (the activation and
    a sixteenth of it) are timed; see :mod:`xronos.planner.comm` for the model. An
    all-reduce lasts until its last rank leaves, so at each size the slowest rank's time
    counts, and every rank fits the same line. Collective.
    """
    if group.size == 1:
        return None, None
    sizes = [max(1, numel // 16), numel]
    times = group.gather_object([time_allreduce(group, n) for n in sizes])
    ar = LinkModel.fit([(4 * n, max(t[i] for t in times)) for i, n in enumerate(sizes)])
    mine = time_pairs(group, sizes)
    pairs: dict[tuple[int, int], LinkModel] = {}
    for led in group.gather_object(mine):
        pairs.update({k: LinkModel.fit(v) for k, v in led.items()})
    return star_links(group.size, pairs)[group.rank], ar


def profile_self(
    name: str, shape: Shape, group: TPGroup, memory_cap: int | None, key: str
) -> DeviceProfile:
    """Measure this device (call on every rank at once: the all-reduce is collective)."""
    curves, replicated = measure_segments(shape)
    cfg = shape.cfg
    tokens = shape.batch_size * shape.seq_len
    numel = tokens * cfg.hidden_size
    link, ar_fit = measure_links(group, numel)
    names = group.gather_object(name)
    return DeviceProfile(
        name=name,
        segments=curves,
        replicated_s=replicated,
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
        unit_bytes=unit_bytes(shape),
        base_bytes=base_bytes(shape),
        key=key,
    )


def share_profiles(mine: DeviceProfile, group: TPGroup) -> list[DeviceProfile]:
    """Every rank's profile on every rank, in rank order."""
    return [DeviceProfile.from_dict(d) for d in group.gather_object(mine.to_dict())]


def profile_worker(ctx: Any, arg: tuple[Shape, int | None, str]) -> dict[str, Any]:
    """Launcher entry: profile this device (inside its limits) and return the profile."""
    shape, memory_cap, key = arg
    return profile_self(ctx.device, shape, ctx.group, memory_cap, key).to_dict()
