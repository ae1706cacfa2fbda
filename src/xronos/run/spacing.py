"""When a fine-tuning run writes checkpoints.

With ``--save-every N`` every N-th step is checkpointed (0: only the last). Without it the
spacing follows from what a lost device may cost: the survivors restart from the newest
checkpoint and recompute the steps done since, so checkpoints ``k`` steps apart cost at
most ``k`` steps of training. ``k`` is the number of steps that fit in
:data:`LOSS_BUDGET_S`, from the step time measured over the first steps (the slowest
rank's median, agreed by every rank, since a save is collective)::

    step  1      2      3      4      5   …  k      2k
          |------|------|------|------|      ▼       ▼
          warm-up  timed: median → k = ⌊60 s / median⌋   checkpoints at multiples of k

Only the newest :data:`KEEP` automatic checkpoints stay on disk (``--save-total-limit``
sets how many checkpoints of either kind stay).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

LOSS_BUDGET_S = 60.0
"""Most seconds of training a lost device may cost when ``--save-every`` is not given."""
TIMED_STEPS = 4
"""Steps timed (after the first, which pays for warm-up) before the spacing is fixed."""
KEEP = 2
"""Automatic checkpoints kept on disk (the newest ones); the last one is enough to
resume, the one before is a spare."""


def checkpoint_interval(step_s: float, budget_s: float = LOSS_BUDGET_S) -> int:
    """Steps between automatic checkpoints: as many steps of ``step_s`` seconds as fit in
    ``budget_s``, at least one, so that the steps recomputed after a loss take at most
    ``budget_s`` (or one step, when a step alone takes longer)."""
    if not (math.isfinite(step_s) and step_s > 0):
        raise ValueError(f"step time must be a positive number of seconds, got {step_s}")
    return max(1, math.floor(budget_s / step_s))


class CheckpointSpacing:
    """Says after each step whether to checkpoint.

    Args:
        every: ``--save-every`` (0: never before the end); None: automatic spacing.
        budget_s: automatic spacing: most seconds of training between two checkpoints.
        timed_steps: automatic spacing: steps timed before the interval is fixed.
        clock: seconds, monotonic (a test passes a fake one).
    """

    def __init__(
        self,
        every: int | None,
        *,
        budget_s: float = LOSS_BUDGET_S,
        timed_steps: int = TIMED_STEPS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.automatic = every is None
        self.interval: int | None = every
        """Steps between checkpoints (0: none); None until automatic spacing has measured."""
        self.budget_s, self.timed_steps, self.clock = budget_s, timed_steps, clock
        self.step_s: float | None = None
        """The agreed step time the automatic interval was computed from."""
        self._times: list[float] = []
        self._last: float | None = None

    def due(self, step: int, agree: Callable[[float], float]) -> bool:
        """Whether to checkpoint after ``step`` (steps done). Called once after every step
        on every rank; ``agree`` turns this rank's median step time into one value that
        every rank shares (the slowest rank's), called once, on the same step everywhere."""
        if self.interval is None:
            now = self.clock()
            if self._last is not None:
                self._times.append(now - self._last)
            self._last = now
            if len(self._times) >= self.timed_steps:
                self.step_s = agree(statistics.median(self._times))
                self.interval = checkpoint_interval(self.step_s, self.budget_s)
        every = self.interval
        return every is not None and every > 0 and step % every == 0
