"""A live move's memory: the old shard, the new one beside it and the checkpoint on the
device that writes it; a move that would pass a device's memory cap is held."""

from __future__ import annotations

from dataclasses import replace

from tests.unit.test_calibrate import _profile as speed_profile
from xronos.planner.plan import Plan
from xronos.run.rebalance import move_held, move_peaks

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


def _profiles(caps: tuple[int, int]) -> list:
    return [
        replace(speed_profile(n, s), unit_bytes=UNIT, base_bytes=BASE, memory_bytes=c)
        for n, s, c in zip(("fast", "slow"), (1.0, 0.4), caps, strict=True)
    ]


def _need(units: tuple[int, int, int]) -> int:
    return BASE + units[0] * UNIT["attn"] + units[1] * UNIT["mlp"] + units[2] * UNIT["vocab"]


def test_a_move_holds_the_old_shard_and_the_larger_of_its_copy_and_the_new_one() -> None:
    old = [_need((12, 48, 192)), _need((4, 16, 64))]
    new = [_need((14, 52, 200)), _need((2, 12, 56))]
    on_disk = move_peaks(_profiles((0, 0)), BEFORE, AFTER, checkpoint_in_memory=False)
    assert on_disk == [old[0] + new[0], old[1] + old[1]]  # fast grows, slow shrinks
    # a checkpoint in a memory filesystem is charged to its writer, rank 0, in full
    in_memory = move_peaks(_profiles((0, 0)), BEFORE, AFTER, checkpoint_in_memory=True)
    assert in_memory == [on_disk[0] + old[0] + old[1], on_disk[1]]


def test_a_move_is_held_only_where_it_would_pass_a_cap() -> None:
    assert move_held(_profiles((0, 0)), BEFORE, AFTER) is None  # no caps: always moves
    peaks = move_peaks(_profiles((0, 0)), BEFORE, AFTER, checkpoint_in_memory=True)
    roomy = (peaks[0] + MIB, peaks[1] + MIB)
    assert move_held(_profiles(roomy), BEFORE, AFTER) is None
    # caps that hold either plan (what the planner checks) but not both with a checkpoint
    tight = (int(1.2 * _need((14, 52, 200))), int(1.2 * _need((4, 16, 64))))
    why = move_held(_profiles(tight), BEFORE, AFTER)
    assert why is not None and "'fast'" in why and "memory cap" in why
