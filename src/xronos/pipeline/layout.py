"""Which ranks run each pipeline stage: one rank, or several that run the stage as tensor
parallelism (a hybrid, :mod:`xronos.planner.hybrid`).

A stage of several ranks holds its layers (and embedding or head) sharded by one
tensor-parallel plan, its members in ascending rank order (a process group's order).
Its input reaches every member; its output and its input's gradient are the same on every
member after the stage's all-reduces, so the first member (the *leader*) alone sends
them on::

    stage 0 (rank 2) ──act──► stage 1 (ranks 0, 1: TP) ──act──► …
                     ◄─grad── leader 0 sends              (to every member of a TP stage)

Messages to a member ``k`` of a stage of several ranks name it ``{stage}.{k}``
(``act/mb3/0->1.1``), so every message name is unique within a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xronos.config import ModelConfig
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.plan import Plan


@dataclass(frozen=True)
class StageLayout:
    """The ranks of each stage (group ranks, stage order) and the plan of a TP stage."""

    groups: tuple[tuple[int, ...], ...]
    tp: Plan | None = None
    """The tensor-parallel plan of the stage of several ranks (its members' order)."""

    @classmethod
    def of(
        cls,
        size: int,
        stage_ranks: Sequence[int] | None = None,
        stage_groups: Sequence[Sequence[int]] | None = None,
        tp: Plan | None = None,
    ) -> StageLayout:
        """The layout of a group of ``size`` ranks: ``stage_groups`` when given, else one
        rank per stage (``stage_ranks``, default stage ``j`` on rank ``j``).

        Raises:
            ValueError: the stages do not cover each rank once, a stage of several ranks
                lists them out of order, or its plan is missing or for another size.
        """
        if stage_groups is None:
            order = list(stage_ranks) if stage_ranks is not None else list(range(size))
            if sorted(order) != list(range(size)):
                raise ValueError(f"stage ranks {order} are not a permutation of the group's ranks")
            return cls(tuple((r,) for r in order))
        groups = tuple(tuple(g) for g in stage_groups)
        if sorted(r for g in groups for r in g) != list(range(size)) or not all(groups):
            raise ValueError(f"stage groups {groups} do not cover each of {size} ranks once")
        wide = [g for g in groups if len(g) > 1]
        if len(wide) > 1:
            raise ValueError(f"stage groups {groups}: one stage of several ranks at most")
        for g in wide:
            if list(g) != sorted(g):
                raise ValueError(f"stage group {g}: list its ranks in ascending order")
            if tp is None or tp.world_size != len(g):
                raise ValueError(f"stage group {g} needs a tensor-parallel plan of {len(g)} ranks")
        return cls(groups, tp if wide else None)

    @property
    def plain(self) -> bool:
        """One rank per stage (no tensor parallelism)."""
        return all(len(g) == 1 for g in self.groups)

    def stage_of(self, rank: int) -> int:
        return next(j for j, g in enumerate(self.groups) if rank in g)

    def member(self, rank: int) -> int:
        """``rank``'s index within its stage (0: the stage's leader)."""
        return self.groups[self.stage_of(rank)].index(rank)

    def plan(self, cfg: ModelConfig, stage: int) -> Plan:
        """The plan ``stage``'s shards are built under."""
        if len(self.groups[stage]) == 1:
            return Plan.single(cfg)
        assert self.tp is not None
        return self.tp

    def end(self, stage: int, k: int) -> str:
        """How messages name member ``k`` of ``stage`` as their destination."""
        return str(stage) if len(self.groups[stage]) == 1 else f"{stage}.{k}"

    def vocab_rows(self, cfg: ModelConfig, stage: int) -> list[tuple[int, int]]:
        """Per member of ``stage``, the rows of a tied embedding matrix it holds."""
        plan = self.plan(cfg, stage)
        return [plan.bounds("vocab", k, cfg.vocab_size) for k in range(plan.world_size)]

    def names(self, pplan: PipelinePlan) -> list[str]:
        """The device name of each group rank."""
        out = [""] * sum(len(g) for g in self.groups)
        for j, g in enumerate(self.groups):
            for k, r in enumerate(g):
                out[r] = pplan.devices[j] if len(g) == 1 or self.tp is None else self.tp.devices[k]
        return out

    def max_events(self, cfg: ModelConfig, m: int) -> int:
        """The most spans one step records on any rank: per micro-batch 2 computes and 4
        messages (one more per extra member of a neighbouring stage), the tied rows and
        the norm; on a TP stage also its all-reduces: 2 per layer each way, the
        embedding's, the head's and the cross-entropy's, the partial gradients'."""
        widest = max(len(g) for g in self.groups)
        events = (4 + 2 * widest) * m + 8 + 2 * len(self.groups[0]) * len(self.groups[-1])
        if not self.plain:
            events += m * (4 * cfg.num_layers + 12) + 4
        return events
