"""Pipeline sessions (``pp-gpipe``, ``pp-1f1b``, and ``hybrid``: one stage run as tensor
parallelism by several devices): a :class:`PipelineRunner` behind the loop's
:class:`~xronos.train.session.Session` seam.

Evaluation uses the whole model gathered on one stage, so a pipeline run evaluates
exactly like a tensor-parallel one. Each stage writes its own part of a checkpoint,
optimizer state included (:mod:`xronos.pipeline.checkpoint`): a pipeline run resumes, on
any strategy, and exports like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xronos.comm.mappings import TPGroup
from xronos.metrics.records import Span
from xronos.model.llama import LlamaForCausalLM
from xronos.pipeline.checkpoint import load_stages, save_stages
from xronos.pipeline.runner import PipelineRunner
from xronos.planner.hybrid import HybridPlan
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.plan import Plan
from xronos.train.batches import Batch, label_count
from xronos.train.generate import evaluate
from xronos.train.optim import OptimConfig
from xronos.train.session import EvalResult, EvalSpec, StepResult, Strategy
from xronos.train.source import ModelSource


@dataclass(frozen=True)
class HybridStages:
    """A hybrid's plan and, per stage, the ranks of the session's group that run it."""

    plan: HybridPlan
    groups: tuple[tuple[int, ...], ...]


class PipelineSession:
    """This rank's pipeline stage under ``pplan``."""

    def __init__(
        self,
        source: ModelSource,
        pplan: PipelinePlan,
        group: TPGroup,
        optim: OptimConfig,
        strategy: Strategy,
        timeout_s: float = 120.0,
        stage_ranks: Sequence[int] | None = None,
        anchored: bool = False,
        hybrid: HybridStages | None = None,
    ) -> None:
        """``stage_ranks``: which rank of ``group`` runs each stage (default: in order);
        ``anchored``: the stage on the group's rank 0 evaluates (it runs on the
        coordinator, which alone holds the run directory; the group's rank 0 writes every
        checkpoint in any case); ``hybrid``: the
        ranks of each stage, one stage tensor-parallel (``strategy`` ``hybrid``, run with
        the 1F1B schedule)."""
        if not strategy.is_pipeline:
            raise ValueError(f"{strategy} is not a pipeline strategy")
        if (strategy is Strategy.HYBRID) != (hybrid is not None):
            raise ValueError("a hybrid session needs its stage groups, and only it")
        self.source, self.pplan, self.group, self.strategy = source, pplan, group, strategy
        self.hybrid, self.anchored = hybrid, anchored
        self.runner = PipelineRunner(
            source,
            pplan,
            group,
            optim,
            strategy="pp-1f1b" if hybrid is not None else strategy.value,
            timeout_s=timeout_s,
            stage_ranks=stage_ranks,
            stage_groups=hybrid.groups if hybrid is not None else None,
            tp_plan=hybrid.plan.tp if hybrid is not None else None,
        )
        self.max_events = self.runner.layout.max_events(source.cfg, pplan.num_microbatches)

    @property
    def steps_done(self) -> int:
        return self.runner.steps_done

    def step(self, micro: Sequence[Batch]) -> StepResult:
        loss, norm = self.runner.step(micro)
        return StepResult(loss, norm, self.runner.lr, label_count(micro))

    def _whole(self) -> LlamaForCausalLM | None:
        """The full model with the trained weights, on the evaluating stage only
        (collective): the stage that holds the most layers — the planner gives those to
        the fastest device — so that evaluation does not wait on the slowest."""
        ranges = self.pplan.layer_ranges
        evaluator = max(range(len(ranges)), key=lambda j: (ranges[j][1] - ranges[j][0], j))
        if self.anchored:  # the coordinator alone writes: the stage on its rank
            evaluator = self.runner.layout.stage_of(0)
        # the others hold only their stage; the frozen base is the one built below
        state = self.runner.gather_state(to=evaluator, trained=True)
        if self.runner.stage != evaluator or not self.runner.leader:
            return None
        model = self.source.build(Plan.single(self.source.cfg), TPGroup())
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                if name in params:
                    params[name].copy_(value)
        return model

    def evaluate(self, spec: EvalSpec) -> EvalResult | None:
        model = self._whole()
        mine = evaluate(model, spec) if model is not None else None
        # one stage evaluated; every rank returns its result
        return next(r for r in self.group.gather_object(mine) if r is not None)

    def save(self, path: Path, extra: dict[str, Any]) -> None:
        save_stages(self.runner, path, self.describe(), extra)

    def load(self, path: str) -> dict[str, Any]:
        return load_stages(self.runner, path).extra

    def gather_state(self) -> dict[str, torch.Tensor]:
        return self.runner.gather_state()

    def isolated_compute(self, micro: Sequence[Batch]) -> list[Span]:
        return self.runner.isolated_compute(micro)

    def describe(self) -> dict[str, Any]:
        return self.hybrid.plan.to_dict() if self.hybrid is not None else self.pplan.to_dict()

    def close(self) -> None:
        self.runner.close()
