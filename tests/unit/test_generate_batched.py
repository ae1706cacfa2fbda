"""Evaluation decodes prompts of different lengths together, padded on the left and masked:
the tokens equal one-by-one greedy decoding (rotary embeddings are relative, so the shift
padding gives every position changes no score)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from xronos.config import tiny
from xronos.model.llama import KVCache, LlamaForCausalLM, init_weights
from xronos.train.generate import greedy, greedy_many


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-style"])
def test_padded_batches_decode_like_one_prompt_at_a_time(qk_norm: bool) -> None:
    cfg = dataclasses.replace(tiny(), qk_norm=qk_norm)
    model = LlamaForCausalLM(cfg).eval()
    init_weights(model, seed=3, std=0.2)  # a peaked model: a wrong mask changes its argmax
    g = torch.Generator().manual_seed(0)
    lengths = (3, 9, 5, 9, 1)
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    eos = (7,)
    alone = [greedy(model, p, 12, eos) for p in prompts]
    # batches of 2 and of all: padding on some rows, none on others (the two of length 9)
    for size in (2, 32):
        assert greedy_many(model, prompts, 12, eos, batch_size=size) == alone, size
    # the mask matters: without it the padded prompts attend to the padding
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVCache, "mask", lambda self, s: None)
        assert greedy_many(model, prompts, 12, eos, batch_size=32) != alone
