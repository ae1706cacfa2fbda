"""Pipeline-parallel (PP) training: the GPipe and 1F1B baselines Xronos is compared against.

Stage ``j`` runs on rank ``j`` of the world group and holds the decoder layers of
``PipelinePlan.layer_ranges[j]``; stage 0 also holds the embedding, the last stage the final
norm, the LM head and the loss (DESIGN §4)::

    ids ─► [embed, L0..L(a-1)] ─act─► [La..L(b-1)] ─act─► … ─► [.., norm, head, loss]
            stage 0            ◄grad─  stage 1      ◄grad─       stage n-1

One :meth:`PipelineRunner.step` = the step's batches cut into ``num_microbatches``
micro-batches (:func:`~xronos.pipeline.schedule.split_microbatches`), the stage's schedule
(GPipe or 1F1B, :mod:`xronos.pipeline.schedule`) with non-blocking ``isend``/``irecv`` of
activations and their gradients, then one all-reduce of ``[Σ grad², loss]`` across stages
for global-norm clipping and the loss, then AdamW on the stage's parameters.

**Exactness.** Loss = Σ cross-entropy / global label count of the whole step, as in
:class:`~xronos.train.trainer.Trainer`: the last stage divides each micro-batch's summed
CE by the step's label count (every rank has the data, so no communication is needed).
Tied embeddings: the last stage keeps its own copy of the embedding matrix as its LM head
weight; after the schedule stages 0 and n-1 swap their gradients of it (``tied/...``
messages) and both use ``g_embed + g_head``, so both copies take bit-identical AdamW
updates; the norm counts the matrix once. LoRA dropout generators are saved at each step's
start so :meth:`PipelineRunner.isolated_compute` replays the same masks and leaves the
generators where the step left them.

**Why not** ``torch.distributed.pipelining``: its schedules post each receive just before
waiting on it (no overlap of arrival with compute) and wait inside the library, with no
hook to time each message's arrival per the ``recv:<msg>`` convention the idle analysis
needs (DESIGN §6), nor a way to replay a stage's compute without communication for the
computation-stall measurement. The schedules here are ~30 lines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from xronos.comm.groups import new_group
from xronos.comm.mappings import TPGroup
from xronos.errors import UserError
from xronos.metrics.recorder import SpanRecorder, current_recorder
from xronos.metrics.records import Span
from xronos.model.llama import LlamaForCausalLM
from xronos.model.lora import LoRALinear, add_lora
from xronos.parallel.shard import build_model, stage_holds
from xronos.pipeline.schedule import (
    P2P,
    STRATEGIES,
    TIED_TAG,
    act_tag,
    grad_tag,
    schedule,
    split_microbatches,
)
from xronos.planner.pipeline import PipelinePlan
from xronos.planner.plan import Plan
from xronos.train.batches import Batch, label_count
from xronos.train.optim import OptimConfig, adamw, update
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
    ) -> None:
        cfg = source.cfg
        if strategy not in STRATEGIES:
            raise UserError(f"unknown pipeline strategy {strategy!r}; use {', '.join(STRATEGIES)}")
        if pplan.num_stages != group.size:
            raise UserError(
                f"pipeline plan has {pplan.num_stages} stages but {group.size} devices run; "
                "plan the pipeline for this cluster"
            )
        if pplan.num_layers != cfg.num_layers:
            raise UserError(
                f"pipeline plan covers {pplan.num_layers} layers but the model has "
                f"{cfg.num_layers}; plan the pipeline for this model"
            )
        self.cfg, self.pplan, self.group, self.opt_cfg = cfg, pplan, group, opt
        self.source, self.timeout_s = source, timeout_s
        order = list(stage_ranks) if stage_ranks is not None else list(range(group.size))
        if sorted(order) != list(range(group.size)):
            raise ValueError(f"stage ranks {order} are not a permutation of the group's ranks")
        self.stage, self.num_stages = order.index(group.rank), group.size
        # stage -> global rank (torch's point-to-point calls and broadcast take global ranks)
        self.ranks = [
            dist.get_global_rank(group.pg, r) if group.pg is not None else r for r in order
        ]
        self.first, self.last = self.stage == 0, self.stage == self.num_stages - 1
        self.layer_range = pplan.layer_ranges[self.stage]
        self.model = build_model(
            cfg,
            Plan.single(cfg),
            TPGroup(),
            model_dir=source.model_dir,
            seed=source.seed,
            lora=source.lora,
            layers=self.layer_range,
            embed=self.first,
            head=self.last,
        )
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        # Stages 0 and n-1 both hold a tied embedding matrix; they swap its gradient.
        self.tied = (
            self.model.model.embed_tokens.weight
            if cfg.tie_word_embeddings
            and self.num_stages > 1
            and (self.first or self.last)
            and self.model.model.embed_tokens.weight.requires_grad
            else None
        )
        # The tied matrix counts once in the global norm: on stage 0.
        self.norm_weight = [0.0 if p is self.tied and not self.first else 1.0 for p in self.params]
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
            pg = new_group(sorted(self.ranks), timeout_s)
            self._p2p_group = group.on(pg)
        self._lora = [m for m in self.model.modules() if isinstance(m, LoRALinear)]
        self._step_rng: list[torch.Tensor] = []
        # Per micro-batch of the last step: (received activations, received gradient).
        self._inputs: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None

    # -- one training step -----------------------------------------------------------------
    def step(self, micro_batches: Sequence[Batch]) -> tuple[float, float]:
        """Forward, backward and update over the step's batches; returns (loss, grad norm),
        the same on every stage."""
        self.model.train()
        mbs = split_microbatches(micro_batches, self.pplan.num_microbatches)
        denom = float(max(label_count(mbs), 1))
        self._step_rng = [m.dropout_gen.get_state() for m in self._lora]
        p2p = P2P(self._p2p_group, self.pplan.devices, self.timeout_s, self.ranks)
        try:
            loss_sum = self._run_schedule(mbs, denom, p2p)
            self._sync_tied(p2p)
            p2p.drain()
        except BaseException:
            p2p.abandon()
            raise
        return self._update(loss_sum, denom)

    def _run_schedule(self, mbs: list[Batch], denom: float, p2p: P2P) -> float:
        j, rec = self.stage, current_recorder()
        self._post_recvs(mbs, p2p)
        inputs: list[list[torch.Tensor | None]] = [[None, None] for _ in mbs]
        live: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        total = 0.0
        for kind, i in self.actions:
            ids, labels = mbs[i]
            if kind == "F":
                x = None if self.first else p2p.wait_recv(f"act/mb{i}/{j - 1}->{j}")
                inputs[i][0] = x
                live[i] = self._forward(i, ids, labels, x, rec)
                out = live[i][1]
                if self.last:
                    total += float(out.detach())
                else:
                    p2p.send(
                        f"act/mb{i}/{j}->{j + 1}", j + 1, out.detach().to(ACT_DTYPE), act_tag(i)
                    )
            else:
                g = None if self.last else p2p.wait_recv(f"grad/mb{i}/{j + 1}->{j}")
                inputs[i][1] = g
                x_in, out = live.pop(i)
                self._backward(i, out, g, denom, rec)
                if x_in is not None:
                    dx = x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)
                    p2p.send(f"grad/mb{i}/{j}->{j - 1}", j - 1, dx.to(ACT_DTYPE), grad_tag(i))
        self._inputs = [(x, g) for x, g in inputs]
        return total

    def _post_recvs(self, mbs: list[Batch], p2p: P2P) -> None:
        """Post every receive of the step up front, so data lands while the stage computes."""
        j, h = self.stage, self.cfg.hidden_size
        for i, (ids, _) in enumerate(mbs):
            shape = (*ids.shape, h)  # (B_i, S, H)
            if not self.first:
                buf = torch.empty(shape, dtype=ACT_DTYPE)
                p2p.post_recv(f"act/mb{i}/{j - 1}->{j}", j - 1, buf, act_tag(i))
            if not self.last:
                buf = torch.empty(shape, dtype=ACT_DTYPE)
                p2p.post_recv(f"grad/mb{i}/{j + 1}->{j}", j + 1, buf, grad_tag(i))

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
        x_in = x.detach().requires_grad_() if x is not None else None
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

    def _sync_tied(self, p2p: P2P) -> None:
        """Stages 0 and n-1 swap their gradients of the tied matrix; both keep the sum."""
        if self.tied is None:
            return
        mine = self.tied.grad if self.tied.grad is not None else torch.zeros_like(self.tied)
        peer = self.num_stages - 1 if self.first else 0
        a, b = self.stage, peer
        theirs = torch.empty_like(mine)
        p2p.post_recv(f"tied/{b}->{a}", peer, theirs, TIED_TAG)
        p2p.send(f"tied/{a}->{b}", peer, mine, TIED_TAG)
        theirs = p2p.wait_recv(f"tied/{b}->{a}")
        # The same sum in the same order on both stages: bit-identical gradients.
        self.tied.grad = mine + theirs if self.first else theirs + mine

    def _update(self, loss_sum: float, denom: float) -> tuple[float, float]:
        """All-reduce [Σ grad², loss] across stages, clip by the global norm, AdamW."""
        vec = torch.zeros(2, dtype=torch.float64)
        grads = [
            p.grad.detach()
            for p, w in zip(self.params, self.norm_weight, strict=True)
            if p.grad is not None and w
        ]
        if grads:  # per-tensor norms in fp32, their squares summed in fp64 (as the TP step)
            vec[0] = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        vec[1] = loss_sum  # only the last stage has a loss; the others add 0
        self.group.all_reduce(vec, "grads.norm")
        norm = float(vec[0].sqrt())
        self.lr = update(self.optimizer, self.params, self.opt_cfg, norm, self.steps_done)
        self.steps_done += 1
        return float(vec[1]) / denom, norm

    # -- computation stall (DESIGN §6) ------------------------------------------------------
    def isolated_compute(self, micro_batches: Sequence[Batch]) -> list[Span]:
        """Re-run this stage's forwards and backwards of the last step with no communication
        in flight; returns compute spans named like the step's (``fwd:mb{i}``, ``bwd:mb{i}``).

        Call between steps, on every stage at once, with the batches of the last
        :meth:`step`: barriers before and after keep other stages' traffic out. The inputs
        are the activations and gradients the stage received in that step; the parameters
        are those after its update, which changes the values, not the work. Gradients are
        discarded, optimizer state and dropout generators are left as they were.
        """
        mbs = split_microbatches(micro_batches, self.pplan.num_microbatches)
        if self._inputs is None or len(self._inputs) != len(mbs):
            raise RuntimeError("isolated_compute needs the batches of a completed step()")
        denom = float(max(label_count(mbs), 1))
        rec = SpanRecorder(self.stage, self.pplan.devices[self.stage])
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
        """This stage's parameters by Hugging Face name (a stage-local checkpoint)."""
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def gather_state(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters on every rank, by Hugging Face name (the full model).

        Names and shapes come from the config (a ``meta`` model), so each stage broadcasts
        one flat fp32 vector and nothing is pickled.
        """
        if self.group.size == 1:
            return {n: t.clone() for n, t in self.state_dict().items()}
        with torch.device("meta"):
            full = LlamaForCausalLM(self.cfg)
            if self.source.lora is not None:
                add_lora(full, self.source.lora, seed=self.source.seed)
        shapes = {n: p.shape for n, p in full.named_parameters()}
        out: dict[str, torch.Tensor] = {}
        mine = self.state_dict()
        for s, rng in enumerate(self.pplan.layer_ranges):
            first, last = s == 0, s == self.num_stages - 1
            names = [
                n for n in shapes if n not in out and stage_holds(n, self.cfg, rng, first, last)
            ]
            numel = sum(shapes[n].numel() for n in names)
            if s == self.stage:
                flat = torch.cat([mine[n].reshape(-1).float() for n in names])
            else:
                flat = torch.empty(numel, dtype=torch.float32)
            dist.broadcast(flat, src=self.ranks[s], group=self.group.pg)
            for n, part in zip(names, flat.split([shapes[n].numel() for n in names]), strict=True):
                out[n] = part.view(shapes[n]).clone()
        return out
