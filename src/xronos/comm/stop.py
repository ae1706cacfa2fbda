"""A worker's stop request: stop after the step in flight (every rank agrees at its end),
checkpoint and return. The launcher's stop signal, and SIGTERM where the whole process
group is stopped (``timeout``, a service manager), set it from the worker's first
instruction on (:mod:`xronos.comm.launch`), so that a request that arrives while the
worker is still starting is kept, not its death; the training loop reads it."""

from __future__ import annotations

import signal
from types import FrameType

_REQUESTED = [False]


def request(signum: int, frame: FrameType | None) -> None:
    """A signal handler: the stop is requested."""
    _REQUESTED[0] = True


def requested() -> bool:
    """Whether this process was asked to stop."""
    return _REQUESTED[0]


def listen(*signals: int) -> None:
    """Take each of ``signals`` as a stop request from now on."""
    for sig in signals:
        signal.signal(sig, request)
