"""Whether a running pipeline's plan is still the one to run once its devices' speeds moved.

A pipeline's units are whole layers on stages whose order, memory and micro-batches come
from a search (:mod:`xronos.planner.pipesearch`), so it is not moved live as a tensor-
parallel split is; it starts again, planned anew (:mod:`xronos.run.restage`). Whether that
pays is the planner's to say, from the profiles the run was planned with, each device's
compute scaled by how much slower (or faster) it now runs (:meth:`Replanner.forecast`):

    profiles ─► slowed by the observed factors ─► plan_auto ─► the best candidate
                                              └─► the running plan priced ─► now

The running plan is priced as the search priced it (:func:`~xronos.planner.pipesearch.
priced`); the best candidate is ``auto``'s pick at the new speeds — among every strategy
for an ``auto`` run, among pipelines for a pipeline run. Both come from the same model, so
their ratio holds where the model's absolute level is off. What each device is predicted
to compute under the running plan (:meth:`Replanner.compute_s`) gives the factors of a plan
that was out of balance from its first step: measured over predicted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xronos.config import ModelConfig
from xronos.planner.auto import plan_auto, stage_messages
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.pipesearch import device_stages, priced, stage_compute_s
from xronos.planner.profile import DeviceProfile, slowed


@dataclass(frozen=True)
class Forecast:
    """The running plan and the best one, both predicted at the devices' new speeds."""

    now_s: float
    """The running plan's predicted step."""
    best_s: float
    """The best candidate's predicted step (``now_s`` where none is feasible)."""
    best: str
    """The best candidate, as ``auto``'s table names it (``pp-1f1b [slow -> fast]``)."""

    @property
    def gain(self) -> float:
        """The fraction of the step the best plan would save (0 when it saves nothing)."""
        return max(0.0, 1.0 - self.best_s / self.now_s) if self.now_s > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class Replanner:
    """The planner's view of one running pipeline.

    ``profiles``: the run's devices' profiles (rank order), as it was planned with them
    (priced for its wire dtype); ``running``: the pipeline that runs (its devices named as
    in ``profiles``); the profiled shape and the step as for
    :func:`~xronos.planner.auto.plan_auto`; ``only``: the candidates' strategy to choose
    among (None: every strategy)."""

    cfg: ModelConfig
    profiles: Sequence[DeviceProfile]
    running: PipelinePlan
    batch_size: int
    seq_len: int
    grad_accum: int
    mlp_chunk: int
    vocab_chunk: int
    only: str | None = None

    @property
    def _chunks(self) -> dict[str, int]:
        return {"mlp_chunk": self.mlp_chunk, "vocab_chunk": self.vocab_chunk}

    def compute_s(self) -> dict[str, float]:
        """Per device of the running plan: its predicted forward and backward seconds a
        step at the profiled speeds (what its records' compute spans hold)."""
        return stage_compute_s(
            self.running,
            device_stages(self.profiles, self.cfg, **self._chunks),
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
        )

    def forecast(self, factors: Mapping[str, float]) -> Forecast:
        """The running plan and the best candidate with each device's compute ``factors``
        times what it was when profiled (a device not named keeps its speed)."""
        scaled = [slowed(p, factors.get(p.name, 1.0)) for p in self.profiles]
        choice = plan_auto(
            self.cfg,
            scaled,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            grad_accum=self.grad_accum,
            mlp_chunk=self.mlp_chunk,
            vocab_chunk=self.vocab_chunk,
        )
        tokens = self.batch_size * self.seq_len
        act_bytes, tied_bytes = stage_messages(self.cfg, scaled, tokens, self.grad_accum)
        now = priced(
            self.running,
            device_stages(scaled, self.cfg, **self._chunks),
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            act_bytes=act_bytes,
            tied_bytes=tied_bytes,
        )
        eligible = [
            c
            for c in choice.candidates
            if c.feasible and (self.only is None or c.strategy == self.only)
        ]
        if not eligible:
            return Forecast(now, now, "the running plan")
        best = min(eligible, key=lambda c: c.predicted_step_s)
        return Forecast(now, best.predicted_step_s, choice.label(best))
