"""Tensor-parallel logits on uneven splits equal transformers' on the same checkpoint.

The models have 8 query heads in 4 KV groups; the attention is split by query heads, so
shares 3 : 1 and 1 : 2 : 1 give whole groups (6 : 2, 2 : 4 : 2) and 1 : 4 : 3 cuts groups
0 and 2, whose K/V two ranks each compute (Llama, Qwen2 with q/k/v bias, Qwen3 with q/k
norms).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist.world import WorkerContext, run_world
from tests.hf_models import make_checkpoint
from xronos.config import ModelConfig
from xronos.parallel.shard import build_model
from xronos.parallel.spec import shared_kv_heads
from xronos.planner.plan import Plan

# The contract for fp32 logits: max |Δ| ≤ 1e-4 (observed ≈ 1e-6: only the
# summation order of the row-parallel all-reduces differs).
MAX_ABS = 1e-4
CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False)]


def _logits(ctx: WorkerContext, arg: tuple[list[str], list[float], torch.Tensor]) -> list:
    dirs, shares, ids = arg
    out = []
    for d in dirs:
        cfg = ModelConfig.from_pretrained(d)
        plan = Plan.from_shares(cfg, shares, mlp_chunk=8, vocab_chunk=8)
        model = build_model(cfg, plan, ctx.group, model_dir=d)
        with torch.no_grad():
            out.append(model(ids))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "shares", [[3.0, 1.0], [1.0, 2.0, 1.0], [1.0, 4.0, 3.0]], ids=["3-1", "1-2-1", "1-4-3"]
)
def test_tp_logits_match_transformers(tmp_path: Path, shares: list[float]) -> None:
    dirs, refs = [], []
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    for arch, tied in CASES:
        d = tmp_path / f"{arch}-{'tied' if tied else 'untied'}"
        ref = make_checkpoint(d, arch, tied=tied, seed=len(dirs))
        with torch.no_grad():
            refs.append(ref(ids).logits)
        dirs.append(str(d))
        cfg = ModelConfig.from_pretrained(d)
        cuts = shared_kv_heads(cfg, Plan.from_shares(cfg, shares, mlp_chunk=8, vocab_chunk=8))
        assert cuts == ((0, 2) if shares == [1.0, 4.0, 3.0] else ()), (arch, cuts)
    for rank_out in run_world(_logits, len(shares), ([*dirs], shares, ids)):
        for (arch, tied), got, want in zip(CASES, rank_out, refs, strict=True):
            err = float((got - want).abs().max())
            assert err <= MAX_ABS, f"{arch} tied={tied}: max |Δ| = {err:.2e}"
