"""Moving a running tensor-parallel session to another plan between two steps, without
restarting the workers (what :mod:`xronos.run.rebalance` decides, done)::

    save: a checkpoint in memory (rank 0 writes; the others send it their shards)
    free the old shard ─► build the new one ─► load ─► every rank agrees ─► delete

A move keeps the session's ranks (:func:`move`) or leaves some of them out (:func:`narrow`:
``auto`` releasing devices that no longer pay for their part). The checkpoint is the
resharding format, so the continuation is the same training (parameters, AdamW moments,
LoRA adapters, step count, RNG). It goes to a memory filesystem (``/dev/shm``) where the
host has one and no device has a memory cap (there, to disk); a device that holds no files
reads its slices through the coordinator's relay.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from xronos.comm.groups import new_group
from xronos.comm.mappings import TPGroup
from xronos.planner.memory import tp_need
from xronos.planner.plan import SEGMENTS, Plan
from xronos.planner.profile import DeviceProfile
from xronos.train.session import Strategy
from xronos.train.tp import TPSession

MIB = 1024**2


def capped(profiles: Sequence[DeviceProfile]) -> bool:
    """Whether some device has a memory cap."""
    return any(p.memory_bytes > 0 for p in profiles)


def memory_dir(on_disk: bool = False) -> Path:
    """Where moves write their checkpoint: a memory filesystem where there is one, unless
    ``on_disk`` (some device has a memory cap: a file in memory would count against the
    writer's cap, a file on disk only until the kernel writes it out)."""
    shm = Path("/dev/shm")
    if not on_disk and shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def in_memory_fs(path: Path) -> bool:
    """Whether ``path`` lies on a filesystem kept in memory (tmpfs, ramfs)."""
    best, kind = "", ""
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 2 and len(fields[1]) > len(best) and path.is_relative_to(fields[1]):
                best, kind = fields[1], fields[2]
    return kind in ("tmpfs", "ramfs")


def move_prefix(coordinator_pid: int, on_disk: bool = False) -> str:
    """The path prefix of every move's checkpoint in a run whose rank 0 has this pid."""
    return str(memory_dir(on_disk) / f"xronos-move-{coordinator_pid}-")


def move_peaks(
    profiles: Sequence[DeviceProfile],
    before: Plan,
    after: Plan,
    checkpoint_in_memory: bool,
    keep: Sequence[int] | None = None,
) -> list[int]:
    """Per device, the model's bytes at the height of a move from ``before`` to ``after``
    (the planner's memory model, :func:`~xronos.planner.memory.tp_need`): the larger of the
    old shard and the new one (the old one's tensors are freed once the checkpoint holds
    them, before the new one is built; the checkpoint is written one tensor at a time), and
    on the device that writes the checkpoint (rank 0) the whole of it where it goes to a
    memory filesystem, whose pages the kernel charges to the writer's memory limit. Errs
    high: the checkpoint holds weights and moments, not gradients and activations.
    ``keep``: the devices ``after`` runs on, in its order (None: all of them); a device
    left out holds its old shard until the checkpoint has it."""

    def need(p: DeviceProfile, plan: Plan, i: int) -> int:
        return tp_need(p, {s: plan.split(s)[i] for s in SEGMENTS})

    keep = list(range(len(profiles))) if keep is None else list(keep)
    peaks = [need(p, before, i) for i, p in enumerate(profiles)]
    old = sum(peaks)
    for j, i in enumerate(keep):
        peaks[i] = max(peaks[i], need(profiles[i], after, j))
    if checkpoint_in_memory:
        peaks[0] += old
    return peaks


def move_held(
    profiles: Sequence[DeviceProfile],
    before: Plan,
    after: Plan,
    where: Path,
    keep: Sequence[int] | None = None,
) -> str | None:
    """Why a move from ``before`` to ``after`` (on the devices ``keep``, None: all), its
    checkpoint written under ``where``, would not fit some device's memory cap
    (``memory_bytes``: what the cap leaves the model; 0 for no cap), or None when it fits."""
    in_memory = in_memory_fs(where)
    for p, peak in zip(profiles, move_peaks(profiles, before, after, in_memory, keep), strict=True):
        if 0 < p.memory_bytes < peak:
            return (
                f"moving would take about {peak / MIB:.0f} MiB for the model on {p.name!r} "
                f"(the larger of its shards{', and the checkpoint' if in_memory else ''}), "
                f"where its memory cap leaves {p.memory_bytes / MIB:.0f} MiB"
            )
    return None


def move(session: TPSession, plan: Plan, prefix: str) -> tuple[TPSession, float]:
    """``session``'s training state under ``plan``, on the same ranks (collective); and
    the seconds the move took."""
    everyone = range(session.group.size)
    fresh, seconds = narrow(session, everyone, plan, prefix, timeout_s=0.0)  # no new group
    assert fresh is not None
    return fresh, seconds


def narrowed_group(group: TPGroup, keep: Sequence[int], timeout_s: float) -> TPGroup | None:
    """The group of ``group``'s ranks ``keep`` (numbered as in ``group``), made by those
    ranks alone; None on a rank outside it. Latencies, payload and lanes carry over. Every
    rank kept: ``group`` itself."""
    keep = sorted(keep)
    if group.rank not in keep:
        return None
    if len(keep) == group.size:
        return group
    if len(keep) == 1:
        return TPGroup(payload=group.payload)
    world = group.world_ranks()
    pg = new_group([world[i] for i in keep], timeout_s, local=True)
    out = replace(group, rank=keep.index(group.rank), size=len(keep), pg=pg, lanes=())
    return out.with_lanes(timeout_s) if group.lanes else out


def narrow(
    session: TPSession, keep: Sequence[int], plan: Plan, prefix: str, timeout_s: float
) -> tuple[TPSession | None, float]:
    """``session``'s training state under ``plan`` on its ranks ``keep`` alone (collective
    over the session's group; ``timeout_s`` bounds the kept ranks' new group); None on the
    ranks left out. And the seconds it took."""
    t0 = time.perf_counter()
    old = session.group
    where = Path(f"{prefix}{session.steps_done}")
    session.save(where, {"move": True})
    session.release()  # the checkpoint holds it now: room for the new shard
    group = narrowed_group(old, keep, timeout_s)
    fresh = None
    if group is not None:
        alone = Strategy.SINGLE if group.size == 1 else session.strategy
        fresh = TPSession(session.source, plan, group, session.optim, alone)
        fresh.load(str(where))
    session.close()
    old.barrier()
    if old.rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    return fresh, time.perf_counter() - t0
