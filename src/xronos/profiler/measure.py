"""Measuring one device, inside its own limits, at the real batch and sequence shape.

For each segment the shard of ``u`` units is built at its local shape and timed through
forward + backward (+ its optimizer update) for a few ``u``; a least-squares line
``t(u) = a + b·u`` is fitted. An attention shard of ``u`` query heads computes the K/V of
every KV group they touch; its points are whole groups, so the line carries each head's
share of its group's K/V. One layer is timed and multiplied by ``num_layers``. The
replicated work (embedding, norms, residuals, replicated parameters' update) is timed the
same way. Every timing is the minimum of a few repetitions after a warm-up: the minimum is
the least disturbed by other processes and by the CPU quota's throttling phase.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.model.head import chunked_loss_sum, chunks, one_rank
from xronos.model.llama import MLP, Attention, RMSNorm
from xronos.model.lora import LoRAConfig, add_lora
from xronos.model.recompute import recomputed
from xronos.model.rope import RotaryEmbedding
from xronos.parallel.vocab import vocab_parallel_cross_entropy
from xronos.planner.plan import segment_units
from xronos.planner.profile import CostCurve
from xronos.profiler.line import line_of, plausible, unit_points
from xronos.train.optim import new_adamw


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What is profiled: the model, the batch, the training mode, the unit sizes."""

    cfg: ModelConfig
    batch_size: int
    seq_len: int
    mlp_chunk: int
    vocab_chunk: int
    lora: LoRAConfig | None = None
    recompute: bool = False
    """Activation checkpointing (:mod:`xronos.model.recompute`): the layers' segments are
    timed with their forward computed again in backward, and hold one layer's activations."""


def run_times(fn: Callable[[], None], repeats: int, warmup: int = 0) -> list[float]:
    """Wall times of ``repeats`` runs of ``fn`` after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_time(fn: Callable[[], None], repeats: int = 2, warmup: int = 0) -> float:
    """Minimum wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    return min(run_times(fn, repeats, warmup), default=float("inf"))


