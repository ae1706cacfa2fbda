"""Tensor-parallel sessions: ``xronos`` and ``tp-even`` on every device, ``single`` on one.

One rank's shard under a :class:`~xronos.planner.plan.Plan`, its :class:`Trainer`, and
what the loop asks of a session (:mod:`xronos.train.session`). With a group of one rank
this is the plain single-device run, the oracle of every exactness test.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from xronos.checkpoint import load_checkpoint, save_checkpoint
from xronos.comm.mappings import TPGroup
from xronos.metrics.overlap import is_laned, lane_phases
from xronos.metrics.recorder import SpanRecorder, use_recorder
from xronos.metrics.records import Span, StepRecord
from xronos.model.llama import LlamaForCausalLM
from xronos.parallel.gather import gather_state
from xronos.planner.plan import Plan
from xronos.train.batches import Batch, label_count
from xronos.train.generate import evaluate
from xronos.train.optim import OptimConfig
from xronos.train.session import EvalResult, EvalSpec, StepResult, Strategy
from xronos.train.source import ModelSource
from xronos.train.trainer import SLOW_FIRST_STEPS, Trainer

MAX_EVENTS = 512  # collectives per step that a packed record can carry

OVERLAPPED_COMPUTE = "compute.total"
"""Name of the one span that stands for an overlapped step's compute (:func:`compute_gaps`)."""


def _overlapped_compute(start: float, total: float) -> Span:
    return Span(OVERLAPPED_COMPUTE, start, start + total, "compute")


def compute_gaps(rec: StepRecord) -> list[Span]:
    """The compute spans of a TP step: from the step's start to the first collective and
    between consecutive collectives, named by the collective that ends them. An overlapped
    step's lanes compute while collectives are in flight, so its compute has no such
    pieces: one span :data:`OVERLAPPED_COMPUTE` as long as its compute in all."""
    if is_laned([rec]):
        parts = [(c, c.start) for c in rec.collectives]  # alone: no rank to wait for
        total = sum(p.end - p.start for p in lane_phases(rec, parts) if p.kind == "compute")
        return [_overlapped_compute(rec.start, total)]
    out, t = [], rec.start
    for i, c in enumerate(rec.collectives):
        out.append(Span(f"{rec.rank}/{i}:{c.name}", t, c.arrive, "compute"))
        t = c.leave
    out.append(Span(f"{rec.rank}/end", t, rec.end, "compute"))
    return out


class TPSession:
    """This rank's shard, its optimizer and its plan.

    Args:
        source: where the weights come from.
        plan: units per device (``plan.world_size == group.size``).
        group: the tensor-parallel group (size 1: the whole model on this device).
        optim: AdamW and clipping settings.
        strategy: the name this session runs under.
        model: the shard already built for ``plan`` (calibration builds one), or None.
        calibration: the calibration rounds that made ``plan`` (:meth:`Round.to_dict
            <xronos.planner.calibrate.Round.to_dict>`), oldest first; empty when the plan
            was not calibrated.
    """

    max_events = MAX_EVENTS

    def __init__(
        self,
        source: ModelSource,
        plan: Plan,
        group: TPGroup,
        optim: OptimConfig,
        strategy: Strategy,
        model: LlamaForCausalLM | None = None,
        calibration: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.source, self.plan, self.group, self.optim = source, plan, group, optim
        self.strategy = strategy
        self.model = model if model is not None else source.build(plan, group)
        self.trainer = Trainer(self.model, source.cfg, plan, group, optim)
        self._twin: Trainer | None = None
        self.calibration = list(calibration)

    @property
    def steps_done(self) -> int:
        return self.trainer.steps_done

    def step(self, micro: Sequence[Batch]) -> StepResult:
        loss, norm = self.trainer.step(micro)
        return StepResult(loss, norm, self.trainer.lr, label_count(micro))

    def evaluate(self, spec: EvalSpec) -> EvalResult | None:
        return evaluate(self.model, spec)

    def save(self, path: Path, extra: dict[str, Any]) -> None:
        save_checkpoint(
            path,
            model=self.model,
            optimizer=self.trainer.optimizer,
            step=self.steps_done,
            cfg=self.source.cfg,
            plan=self.plan,
            group=self.group,
            extra=extra,
        )

    def load(self, path: str) -> dict[str, Any]:
        loaded = load_checkpoint(
            path,
            model=self.model,
            optimizer=self.trainer.optimizer,
            cfg=self.source.cfg,
            plan=self.plan,
            group=self.group,
        )
        self.trainer.steps_done = loaded.step
        return loaded.extra

    def gather_state(self) -> dict[str, torch.Tensor]:
        return gather_state(self.model, self.source.cfg, self.plan, self.group)

    def isolated_compute(self, micro: Sequence[Batch]) -> list[Span]:
        """The same step's compute with no communication in flight: a twin of this shard
        built on the :meth:`~xronos.comm.mappings.TPGroup.silent` group (same shapes, same
        work, collectives recorded but not performed) takes one training step, timed like
        the real ones. This session's parameters and optimizer are not touched."""
        if self._twin is None:
            silent = self.group.silent()
            twin = self.source.build(self.plan, silent)
            self._twin = Trainer(twin, self.source.cfg, self.plan, silent, self.optim)
            for _ in range(SLOW_FIRST_STEPS):  # a fresh shard's first steps run slow
                self._twin.step(micro)
        rec = SpanRecorder(self.group.rank, enabled=True)
        rec.start_step(-1)
        with use_recorder(rec):
            self._twin.step(micro)
        record = rec.end_step()
        if record is None:
            return []
        gaps = compute_gaps(record)
        if self.group.lanes:  # compared with an overlapped step's compute in all
            return [_overlapped_compute(record.start, sum(g.duration for g in gaps))]
        return gaps

    def describe(self) -> dict[str, Any]:
        """The plan, and the calibration rounds that made it where there were any."""
        if not self.calibration:
            return self.plan.to_dict()
        return {**self.plan.to_dict(), "calibration": self.calibration}

    def release(self) -> None:
        """Free this shard's weights, gradients and optimizer state (a move, once its
        checkpoint holds them); the session cannot step again."""
        self._twin = None
        self.trainer.optimizer.state.clear()
        for p in self.model.parameters():
            p.grad = None
            p.data = torch.empty(0, dtype=p.dtype)

    def close(self) -> None:
        self._twin = None
