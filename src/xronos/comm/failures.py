"""Telling which device failed, from the workers' reports and exit codes: the one that
exited without a word (a lost device when a signal killed it), or the one that stays silent
while the others' collectives fail (it stopped answering)."""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Callable
from typing import Any

from xronos.errors import DeviceLost, WorkerError

SILENCE_GRACE_S = 30.0
"""Longest wait, once a worker's collective has failed with no peer dead, for the others to
report the same failure: one that neither reports nor exits in that time (at most half the
collective timeout) stopped answering. The others' collectives began within about a step of
the reporter's, so each times out within about a step of it."""


def silent_peer(
    procs: list[Any],
    results: Any,
    heard: set[int],
    grace_s: float,
    on_event: Callable[[int, dict[str, Any]], None] | None,
) -> int | None:
    """The first live worker that stays silent for ``grace_s`` after a collective failed
    (None when every other worker reported or exited); ``heard``, the workers that
    reported a failure, grows with those that report meanwhile."""
    deadline = time.monotonic() + grace_s
    while True:
        pending = [r for r, p in enumerate(procs) if r not in heard and p.exitcode is None]
        if not pending or time.monotonic() >= deadline:
            return pending[0] if pending else None
        try:
            _note(results.get(timeout=0.2), heard, on_event)
        except queue.Empty:
            continue


def _note(
    message: tuple[str, int, Any],
    heard: set[int],
    on_event: Callable[[int, dict[str, Any]], None] | None,
) -> None:
    """A worker's message read while telling who failed: an event goes on to
    ``on_event``; any other report adds its sender to ``heard``."""
    kind, rank, payload = message
    if kind == "up":  # a worker that started: no report
        return
    if kind != "event":
        heard.add(rank)
    elif on_event is not None:
        on_event(rank, payload)


def raise_died(devices: tuple[str, ...], rank: int, code: int) -> None:
    """A worker that exited without a word: killed by a signal, it is a lost device."""
    reason = f"died: {exit_reason(code)}"
    if code < 0:
        raise DeviceLost(devices[rank], rank, reason)
    raise WorkerError(f"device {devices[rank]!r} (rank {rank}) {reason}")


def raise_root_cause(
    procs: list[Any],
    results: Any,
    devices: tuple[str, ...],
    heard: set[int],
    on_event: Callable[[int, dict[str, Any]], None] | None,
) -> set[int]:
    """A worker whose collective failed is often the victim of another that died: name
    the one that exited without a word (not one of those ``heard`` reporting a failure, nor
    one whose report waits in ``results``: it failed as a victim), the cause, if any.
    Returns ``heard``, grown by the reports read."""
    time.sleep(0.3)
    while True:
        try:
            _note(results.get_nowait(), heard, on_event)
        except queue.Empty:
            break
    for rank, p in enumerate(procs):
        if rank not in heard and p.exitcode not in (None, 0):
            raise_died(devices, rank, p.exitcode)
    return heard


def exit_reason(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
