"""A live move's memory: the larger of the old shard and the new one (the old one is freed
before the new one is built) and, on the device that writes it, a checkpoint kept in
memory; a move that would pass a device's memory cap is held."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from tests.unit.test_calibrate import _profile as speed_profile
from xronos.planner.plan import Plan
from xronos.run.moves import capped, in_memory_fs, memory_dir, move_held, move_peaks

MIB = 2**20
UNIT = {"attn": 4 * MIB, "mlp": 2 * MIB, "vocab": MIB}
BASE = 50 * MIB


def _plan(attn: tuple[int, int], mlp: tuple[int, int], vocab: tuple[int, int]) -> Plan:
    return Plan(
        strategy="xronos",
        devices=("fast", "slow"),
        attn=attn,
        mlp=mlp,
        vocab=vocab,
        mlp_chunk=32,
        vocab_chunk=32,
    )


BEFORE = _plan((12, 4), (48, 16), (192, 64))
AFTER = _plan((14, 2), (52, 12), (200, 56))
DISK = Path("/proc/self")  # not a memory filesystem: the checkpoint is not counted


def _profiles(caps: tuple[int, int]) -> list:
    return [
        replace(speed_profile(n, s), unit_bytes=UNIT, base_bytes=BASE, memory_bytes=c)
        for n, s, c in zip(("fast", "slow"), (1.0, 0.4), caps, strict=True)
    ]


def _need(units: tuple[int, int, int]) -> int:
    return BASE + units[0] * UNIT["attn"] + units[1] * UNIT["mlp"] + units[2] * UNIT["vocab"]


def test_a_move_holds_the_larger_shard_and_rank_0_a_checkpoint_kept_in_memory() -> None:
    old = [_need((12, 48, 192)), _need((4, 16, 64))]
    new = [_need((14, 52, 200)), _need((2, 12, 56))]
    on_disk = move_peaks(_profiles((0, 0)), BEFORE, AFTER, checkpoint_in_memory=False)
    assert on_disk == [new[0], old[1]]  # fast grows, slow shrinks
    # a checkpoint in a memory filesystem is charged to its writer, rank 0, in full
    in_memory = move_peaks(_profiles((0, 0)), BEFORE, AFTER, checkpoint_in_memory=True)
    assert in_memory == [on_disk[0] + old[0] + old[1], on_disk[1]]


def test_a_move_is_held_only_where_it_would_pass_a_cap() -> None:
    assert move_held(_profiles((0, 0)), BEFORE, AFTER, DISK) is None  # no caps: always moves
    # with caps the checkpoint goes to disk: a move fits where both plans fit...
    both = (_need((14, 52, 200)), _need((4, 16, 64)))
    assert move_held(_profiles(both), BEFORE, AFTER, DISK) is None
    # ...and is held where the new plan would not (the planner would not propose it)
    why = move_held(_profiles((both[0] - MIB, both[1])), BEFORE, AFTER, DISK)
    assert why is not None and "'fast'" in why and "memory cap" in why


def test_a_capped_run_writes_its_moves_outside_memory_where_it_can() -> None:
    fast, slow = _profiles((0, 0))
    assert not capped([fast, slow]) and capped([fast, replace(slow, memory_bytes=MIB)])
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    tmpfs = [m[1] for m in mounts if m[2] == "tmpfs"]
    assert all(in_memory_fs(Path(m, "x")) for m in tmpfs)
    assert not in_memory_fs(Path("/proc/self"))  # procfs: not a file's memory
    # capped: the temporary directory, which move_held counts if it is in memory after all
    assert memory_dir(on_disk=True) == Path(tempfile.gettempdir())
