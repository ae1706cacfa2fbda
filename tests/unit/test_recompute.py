"""Activation checkpointing (``--gradient-checkpointing``): the same step, less memory."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import xronos.model.llama as llama
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.model.head import CHUNK_TOKENS
from xronos.model.llama import KVCache, LlamaForCausalLM
from xronos.model.lora import LoRAConfig
from xronos.parallel.shard import build_model
from xronos.planner.plan import Plan
from xronos.profiler.bytes import base_bytes, unit_bytes
from xronos.profiler.measure import Shape

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=192,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
)
DROPOUT = LoRAConfig(r=4, alpha=8.0, dropout=0.3)


def _model(lora: LoRAConfig | None, recompute: bool) -> LlamaForCausalLM:
    model = build_model(CFG, Plan.single(CFG), TPGroup(), seed=3, lora=lora, recompute=recompute)
    if lora is not None:  # B starts at zero: make every adapter's gradient non-trivial
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    return model


def _step(model: LlamaForCausalLM) -> tuple[float, dict[str, torch.Tensor], int]:
    """Losses, accumulated gradients and the bytes autograd saved for backward (the most
    of one pass) of two passes (micro-batches): the second one's dropout masks must be
    new ones, not the first one's again."""
    gen = torch.Generator().manual_seed(1)
    total, saved = 0.0, 0
    for _ in range(2):
        ids = torch.randint(0, CFG.vocab_size, (2, 48), generator=gen)
        held = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal held
            held += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.loss_sum(ids, ids)
        loss.backward()
        total, saved = total + float(loss.detach()), max(saved, held)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return total, grads, saved


@pytest.mark.parametrize("lora", [None, DROPOUT], ids=["full", "lora-dropout"])
def test_same_loss_and_gradients_bit_for_bit(lora: LoRAConfig | None) -> None:
    loss, grads, saved = _step(_model(lora, recompute=False))
    loss_rc, grads_rc, saved_rc = _step(_model(lora, recompute=True))
    # the same operations on the same values in the same order: exactly equal, not close
    assert loss_rc == loss
    assert grads_rc.keys() == grads.keys() and grads
    for name, g in grads.items():
        assert torch.equal(grads_rc[name], g), name
    # Without checkpointing every layer's intermediate tensors (and the weights the
    # products read) are saved: here ~4.5 MiB. With it, the two regions' inputs per layer
    # and what the head saves: under a third of that.
    assert saved_rc < saved / 3, (saved_rc, saved)


def test_forwards_before_backwards_as_a_pipeline_runs_them() -> None:
    """A pipeline stage runs several micro-batches' forwards before their backwards: each
    recomputation draws its own forward's masks and leaves the generators where the later
    forwards left them."""
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randint(0, CFG.vocab_size, (2, 32), generator=gen) for _ in range(3)]
    grads = []
    for recompute in (False, True):
        model = _model(DROPOUT, recompute)
        losses = [model.loss_sum(ids, ids) for ids in batches[:2]]
        losses[0].backward()
        losses.append(model.loss_sum(batches[2], batches[2]))  # a forward between backwards
        losses[1].backward()
        losses[2].backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    for name, g in grads[0].items():
        assert torch.equal(grads[1][name], g), name


def test_dropout_masks_are_drawn_again_from_where_the_forward_drew_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Must-fail control: a region that does not put the adapters' dropout generators back
    draws new masks when it computes again, and the gradients differ — so the equality
    above depends on the replay."""
    _, grads, _ = _step(_model(DROPOUT, recompute=False))
    plain = llama.recomputed
    monkeypatch.setattr(llama, "recomputed", lambda owner, region: plain(torch.nn.Module(), region))
    _, grads_rc, _ = _step(_model(DROPOUT, recompute=True))
    assert any(not torch.equal(grads_rc[n], g) for n, g in grads.items())


def test_evaluation_and_decoding_run_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``no_grad`` (evaluation) and with a KV cache (decoding, whose cache a second
    forward would append to twice) a block does not checkpoint, and computes as without."""
    ids = torch.randint(0, CFG.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    plain, rc = _model(None, recompute=False), _model(None, recompute=True)
    calls: list[int] = []
    wrapped = llama.recomputed
    monkeypatch.setattr(llama, "recomputed", lambda *a: calls.append(1) or wrapped(*a))
    with torch.no_grad():
        assert torch.equal(rc(ids), plain(ids))
    assert torch.equal(rc.hidden_states(ids, KVCache()), plain.hidden_states(ids, KVCache()))
    assert not calls
    rc(ids).sum().backward()  # training: checkpointed, two regions per layer
    assert len(calls) == 2 * CFG.num_layers


def test_memory_model_keeps_one_layer_of_activations() -> None:
    """The planner's bytes: weights, gradients and moments unchanged; the activations of the
    layers' units those of one layer, the head's those of one chunk of tokens, and the
    replicated ones two hidden states a layer plus one layer's six."""
    shape = Shape(cfg=CFG, batch_size=4, seq_len=256, mlp_chunk=32, vocab_chunk=32)
    rc = dataclasses.replace(shape, recompute=True)
    full, less = unit_bytes(shape), unit_bytes(rc)
    tokens, layers = 4 * 256, CFG.num_layers
    # the head's logits and their gradient: of one chunk of tokens, not of every token
    assert full["vocab"] - less["vocab"] == 4 * 2 * 32 * (tokens - CHUNK_TOKENS)
    short = dataclasses.replace(shape, seq_len=CHUNK_TOKENS // 4)  # a step of one chunk
    assert (
        unit_bytes(short)["vocab"]
        == unit_bytes(dataclasses.replace(short, recompute=True))["vocab"]
    )
    head_width = math.ceil(CFG.kv_group_width / CFG.q_per_kv)  # a query head and its K/V share
    for seg, per_unit in (("attn", 2 * head_width), ("mlp", 4 * 32)):
        act = 4 * tokens * per_unit  # one layer's activations of one unit, fp32
        assert full[seg] - less[seg] == (layers - 1) * act, seg
    hidden = 4 * tokens * CFG.hidden_size
    assert base_bytes(shape) - base_bytes(rc) == (6 * layers - (2 * layers + 6)) * hidden
