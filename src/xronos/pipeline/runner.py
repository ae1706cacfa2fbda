"""Pipeline-parallel (PP) training: the GPipe and 1F1B baselines Xronos is compared against,
and the hybrid whose one stage is tensor-parallel.

Stage ``j`` runs on rank ``j`` of the world group and holds the decoder layers of
``PipelinePlan.layer_ranges[j]``; stage 0 also holds the embedding, the last stage the final
norm, the LM head and the loss (docs/architecture.md, Pipeline baselines)::

    ids ─► [embed, L0..L(a-1)] ─act─► [La..L(b-1)] ─act─► … ─► [.., norm, head, loss]
            stage 0            ◄grad─  stage 1      ◄grad─       stage n-1

One :meth:`PipelineRunner.step` = the step's batches cut into ``num_microbatches``
micro-batches (:func:`~xronos.pipeline.schedule.split_microbatches`), the stage's schedule
(GPipe or 1F1B, :mod:`xronos.pipeline.schedule`) with non-blocking ``isend``/``irecv`` of
activations and their gradients (in the group's payload dtype, ``--comm-dtype``), then one
all-reduce of ``[Σ grad², loss]`` across stages for global-norm clipping and the loss, then
AdamW on the stage's parameters.

**A hybrid** (``stage_groups``, :mod:`xronos.pipeline.layout`): one stage runs on several
ranks as heterogeneous TP under ``tp_plan`` — its layers (and embedding or head) sharded,
its seams all-reduced within the stage, its partial gradients summed there
(:class:`~xronos.train.shardgrads.ShardGrads`) before the norm. Every member receives the
stage's input; the leader alone sends its output and its input's gradient on, and alone
adds the loss.

**Exactness.** Loss = Σ cross-entropy / global label count of the whole step, as in
:class:`~xronos.train.trainer.Trainer`: the last stage divides each micro-batch's summed
CE by the step's label count (every rank has the data, so no communication is needed).
Tied embeddings: the last stage owns the matrix (its LM head) and updates it; the first
stage reads the rows of each step's tokens from it and sends back their gradient
(:mod:`xronos.pipeline.tied`), so the matrix counts once in the norm. LoRA dropout
generators are saved at each step's start so :meth:`PipelineRunner.isolated_compute`
replays the same masks and leaves the generators where the step left them.

**Why not** ``torch.distributed.pipelining``: its schedules post each receive just before
waiting on it (no overlap of arrival with compute) and wait inside the library, with no
hook to time each message's arrival per the ``recv:<msg>`` convention the idle analysis
needs (docs/architecture.md, Measurement), nor a way to replay a stage's compute without
communication for the computation-stall measurement. The schedules here are ~30 lines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from xronos.comm.groups import new_group
from xronos.comm.mappings import TPGroup
from xronos.errors import UserError
from xronos.metrics.recorder import SpanRecorder, current_recorder
from xronos.metrics.records import Span
from xronos.model.lora import LoRALinear
from xronos.parallel.gather import gather_state
from xronos.parallel.shard import build_model
from xronos.pipeline.gather import gather_stages
from xronos.pipeline.layout import StageLayout
from xronos.pipeline.schedule import P2P, act_tag, grad_tag, split_microbatches
from xronos.pipeline.tied import TiedRows
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.plan import Plan
from xronos.planner.schedules import STRATEGIES, schedule
from xronos.train.batches import Batch, label_count
from xronos.train.optim import OptimConfig, adamw, update
from xronos.train.shardgrads import ShardGrads
from xronos.train.source import ModelSource

ACT_DTYPE = torch.float32  # the residual stream's dtype (stages are built in fp32)


class PipelineRunner:
    """One pipeline stage: its part of the model, its schedule and its optimizer.

    Args:
        source: where the weights come from (preset or checkpoint; LoRA or full).
        pplan: layer ranges per stage.
        group: the pipeline's group (size = number of stages; size 1 = the whole model).
        stage_ranks: which rank of ``group`` runs each stage (default: stage ``j`` on
            rank ``j``); a searched device order puts e.g. the LM head on the fastest.
        opt: AdamW and clipping settings.
        strategy: ``pp-gpipe`` or ``pp-1f1b``.
        timeout_s: bound on every point-to-point wait.

    Between steps the stage keeps the last step's received activations and gradients
    (``m·B·S·H`` floats each way) for :meth:`isolated_compute`.
    """

    def __init__(
        self,
        source: ModelSource,
        pplan: PipelinePlan,
        group: TPGroup,
        opt: OptimConfig,
        *,
        strategy: str = "pp-1f1b",
        timeout_s: float = 120.0,
        stage_ranks: Sequence[int] | None = None,
        stage_groups: Sequence[Sequence[int]] | None = None,
        tp_plan: Plan | None = None,
    ) -> None:
        cfg = source.cfg
        if strategy not in STRATEGIES:
            raise UserError(f"unknown pipeline strategy {strategy!r}; use {', '.join(STRATEGIES)}")
        layout = StageLayout.of(group.size, stage_ranks, stage_groups, tp_plan)
        if pplan.num_stages != len(layout.groups):
            running = f"{group.size} devices" if layout.plain else f"{len(layout.groups)} stages"
            raise UserError(
                f"pipeline plan has {pplan.num_stages} stages but {running} run; "
                "plan the pipeline for this cluster"
            )
        if pplan.num_layers != cfg.num_layers:
            raise UserError(
                f"pipeline plan covers {pplan.num_layers} layers but the model has "
                f"{cfg.num_layers}; plan the pipeline for this model"
            )
        self.cfg, self.pplan, self.group, self.opt_cfg = cfg, pplan, group, opt
        self.source, self.timeout_s, self.layout = source, timeout_s, layout
        # activations and their gradients cross stages in ``--comm-dtype``; tied rows in fp32
        self.wire = group.payload or ACT_DTYPE
        self.stage, self.num_stages = layout.stage_of(group.rank), len(layout.groups)
        self.member = layout.member(group.rank)  # within the stage; 0: its leader
        self.leader = self.member == 0
        self.names = layout.names(pplan)  # device name per group rank
        # group rank -> global rank (torch's point-to-point calls and broadcast take these)
        self.globals = [
            dist.get_global_rank(group.pg, r) if group.pg is not None else r
            for r in range(group.size)
        ]
        self.ranks = [self.globals[g[0]] for g in layout.groups]  # each stage's leader
        self.first, self.last = self.stage == 0, self.stage == self.num_stages - 1
        self.layer_range = pplan.layer_ranges[self.stage]
        self.tp_group = self._tp_group(layout.groups[self.stage])
        self.stage_plan = layout.plan(cfg, self.stage)
        self.model = build_model(
            cfg,
            self.stage_plan,
            self.tp_group,
            model_dir=source.model_dir,
            seed=source.seed,
            lora=source.lora,
            layers=self.layer_range,
            embed=self.first,
            head=self.last,
            recompute=source.recompute,
        )
        # A tied matrix that trains: the last stage owns it (:mod:`xronos.pipeline.tied`).
        self.tied = TiedRows.of(self.model, layout, cfg, group.rank)
        reader = self.tied.weight if self.tied is not None and self.first else None
        named = [
            (n, p) for n, p in self.model.named_parameters() if p.requires_grad and p is not reader
        ]
        self.params = [p for _, p in named]
        self.grads = ShardGrads(named, cfg, self.stage_plan, self.tp_group)
        self.norm_weight = self.grads.norm_weight
        self.optimizer = adamw(self.params, opt)
        self.lr = opt.lr
        self.actions = schedule(strategy, self.stage, self.num_stages, pplan.num_microbatches)
        self.strategy = strategy
        self.steps_done = 0
        # Point-to-point traffic gets its own group: stages exchange different numbers of
        # messages, and gloo counts them in the group's sequence number, which the
        # collectives' consistency check (TORCH_DISTRIBUTED_DEBUG=DETAIL) compares.
        self._p2p_group = group
        if group.size > 1:
            pg = new_group(sorted(self.globals), timeout_s)
            self._p2p_group = group.on(pg)
        self._lora = [m for m in self.model.modules() if isinstance(m, LoRALinear)]
        self._step_rng: list[torch.Tensor] = []
        # Per micro-batch of the last step: (received activations, received gradient).
        self._inputs: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None

    def _tp_group(self, members: Sequence[int]) -> TPGroup:
        """The tensor-parallel group of this rank's stage (made by its members alone)."""
        if len(members) == 1:
            return TPGroup()
        pg = new_group([self.globals[r] for r in members], self.timeout_s, local=True)
        k = members.index(self.group.rank)
        return replace(self.group, rank=k, size=len(members), pg=pg, lanes=())

    # -- one training step -----------------------------------------------------------------
    def step(self, micro_batches: Sequence[Batch]) -> tuple[float, float]:
        """Forward, backward and update over the step's batches; returns (loss, grad norm),
        the same on every stage."""
        self.model.train()
        mbs = split_microbatches(micro_batches, self.pplan.num_microbatches)
        denom = float(max(label_count(mbs), 1))
        self._step_rng = [m.dropout_gen.get_state() for m in self._lora]
        p2p = P2P(self._p2p_group, self.names, self.timeout_s, self.globals)
        try:
            self._read_tied(mbs, p2p)
            loss_sum = self._run_schedule(mbs, denom, p2p)
            self._sync_tied(p2p)
            p2p.drain()
        except BaseException:
            p2p.abandon()
            raise
        return self._update(loss_sum, denom)

    def _run_schedule(self, mbs: list[Batch], denom: float, p2p: P2P) -> float:
        j, rec, me = self.stage, current_recorder(), self.member
        self._post_recvs(mbs, p2p)
        inputs: list[list[torch.Tensor | None]] = [[None, None] for _ in mbs]
        live: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        total = 0.0
        for kind, i in self.actions:
            ids, labels = mbs[i]
            if kind == "F":
                x = None if self.first else p2p.wait_recv(self._msg("act", i, j - 1, j, me))
                inputs[i][0] = x
                live[i] = self._forward(i, ids, labels, x, rec)
                out = live[i][1]
                if self.last:
                    total += float(out.detach())
                elif self.leader:
                    self._send_on(p2p, "act", i, j + 1, out.detach().to(self.wire), act_tag(i))
            else:
                g = None if self.last else p2p.wait_recv(self._msg("grad", i, j + 1, j, me))
                inputs[i][1] = g
                x_in, out = live.pop(i)
                self._backward(i, out, g, denom, rec)
                if x_in is not None and self.leader:
                    dx = x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)
                    self._send_on(p2p, "grad", i, j - 1, dx.to(self.wire), grad_tag(i))
        self._inputs = [(x, g) for x, g in inputs]
        return total if self.leader else 0.0  # a TP stage's members share one loss

    def _msg(self, kind: str, i: int, src: int, dst: int, k: int) -> str:
        """The name of micro-batch ``i``'s ``kind`` message from ``src`` to member ``k`` of
        stage ``dst``."""
        return f"{kind}/mb{i}/{src}->{self.layout.end(dst, k)}"

    def _send_on(self, p2p: P2P, kind: str, i: int, dst: int, t: torch.Tensor, tag: int) -> None:
        """Send ``t`` to every member of stage ``dst`` (the leader's job)."""
        for k, r in enumerate(self.layout.groups[dst]):
            p2p.send(self._msg(kind, i, self.stage, dst, k), r, t, tag)

    def _post_recvs(self, mbs: list[Batch], p2p: P2P) -> None:
        """Post every receive of the step up front, so data lands while the stage computes."""
        j, h = self.stage, self.cfg.hidden_size
        me, groups = self.member, self.layout.groups
        for i, (ids, _) in enumerate(mbs):
            shape = (*ids.shape, h)  # (B_i, S, H)
            if not self.first:
                buf = torch.empty(shape, dtype=self.wire)
                p2p.post_recv(self._msg("act", i, j - 1, j, me), groups[j - 1][0], buf, act_tag(i))
            if not self.last:
                buf = torch.empty(shape, dtype=self.wire)
                p2p.post_recv(
                    self._msg("grad", i, j + 1, j, me), groups[j + 1][0], buf, grad_tag(i)
                )

    def _forward(
        self,
        i: int,
        ids: torch.Tensor,  # (B_i, S)
        labels: torch.Tensor,  # (B_i, S)
        x: torch.Tensor | None,  # (B_i, S, H) from the previous stage, None on stage 0
        rec: SpanRecorder,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(input leaf, output): activations (B_i, S, H), or the summed CE on the last stage."""
        if x is not None and tuple(x.shape[:2]) != tuple(ids.shape):
            raise ValueError(
                f"micro-batch {i}: activations {list(x.shape)} for ids {list(ids.shape)}"
            )
        x_in = x.detach().to(ACT_DTYPE).requires_grad_() if x is not None else None
        with rec.compute(f"fwd:mb{i}", kind="forward"), self._autocast():
            h = self.model.embed(ids) if x_in is None else x_in
            h = self.model.decode(h, range(*self.layer_range))
            if self.last:
                h = self.model.head_loss_sum(h, labels)
        return x_in, h

    def _backward(
        self, i: int, out: torch.Tensor, g: torch.Tensor | None, denom: float, rec: SpanRecorder
    ) -> None:
        with rec.compute(f"bwd:mb{i}", kind="backward"):
            if self.last:
                (out / denom).backward()
            elif out.requires_grad and g is not None:
                torch.autograd.backward(out, g.to(out.dtype))

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.opt_cfg.bf16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _read_tied(self, mbs: list[Batch], p2p: P2P) -> None:
        if self.tied is not None:
            ids = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in mbs]))
            self.tied.read(ids, p2p)

    def _sync_tied(self, p2p: P2P) -> None:
        if self.tied is not None:
            self.tied.sync(p2p)

    def _update(self, loss_sum: float, denom: float) -> tuple[float, float]:
        """All-reduce [Σ grad², loss] across stages, clip by the global norm, AdamW (a TP
        stage first completes its partial gradients among its members)."""
        self.grads.sync()
        vec = torch.zeros(2, dtype=torch.float64)
        grads = [
            self.grads.countable(p, p.grad.detach())
            for p, w in zip(self.params, self.norm_weight, strict=True)
            if p.grad is not None and w
        ]
        if grads:  # per-tensor norms in fp32, their squares summed in fp64 (as the TP step)
            vec[0] = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        vec[1] = loss_sum  # only the last stage's leader has a loss; the others add 0
        self.group.all_reduce(vec, "grads.norm")
        norm = float(vec[0].sqrt())
        self.lr = update(self.optimizer, self.params, self.opt_cfg, norm, self.steps_done)
        self.steps_done += 1
        return float(vec[1]) / denom, norm

    # -- computation stall (docs/architecture.md, Measurement) --------------------------
    def isolated_compute(self, micro_batches: Sequence[Batch]) -> list[Span]:
        """Re-run this stage's forwards and backwards of the last step with no communication
        in flight; returns compute spans named like the step's (``fwd:mb{i}``, ``bwd:mb{i}``).

        Call between steps, on every stage at once, with the batches of the last
        :meth:`step`: barriers before and after keep other stages' traffic out. The inputs
        are the activations and gradients the stage received in that step; the parameters
        are those after its update, which changes the values, not the work. Gradients are
        discarded, optimizer state and dropout generators are left as they were. A TP
        stage replays with its own all-reduces (part of its spans in the step too).
        """
        mbs = split_microbatches(micro_batches, self.pplan.num_microbatches)
        if self._inputs is None or len(self._inputs) != len(mbs):
            raise RuntimeError("isolated_compute needs the batches of a completed step()")
        denom = float(max(label_count(mbs), 1))
        rec = SpanRecorder(self.stage, self.names[self.group.rank])
        self._barrier()
        with self._replay_rng():
            rec.start_step(self.steps_done - 1)
            live: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
            for kind, i in self.actions:
                ids, labels = mbs[i]
                x, g = self._inputs[i]
                if kind == "F":
                    live[i] = self._forward(i, ids, labels, x, rec)
                else:
                    self._backward(i, live.pop(i)[1], g, denom, rec)
            record = rec.end_step()
        self._barrier()
        return list(record.computes) if record is not None else []

    @contextlib.contextmanager
    def _replay_rng(self) -> Iterator[None]:
        """Dropout generators at the last step's start inside; restored and grads dropped
        after."""
        now = [m.dropout_gen.get_state() for m in self._lora]
        for m, state in zip(self._lora, self._step_rng, strict=False):
            m.dropout_gen.set_state(state)
        try:
            yield
        finally:
            for m, state in zip(self._lora, now, strict=True):
                m.dropout_gen.set_state(state)
            for p in self.params:
                p.grad = None
            if self.tied is not None:
                self.tied.weight.grad = None

    def _barrier(self) -> None:
        if self.group.size > 1:
            dist.barrier(group=self.group.pg)  # bounded by the process group's timeout

    def close(self) -> None:
        """Release the point-to-point process group (every stage calls it, at the end)."""
        if self._p2p_group is not self.group and self._p2p_group.pg is not None:
            dist.destroy_process_group(self._p2p_group.pg)
            self._p2p_group = self.group

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters by Hugging Face name, whole (a TP stage's members
        gather their shards: collective over the stage)."""
        if self.tp_group.size > 1:
            return gather_state(self.model, self.cfg, self.stage_plan, self.tp_group)
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def gather_state(self, to: int | None = None, trained: bool = False) -> dict[str, torch.Tensor]:
        """Every stage's parameters by Hugging Face name (the full model): on every rank,
        or with ``to`` on that stage's leader alone (the others get an empty dict); with
        ``trained`` the trainable ones alone (:func:`~xronos.pipeline.gather.gather_stages`)."""
        mine = self.state_dict()
        if self.group.size == 1:
            return {n: t.clone() for n, t in mine.items()}
        return gather_stages(
            self.source,
            self.pplan.layer_ranges,
            mine if self.leader else None,
            self.stage,
            self.ranks,
            self.group if to is None else self._p2p_group,
            to,
            trained,
        )
