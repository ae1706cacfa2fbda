"""The LM head and cross-entropy in chunks of tokens (activation checkpointing): the same
loss and gradients as the head's own path, for one device and for vocabulary rows split
over ranks, with far less kept between forward and backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.model.head import CHUNK_TOKENS, chunked_loss_sum, chunks, one_rank
from xronos.parallel.shard import build_model
from xronos.parallel.vocab import vocab_parallel_cross_entropy
from xronos.planner.plan import Plan

H, V = 32, 300
N = 2 * CHUNK_TOKENS + 37  # three chunks, the last a short one


# fp32 sums of up to N terms in another order (per chunk, then the chunks): they agree to
# ~sqrt(N) ulps of the terms' size (1e-5 of it at N ~ 1,000); measured 5e-6 absolute on a
# weight gradient of entries up to ~50. A real fault (a wrong target, a chunk or token
# missed or counted twice) moves them by percents.
def _close(a: torch.Tensor | None, b: torch.Tensor | None, what: str = "") -> None:
    assert a is not None and b is not None, what
    scale = float(b.abs().max()) if b.numel() else 0.0
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(scale, 1.0), msg=what)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * 0.3
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::7] = -100  # ignored tokens, in every chunk
    return h, w, targets


def _grads(loss_of: object, h: torch.Tensor, w: torch.Tensor, train_w: bool = True) -> tuple:
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(train_w)
    loss = loss_of(h, w)  # type: ignore[operator]
    (3.0 * loss).backward()  # an upstream gradient other than 1 (the loss is divided later)
    return loss.detach(), h.grad, w.grad


def test_one_device_matches_cross_entropy() -> None:
    h, w, targets = _inputs()
    ref = _grads(lambda h, w: F.cross_entropy(h @ w.t(), targets, reduction="sum"), h, w)
    got = _grads(lambda h, w: chunked_loss_sum(h, w, targets, 0, one_rank), h, w)
    for a, b in zip(got, ref, strict=True):
        _close(a, b)
    # a frozen head (LoRA): no weight gradient is computed, the input's is the same
    frozen = _grads(lambda h, w: chunked_loss_sum(h, w, targets, 0, one_rank), h, w, False)
    assert frozen[2] is None
    _close(frozen[1], ref[1])


def test_vocabulary_rows_split_over_ranks_match_the_parallel_cross_entropy() -> None:
    """Two ranks' rows [0, 120) and [120, 300), one process: each rank's statistics are
    what the other's forward computed (the exchange the group makes)."""
    h, w, targets = _inputs(1)
    cut = 120
    parts = [(0, w[:cut]), (cut, w[cut:])]

    def stats_of(v0: int, rows: torch.Tensor) -> torch.Tensor:
        seen: list[torch.Tensor] = []

        def keep(mine: torch.Tensor) -> list[torch.Tensor]:
            seen.append(mine)
            return [mine, mine]  # any second entry: only this rank's is read back

        chunked_loss_sum(h, rows, targets, v0, keep)
        return seen[0]

    mine = [stats_of(v0, rows) for v0, rows in parts]
    for r, (v0, rows) in enumerate(parts):
        ref = _grads(lambda h, w, v0=v0, r=r: _reference(h, w, targets, v0, mine, r), h, rows)
        got = _grads(
            lambda h, w, v0=v0, r=r: chunked_loss_sum(
                h, w, targets, v0, lambda s: _swap(s, mine, r)
            ),
            h,
            rows,
        )
        for a, b in zip(got, ref, strict=True):
            _close(a, b)
    # and the whole: the loss is the one-device cross-entropy
    whole = F.cross_entropy(h @ w.t(), targets, reduction="sum")
    _close(_grads(lambda h, w: chunked_loss_sum(
        h, w, targets, 0, lambda s: _swap(s, mine, 0)), h, w[:cut])[0], whole)  # fmt: skip


def _swap(s: torch.Tensor, every: list[torch.Tensor], r: int) -> list[torch.Tensor]:
    """The gather: this rank's own statistics in its place, the others' as computed."""
    return [s if i == r else t for i, t in enumerate(every)]


