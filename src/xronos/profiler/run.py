"""Profiling inside the workers: each device measures itself, then all profiles are shared.

Profiles are cached on disk by (device spec, model shape, batch shape, training mode,
unit sizes, torch version), so a second run on the same cluster starts training at once.
"""

from __future__ import annotations

import hashlib
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
        best = min(best, time.perf_counter() - t0)
    return best


def profile_self(
    name: str, shape: Shape, group: TPGroup, memory_cap: int | None, key: str
) -> DeviceProfile:
    """Measure this device (call on every rank at once: the all-reduce is collective)."""
    curves, replicated = measure_segments(shape)
    cfg = shape.cfg
    numel = shape.batch_size * shape.seq_len * cfg.hidden_size
    return DeviceProfile(
        name=name,
        segments=curves,
        replicated_s=replicated,
        allreduce_s=time_allreduce(group, numel),
        allreduces_per_step=4 * cfg.num_layers + 3,
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
