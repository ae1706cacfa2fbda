"""Cheap span recording inside one worker process.

::

    rec = SpanRecorder(rank=0, device="hub")
    rec.start_step(7)
    with rec.collective("layer3.mlp.allreduce"):   # arrive ... leave
        dist.all_reduce(y, group=group)
    with rec.compute("fwd:mb0", kind="forward"):    # optional, PP
        ...
    record = rec.end_step()                         # StepRecord, or None when disabled

Each event costs two ``time.perf_counter()`` calls and one list append. Events outside
``start_step``/``end_step`` (evaluation, profiling) are dropped. Collectives must not overlap
on a rank (TP and PP both issue them one at a time); nesting is kept as recorded but the
analysis assumes none.

Layers deep inside the model reach the recorder through :func:`current_recorder`, set for a
block of code with :func:`use_recorder`; with none set it is a disabled recorder, so the
single-device code path records nothing and pays almost nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from xronos.metrics.records import COLLECTIVE, COMPUTE, Span, StepRecord

_clock = time.perf_counter


class _SpanScope:
    """Context manager that records one span; reused objects keep the hot path small."""

    __slots__ = ("_compute_flag", "_kind", "_name", "_rec", "_start")

    def __init__(self, rec: SpanRecorder, name: str, kind: str, compute: bool) -> None:
        self._rec = rec
        self._name = name
        self._kind = kind
        self._start = 0.0
        self._compute_flag = compute

    def __enter__(self) -> None:
        self._start = _clock()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        end = _clock()
        events = self._rec._computes if self._compute_flag else self._rec._collectives
        if events is not None:
            events.append(Span(self._name, self._start, end, self._kind))


class _NullScope:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _NullScope()


class SpanRecorder:
    """Records step bounds, collective spans and compute spans for one rank.

    Args:
        rank: this process's rank in the training group.
        device: device name from the cluster spec.
        enabled: when False every method is a no-op and :meth:`end_step` returns None.
    """

    def __init__(self, rank: int = 0, device: str = "", enabled: bool = True) -> None:
        self.rank = rank
        self.device = device
        self.enabled = enabled
        self._step = -1
        self._start = 0.0
        self._collectives: list[Span] | None = None  # None = no step open
        self._computes: list[Span] | None = None
        self._open: list[tuple[str, str, float]] = []

    @property
    def in_step(self) -> bool:
        return self._collectives is not None

    def start_step(self, step: int) -> None:
        """Open step ``step``; events until :meth:`end_step` belong to it."""
        if not self.enabled:
            return
        self._step = step
        self._collectives = []
        self._computes = []
        self._open = []
        self._start = _clock()

    def end_step(self) -> StepRecord | None:
        """Close the open step and return its record (None if disabled or none open)."""
        end = _clock()
        if not self.enabled or self._collectives is None or self._computes is None:
            return None
        if self._open:
            names = ", ".join(name for name, _, _ in self._open)
            raise RuntimeError(f"step {self._step} ended inside unfinished collective(s): {names}")
        record = StepRecord(
            rank=self.rank,
            device=self.device,
            step=self._step,
            start=self._start,
            end=end,
            collectives=tuple(self._collectives),
            computes=tuple(self._computes),
        )
        self._collectives = None
        self._computes = None
        return record

    def collective(self, name: str, kind: str = COLLECTIVE) -> _SpanScope | _NullScope:
        """Context manager around one blocking communication call."""
        if self._collectives is None:
            return _NULL
        return _SpanScope(self, name, kind, compute=False)

    def compute(self, name: str, kind: str = COMPUTE) -> _SpanScope | _NullScope:
        """Context manager around an explicit compute span (e.g. ``kind="forward"``)."""
        if self._computes is None:
            return _NULL
        return _SpanScope(self, name, kind, compute=True)

    def arrive(self, name: str, kind: str = COLLECTIVE) -> None:
        """Mark entering a collective; pair with :meth:`leave` (for code that cannot use
        ``with``, e.g. an async handle waited on later)."""
        if self._collectives is not None:
            self._open.append((name, kind, _clock()))

    def leave(self) -> None:
        """Mark leaving the most recently arrived, unfinished collective."""
        end = _clock()
        if self._collectives is None:
            return
        if not self._open:
            raise RuntimeError("SpanRecorder.leave() without a matching arrive()")
        name, kind, start = self._open.pop()
        self._collectives.append(Span(name, start, end, kind))


_DISABLED = SpanRecorder(enabled=False)
_current: SpanRecorder = _DISABLED


def current_recorder() -> SpanRecorder:
    """The recorder set by the innermost :func:`use_recorder`, else a disabled one."""
    return _current


@contextmanager
def use_recorder(recorder: SpanRecorder) -> Iterator[SpanRecorder]:
    """Make ``recorder`` the :func:`current_recorder` for the ``with`` block."""
    global _current
    previous = _current
    _current = recorder
    try:
        yield recorder
    finally:
        _current = previous