class _Fixed(TPGroup):
    """A one-process stand-in for the exchange: every rank's statistics as given."""

    def __init__(self, every: list[torch.Tensor], r: int) -> None:
        super().__init__()
        self.every, self.r = every, r

    def all_gather(self, t: torch.Tensor, name: str, kind: str = "") -> list[torch.Tensor]:
        return _swap(t, self.every, self.r)


def _reference(
    h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, v0: int,
    every: list[torch.Tensor], r: int,
) -> torch.Tensor:  # fmt: skip
    return vocab_parallel_cross_entropy(h @ w.t(), targets, v0, _Fixed(every, r))


def test_little_is_kept_for_the_backward() -> None:
    h, w, targets = _inputs()
    h.requires_grad_(True)
    w.requires_grad_(True)
    kept: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_loss_sum(h, w, targets, 0, one_rank)
    logits = N * V * 4
    # the inputs, per-token statistics and the last chunk's logits: under a third of one
    # step's logits (the head's own path keeps a log-softmax of them all)
    assert sum(kept) < logits / 3
    kept.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(h @ w.t(), targets, reduction="sum")
    assert sum(kept) >= logits


def test_a_model_chunks_only_when_checkpointing_a_step_longer_than_a_chunk() -> None:
    cfg = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=48, num_layers=1,
                      num_heads=4, num_kv_heads=2)  # fmt: skip
    plain = build_model(cfg, Plan.single(cfg, "cpu"), TPGroup())
    model = build_model(cfg, Plan.single(cfg, "cpu"), TPGroup(), recompute=True)
    assert model.head.chunked and not plain.head.chunked  # type: ignore[attr-defined]
    h = torch.zeros(1, H)
    assert chunks(True, model.lm_head, h, CHUNK_TOKENS + 1)
    assert not chunks(True, model.lm_head, h, CHUNK_TOKENS)  # one chunk: the own path
    assert not chunks(False, model.lm_head, h, 10 * CHUNK_TOKENS)
    with torch.no_grad():
        assert not chunks(True, model.lm_head, h, 10 * CHUNK_TOKENS)  # evaluation
    assert not chunks(True, nn.Linear(H, V), h, 10 * CHUNK_TOKENS)  # a bias: not plain
    # the same loss and gradients through the model, 2 x 600 tokens
    ids = torch.randint(0, V, (2, 601), generator=torch.Generator().manual_seed(2))
    model.load_state_dict(plain.state_dict())
    losses, grads = [], []
    for m in (plain, model):
        loss = m.loss_sum(ids, ids)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    _close(losses[1], losses[0])
    for name, g in grads[0].items():
        _close(grads[1][name], g, name)


@pytest.mark.parametrize("n", [0, 5])
def test_no_rows_or_few_tokens(n: int) -> None:
    """A rank with no vocabulary rows gives -inf and zeros for every token, and gradients
    of zero; a call of fewer tokens than a chunk is one chunk."""
    h, w, targets = _inputs()
    empty = w[:0].clone().requires_grad_(True)
    hh = h[:n].clone().requires_grad_(True)
    seen: list[torch.Tensor] = []
    chunked_loss_sum(hh, empty, targets[:n], 0, lambda s: seen.append(s) or [s]).backward()  # type: ignore[func-returns-value]
    assert seen[0].shape == (2, n) and torch.all(seen[0][0] == float("-inf"))
    assert hh.grad is not None and torch.all(hh.grad == 0)


@pytest.mark.parametrize("passes", [1, 2])
def test_the_profiler_times_the_head_as_a_checkpointed_model_runs_it(
    monkeypatch: pytest.MonkeyPatch, passes: int
) -> None:
    """The vocabulary segment's step at a checkpointed shape of more tokens a pass than a
    chunk goes through the chunked loss, once a pass; not checkpointed, it does not."""
    from xronos.profiler import measure

    calls: list[int] = []

    def counted(h: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(h.shape[0])
        return chunked_loss_sum(h, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(measure, "chunked_loss_sum", counted)
    cfg = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=48, num_layers=1,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=1024)  # fmt: skip
    shape = measure.Shape(cfg=cfg, batch_size=4, seq_len=600, mlp_chunk=8, vocab_chunk=64)
    measure._vocab_step(2, dataclasses.replace(shape, recompute=True), passes)()
    assert calls == [4 * 599 // passes] * passes
    measure._vocab_step(2, shape, passes)()
    assert len(calls) == passes
