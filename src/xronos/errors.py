"""The exception types that reach the user as a single line."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input: printed as one line naming the problem and the fix,
    followed by a non-zero exit. Never raised for bugs in Xronos itself."""


class RunComplete(UserError):
    """``--resume`` found the run's newest checkpoint at its last step: nothing is left to
    train. A mistake when the user asked; the end of the job when torchrun started the
    workers again after they had finished (a device arrived as the run ended)."""


class WorkerError(RuntimeError):
    """A device's worker failed or stopped answering; the message names the device.
    ``details`` holds the worker's traceback, shown with ``--verbose``."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class DeviceLost(WorkerError):
    """A device's worker died (killed by a signal) or stopped answering: its collectives
    did not complete within the timeout. The survivors may carry on without it."""

    def __init__(self, device: str, rank: int, reason: str, details: str = "") -> None:
        super().__init__(f"device {device!r} (rank {rank}) {reason}", details)
        self.device, self.rank, self.reason = device, rank, reason
