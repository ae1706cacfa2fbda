"""Xronos's LoRA equals peft's: same forward, same adapter gradients."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_models import make_checkpoint
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.model.lora import DEFAULT_TARGETS, LoRAConfig
from xronos.parallel.shard import build_model
from xronos.planner.plan import Plan

# fp32, same operations in the same order up to matmul blocking: a few ulps of O(1) values.
ATOL, RTOL = 1e-5, 1e-4


def _ours(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".default.", ".")


def test_lora_matches_peft(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = make_checkpoint(tmp_path, "qwen2", tied=True)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(DEFAULT_TARGETS))
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-zero B so that every gradient is non-trivial
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    cfg = ModelConfig.from_pretrained(tmp_path)
    ours = build_model(
        cfg, Plan.single(cfg), TPGroup(), model_dir=tmp_path, lora=LoRAConfig(r=4, alpha=8.0)
    )
    theirs = {_ours(n): p for n, p in peft_model.named_parameters() if "lora_" in n}
    mine = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    assert mine.keys() == theirs.keys()
    with torch.no_grad():
        for n, p in mine.items():
            p.copy_(theirs[n])

    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=gen)
    out = peft_model(input_ids=ids, labels=ids)
    loss = ours.loss_sum(ids, ids) / (ids.shape[0] * (ids.shape[1] - 1))
    torch.testing.assert_close(ours(ids), out.logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(loss, out.loss, atol=ATOL, rtol=RTOL)
    loss.backward()
    out.loss.backward()
    for n, p in mine.items():
        torch.testing.assert_close(p.grad, theirs[n].grad, atol=ATOL, rtol=RTOL, msg=n)
