"""The single-device LM head's product (``xronos.model.head``): the same logits and
gradients as ``nn.Linear``, and with tied embeddings the two gradients of the output
embedding added in place instead of into a fresh ``(V, H)`` tensor every step."""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import profile

from xronos.model.head import head_logits

V, H = 96, 32


def _tied() -> tuple[nn.Embedding, nn.Linear]:
    torch.manual_seed(0)
    emb = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    head.weight = emb.weight
    return emb, head


def _loss(emb: nn.Embedding, head: nn.Module, ids: torch.Tensor, ours: bool) -> torch.Tensor:
    h = torch.tanh(emb(ids))[:, :-1]  # a strided slice, as the model's shifted states
    logits = head_logits(head, h) if ours else head(h)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))


def test_same_logits_and_gradients_as_linear() -> None:
    emb, head = _tied()
    ids = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(1))
    h = torch.tanh(emb(ids))[:, :-1]
    # the forward is nn.Linear's product on the same operands: equal to the bit
    assert torch.equal(head_logits(head, h), head(h))
    grads = []
    for ours in (False, True):
        emb.weight.grad = None
        _loss(emb, head, ids, ours).backward()
        grads.append(emb.weight.grad.clone())
    # the same products in another association order: a few ulps of fp32
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_tied_gradients_are_added_in_place() -> None:
    emb, head = _tied()
    ids = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(2))
    loss = _loss(emb, head, ids, ours=True)
    with profile(record_shapes=True) as prof:
        loss.backward()
    found = {"aten::add": 0, "aten::add_": 0}
    for event in prof.events():
        if event.name in found and [V, H] in event.input_shapes:
            found[event.name] += 1
    # the head's product hands autograd a gradient it adds the lookup's into in place
    # (nn.Linear's, in the torch versions measured, is added to out of place instead)
    assert found == {"aten::add": 0, "aten::add_": 1}


def test_frozen_weight_gets_no_gradient_and_the_input_still_does() -> None:
    _, head = _tied()
    head.weight.requires_grad_(False)
    h = torch.randn(2, 5, H, requires_grad=True)
    head_logits(head, h).sum().backward()
    assert head.weight.grad is None
    assert h.grad is not None
    torch.testing.assert_close(h.grad, head.weight.sum(0).expand(2, 5, H))


def test_other_heads_keep_their_own_path() -> None:
    torch.manual_seed(3)
    h = torch.randn(2, 4, H)
    biased = nn.Linear(H, V)
    assert torch.equal(head_logits(biased, h), biased(h))
    double = nn.Linear(H, V, bias=False).double()
    assert torch.equal(head_logits(double, h.double()), double(h.double()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = nn.Linear(H, V, bias=False)
        out = head_logits(plain, h)
        assert out.dtype == torch.bfloat16 and torch.equal(out, plain(h))