def _train_step_fn(
    module: nn.Module,
    make_input: Callable[[], torch.Tensor],
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    passes: int = 1,
) -> Callable[[], None]:
    """One training step: forward and backward of the input cut into ``passes`` parts
    along the batch (gradients accumulating, as in gradient accumulation or a pipeline's
    micro-batches), then the update."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = new_adamw(params, lr=1e-6) if params else None

    def run() -> None:
        for x in make_input().chunk(passes):
            loss_of(module_out(module, x)).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    return run


def module_out(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)  # type: ignore[no-any-return]


def _shard_cfg(cfg: ModelConfig, seg: str, units: int, shape: Shape) -> ModelConfig:
    if seg == "attn":  # the KV groups that ``units`` query heads from a group's start touch
        kv = -(-units // cfg.q_per_kv)
        return cfg.replace(num_kv_heads=kv, num_heads=kv * cfg.q_per_kv, head_dim=cfg.head_dim)
    return cfg.replace(intermediate_size=units * shape.mlp_chunk)


class _AttnWithRope(nn.Module):
    """An attention shard of ``heads`` query heads and the K/V heads of the groups they
    touch (``cfg``'s), as a rank holding that many query heads computes it."""

    def __init__(self, cfg: ModelConfig, heads: int, seq_len: int) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        d, h = cfg.head_dim, cfg.hidden_size
        self.attn.q_proj = nn.Linear(h, heads * d, bias=cfg.attention_bias)
        self.attn.o_proj = nn.Linear(heads * d, h, bias=False)
        self.cos_sin = RotaryEmbedding(cfg)(0, seq_len, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, self.cos_sin)  # type: ignore[no-any-return]


def _segment_module(seg: str, units: int, shape: Shape) -> nn.Module:
    cfg = _shard_cfg(shape.cfg, seg, units, shape)
    module: nn.Module = _AttnWithRope(cfg, units, shape.seq_len) if seg == "attn" else MLP(cfg)
    if shape.lora is not None:
        add_lora(module, shape.lora, seed=0)
        for name, p in module.named_parameters():
            p.requires_grad_(".lora_" in name)
    return _Recomputed(module) if shape.recompute else module


class _Recomputed(nn.Module):
    """A segment as a checkpointed block runs it: its forward again in backward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self.inner, self.inner)(x)


def _layer_step(seg: str, units: int, shape: Shape, passes: int = 1) -> Callable[[], None]:
    """One training step (forward+backward+update) of one layer's ``seg`` shard with
    ``units`` units (the batch cut into ``passes`` micro-batches)."""
    h = shape.cfg.hidden_size
    module = _segment_module(seg, units, shape)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(shape.batch_size, shape.seq_len, h, generator=gen)
    return _train_step_fn(
        module, lambda: x0.clone().requires_grad_(True), lambda y: y.sum(), passes
    )


def time_layer_segment(seg: str, units: int, shape: Shape, repeats: int, passes: int = 1) -> float:
    """Forward+backward+update seconds of one layer's ``seg`` shard with ``units`` units
    (the batch cut into ``passes`` micro-batches)."""
    return best_time(_layer_step(seg, units, shape, passes), repeats=repeats)


def best_times(fns: Sequence[Callable[[], None]], repeats: int, warmup: int = 0) -> list[float]:
    """Each of ``fns``' minimum wall time over ``repeats`` rounds that run them in turn,
    after ``warmup`` untimed rounds.

    The points of one line are timed interleaved, not one point's repeats back to back:
    a host that drifts over a second or two then moves every point alike instead of
    tilting the line. Timed back to back, three profiles of one host gave the full-speed
    device's attention line an intercept of 11-48 ms (four layers), where the work has
    next to none, and the slow device's MLP line 0-28 ms; interleaved, three more gave
    0-3 ms and 0-11 ms."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], best_time(fn, repeats=1))
    return best


def _vocab_step(units: int, shape: Shape, passes: int = 1) -> Callable[[], None]:
    """One training step of ``units`` vocabulary rows with the parallel CE (the batch cut
    into ``passes`` micro-batches)."""
    cfg = shape.cfg
    rows = min(units * shape.vocab_chunk, cfg.vocab_size)
    head = nn.Linear(cfg.hidden_size, rows, bias=False)
    head.weight.requires_grad_(shape.lora is None)
    n = shape.batch_size * (shape.seq_len - 1)
    gen = torch.Generator().manual_seed(0)
    h0 = torch.randn(n, cfg.hidden_size, generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (n,), generator=gen)

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        part = targets[: logits.shape[0]]  # every part's rows stand for as many targets
        return vocab_parallel_cross_entropy(logits.float(), part, 0, TPGroup())

    if shape.recompute and chunks(True, head, h0, n // passes):  # as a checkpointed model
        chunked = _ChunkedVocab(head, targets)
        return _train_step_fn(chunked, lambda: h0.clone().requires_grad_(True), _sum, passes)
    return _train_step_fn(head, lambda: h0.clone().requires_grad_(True), loss_of, passes)


class _ChunkedVocab(nn.Module):
    """Vocabulary rows whose loss a checkpointed model computes in chunks of tokens
    (:func:`~xronos.model.head.chunked_loss_sum`): the loss of its input hidden states."""

    def __init__(self, head: nn.Linear, targets: torch.Tensor) -> None:
        super().__init__()
        self.head, self.targets = head, targets

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        part = self.targets[: h.shape[0]]
        return chunked_loss_sum(h, self.head.weight, part, 0, one_rank)


def _sum(loss: torch.Tensor) -> torch.Tensor:
    return loss


class _Replicated(nn.Module):
    """What every device repeats: embedding, per layer two norms and two residual adds,
    the final norm."""

    def __init__(self, cfg: ModelConfig, vocab_rows: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_rows, cfg.hidden_size)
        self.norms = nn.ModuleList(
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for _ in range(2 * cfg.num_layers + 1)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if not x.requires_grad:  # frozen (LoRA): gradients still flow back through the norms
            x = x.detach().requires_grad_(True)
        for norm in self.norms:
            x = x + norm(x)
        return x


def time_replicated(shape: Shape, repeats: int) -> float:
    cfg = shape.cfg
    # Untied: every device holds the whole embedding; tied: it is vocab-parallel (small).
    rows = cfg.vocab_size if not cfg.tie_word_embeddings else shape.vocab_chunk
    module = _Replicated(cfg, rows)
    if shape.lora is not None:
        for p in module.parameters():
            p.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, rows, (shape.batch_size, shape.seq_len), generator=gen)
    return best_time(_train_step_fn(module, lambda: ids, lambda y: y.sum()), repeats=repeats)


def time_embedding(shape: Shape, repeats: int, passes: int = 1) -> float:
    """Forward+backward(+update) seconds of a tied model's whole embedding (all rows, as a
    pipeline's first stage holds it; its gradient is dense); 0 for an untied model, whose
    embedding :func:`time_replicated` already times whole."""
    cfg = shape.cfg
    if not cfg.tie_word_embeddings:
        return 0.0
    module = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (shape.batch_size, shape.seq_len), generator=gen)
    if shape.lora is not None:  # frozen: the rows are looked up, nothing flows back

        def lookup() -> None:
            with torch.no_grad():
                for part in ids.chunk(passes):
                    module(part)

        return best_time(lookup, repeats=repeats)
    step = _train_step_fn(module, lambda: ids, lambda y: y.sum(), passes)
    return best_time(step, repeats=repeats)


@dataclass(frozen=True)
class SegmentTimes:
    """What :func:`measure_segments` measures."""

    curves: dict[str, CostCurve]
    """Per segment: the cost of that many units per training step (all layers)."""
    replicated_s: float
    """Per-step seconds of the work every device repeats."""
    split_s: dict[str, float]
    """Per segment, all units, all layers: the seconds each micro-batch beyond the first
    adds when the step's batch is cut into several (a pipeline's micro-batches): each
    pass re-reads the weights and writes their gradients, however few its tokens."""
    scale: float = 1.0
    """The factor these times were scaled by to match a whole real step (1: as measured)."""
    embed_s: float = 0.0
    """A tied model's whole embedding (:func:`time_embedding`)."""
    embed_split_s: float = 0.0
    """What each micro-batch beyond the first adds to ``embed_s`` (see ``split_s``)."""
    memory_scale: float = 1.0
    """The factor on the activations' bytes that a whole real step measured
    (:func:`memory_scale`); 1: as counted."""


SPLIT_PASSES = 4
"""The batch is cut into this many micro-batches (at most one sequence each) to measure what
each one beyond the first adds (cut in two, that signal came out 0 in some profiles). The
cut is timed in the line's rounds (:func:`best_times`): timed after them, a drift once gave
the full-speed device's MLP no cost per pass, where it costs ~30 ms."""


def per_extra_pass(many: float, one: float, passes: int) -> float:
    """Seconds each micro-batch beyond the first adds, from a step cut into ``passes``
    (``many`` seconds) and the same step whole (``one``); never negative."""
    return max(many - one, 0.0) / (passes - 1) if passes > 1 else 0.0


RETIMES = 2
"""How many more times a line's rounds run when its points are implausible."""


def _line_and_cut(
    step_of: Callable[..., Callable[[], None]], units: list[int], m: int, repeats: int
) -> tuple[list[tuple[int, float]], float]:
    """The line's points ``(u, seconds)`` and, timed in the same rounds, the largest point's
    step with the batch cut into ``m`` passes (that point's own time where ``m`` is 1).

    Every step runs once untimed first: a segment's first steps run slower (on the slow
    device of ``ci-2dev``, the first of six rounds of a 4-head attention took 28-29 ms, the
    others 19-26). Points that do not rise as work does (:func:`~xronos.profiler.line.plausible`)
    are timed again, up to :data:`RETIMES` more times ``repeats`` rounds, each point keeping
    its minimum over all of them."""
    fns = [*(step_of(u) for u in units), *([step_of(units[-1], passes=m)] if m > 1 else [])]
    timed = best_times(fns, repeats, warmup=1)
    points = list(zip(units, timed, strict=False))  # the cut's time, last, is not a point
    for _ in range(RETIMES):
        if plausible(points):
            break
        timed = [min(t, again) for t, again in zip(timed, best_times(fns, repeats), strict=True)]
        points = list(zip(units, timed, strict=False))
    return points, timed[-1]


def measure_segments(shape: Shape, repeats: int = 2) -> SegmentTimes:
    """Fitted per-step cost curves of attn / mlp / vocab, the replicated seconds, and what
    each micro-batch beyond the first costs (the batch cut into up to :data:`SPLIT_PASSES`,
    at the larger unit point, scaled to all units; 0 for one sequence, which cannot be cut)."""
    totals = segment_units(shape.cfg, shape.mlp_chunk, shape.vocab_chunk)
    curves: dict[str, CostCurve] = {}
    split: dict[str, float] = {}
    layers = shape.cfg.num_layers
    m = min(SPLIT_PASSES, shape.batch_size)
    time_layer_segment("mlp", 1, shape, repeats=1)  # warm the allocator and the kernels
    for seg in ("attn", "mlp"):
        step = shape.cfg.q_per_kv if seg == "attn" else 1
        layer = functools.partial(_layer_step, seg, shape=shape)
        pts, cut = _line_and_cut(layer, unit_points(totals[seg], step), m, repeats)
        one = line_of(pts)
        curves[seg] = CostCurve(one.a * layers, one.b * layers)
        u, whole = pts[-1]
        split[seg] = per_extra_pass(cut, whole, m) * layers * totals[seg] / u
    head = functools.partial(_vocab_step, shape=shape)
    vocab, cut = _line_and_cut(head, unit_points(totals["vocab"]), m, repeats)
    curves["vocab"] = line_of(vocab)
    u, whole = vocab[-1]
    split["vocab"] = per_extra_pass(cut, whole, m) * totals["vocab"] / u
    embed = time_embedding(shape, repeats)
    embed_cut = time_embedding(shape, repeats, passes=m) if m > 1 and embed else embed
    return SegmentTimes(
        curves,
        time_replicated(shape, repeats),
        split,
        embed_s=embed,
        embed_split_s=per_extra_pass(embed_cut, embed, m),
    )
