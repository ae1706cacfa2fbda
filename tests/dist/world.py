"""``run_world(fn, world_size, arg)``: run ``fn(ctx, arg)`` on gloo ranks via the real
launcher and return each rank's result."""

from __future__ import annotations

from typing import Any

from xronos.comm.launch import WorkerContext, WorkerFn, launch

__all__ = ["WorkerContext", "run_world"]


def run_world(fn: WorkerFn, world_size: int, arg: Any = None, timeout_s: float = 60.0) -> list[Any]:
    devices = [f"rank{i}" for i in range(world_size)]
    return launch(fn, [arg] * world_size, devices, timeout_s=timeout_s)
