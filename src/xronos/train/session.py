"""The strategy seam: what the training loop needs from a way of splitting the work.

A :class:`Session` is one rank's part of a training run under one :class:`Strategy`:
its shard or stage of the model, its optimizer, and its step. Tensor parallelism
(:class:`~xronos.train.tp.TPSession`, also ``single`` with one rank) and pipelines
(:class:`~xronos.pipeline.session.PipelineSession`) implement it; the product's loop, the
benchmark and the tests drive every strategy through it alone::

    session.step(micro)         -> StepResult     loss, grad norm, lr, label tokens
    session.evaluate(spec)      -> EvalResult     on rank 0 (collective)
    session.save(path, extra)   /  session.load(path) -> extra   (collective checkpoints)
    session.gather_state()      -> {HF name: full tensor}        (collective)
    session.isolated_compute(micro) -> compute spans with no communication in flight

Strategy names are parsed once, at the edge (:meth:`Strategy.parse`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import torch

from xronos.comm.mappings import TPGroup
from xronos.data import TokenizedDataset
from xronos.errors import UserError
from xronos.metrics.records import Span
from xronos.train.batches import Batch


class Strategy(str, Enum):
    """How the devices share the work."""

    AUTO = "auto"
    """Predict every way below (and tensor parallelism over a subset of the devices, and
    hybrids) from the profiles, links included, and run the fastest."""
    XRONOS = "xronos"
    """Heterogeneous tensor parallelism: profiled, planned and calibrated shares."""
    TP_EVEN = "tp-even"
    """Megatron's even tensor-parallel split."""
    SINGLE = "single"
    """The fastest device alone."""
    PP_GPIPE = "pp-gpipe"
    """Pipeline, GPipe schedule."""
    PP_1F1B = "pp-1f1b"
    """Pipeline, 1F1B schedule."""
    HYBRID = "hybrid"
    """Pipeline (1F1B) whose one stage is heterogeneous TP over devices with fast links."""

    @property
    def is_pipeline(self) -> bool:
        """Runs pipeline stages (a hybrid too)."""
        return self in (Strategy.PP_GPIPE, Strategy.PP_1F1B, Strategy.HYBRID)

    @classmethod
    def parse(cls, text: str | Strategy, flag: str = "--strategy") -> Strategy:
        """``text`` as a Strategy, or a one-line error naming the choices."""
        try:
            return cls(text)
        except ValueError:
            names = ", ".join(s.value for s in cls)
            raise UserError(f"{flag}: unknown strategy {text!r}; choose one of {names}") from None

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports (the same on every rank)."""

    loss: float
    """Mean cross-entropy per label token of the step."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate the update used."""
    tokens: int
    """Label tokens trained on (:func:`~xronos.train.batches.label_count`)."""


@dataclass(frozen=True, kw_only=True)
class EvalSpec:
    """What to evaluate: a loss over a held-out set and greedy continuations of prompts."""

    dataset: TokenizedDataset | None = None
    prompts: tuple[tuple[int, ...], ...] = ()
    max_new_tokens: int = 32
    eos_ids: tuple[int, ...] = ()
    batch_size: int = 4
    pad_id: int = 0

    @property
    def empty(self) -> bool:
        return (self.dataset is None or len(self.dataset) == 0) and not self.prompts


@dataclass(frozen=True)
class EvalResult:
    loss: float
    """Eval loss per label token (NaN without an eval set)."""
    generated: list[list[int]]
    """Generated ids per prompt."""


class Session(Protocol):
    """One rank's part of a training run under one strategy (see the module docstring)."""

    strategy: Strategy
    group: TPGroup
    """The ranks that run this session (all devices, a subset, or this one alone)."""
    max_events: int
    """The most spans one step records on this rank (sizes the records' wire form)."""

    @property
    def steps_done(self) -> int:
        """Optimizer steps done (restored by :meth:`load`)."""
        ...

    def step(self, micro: Sequence[Batch]) -> StepResult: ...

    def evaluate(self, spec: EvalSpec) -> EvalResult | None: ...

    def save(self, path: Path, extra: dict[str, Any]) -> None: ...

    def load(self, path: str) -> dict[str, Any]: ...

    def gather_state(self) -> dict[str, torch.Tensor]: ...

    def isolated_compute(self, micro: Sequence[Batch]) -> list[Span]: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
