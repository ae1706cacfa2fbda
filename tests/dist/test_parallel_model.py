"""Sharded model == the matching slices of the unsharded reference, forward and backward.

Each rank builds the same seeded reference model (one device) and its own shard under an
uneven plan, runs the same batch through both, and compares logits, loss and the gradient
of every parameter with the slice of the reference gradient it should hold.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.world import WorkerContext, run_world
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.model.lora import LoRAConfig
from xronos.parallel.gather import gather_state
from xronos.parallel.shard import build_model
from xronos.parallel.spec import shard_spec
from xronos.planner.plan import Plan

# fp32 throughout; sharding only reassociates sums (all-reduce of partial matmuls), so
# differences are a few ulps of the magnitudes involved (|logits| ~ 1, |grads| ~ 1e-2).
ATOL = 1e-5
RTOL = 1e-4


def _cfg(tied: bool, qk_norm: bool = False, bias: bool = False) -> ModelConfig:
    return ModelConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8,
        num_kv_heads=4, tie_word_embeddings=tied, qk_norm=qk_norm, attention_bias=bias,
        head_dim=16 if qk_norm else 0,
    )


def _plan(cfg: ModelConfig, split: list[int]) -> Plan:
    # attn gets exactly ``split`` KV groups; mlp and vocab proportional to it (so a 0 in
    # ``split`` is a rank with no units of any segment: it only runs replicated work)
    p = Plan.from_shares(cfg, [float(s) for s in split], mlp_chunk=8, vocab_chunk=8)
    return Plan(
        strategy="test", devices=p.devices, attn=tuple(split), mlp=p.mlp, vocab=p.vocab,
        mlp_chunk=8, vocab_chunk=8,
    )


def _forward_backward(ctx: WorkerContext, arg: tuple) -> dict:
    cfg, split, lora = arg
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    labels = ids.clone()
    labels[:, :3] = -100  # a masked prompt
    ref = build_model(cfg, Plan.single(cfg), TPGroup(), seed=3, lora=lora)
    plan = _plan(cfg, split)
    shard = build_model(cfg, plan, ctx.group, seed=3, lora=lora)
    if lora is not None:  # make B non-zero so every adapter gradient is non-trivial
        for m in (ref, shard):
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    full = torch.randn(p.shape if m is ref else _full_shape(n, cfg, lora),
                                       generator=torch.Generator().manual_seed(len(n)))
                    spec = shard_spec(n, cfg, plan, ctx.rank) if m is shard else None
                    with torch.no_grad():
                        p.copy_(full if spec is None else full.narrow(spec.dim, spec.start,
                                                                        spec.end - spec.start))
    out = {}
    for tag, m in (("ref", ref), ("tp", shard)):
        loss = m.loss_sum(ids, labels)
        loss.backward()
        out[tag + "_loss"] = float(loss.detach())
        with torch.no_grad():
            out[tag + "_logits"] = m(ids)
    grads = {n: p.grad for n, p in shard.named_parameters() if p.requires_grad}
    from xronos.engine.trainer import OptimConfig, Trainer

    Trainer(shard, cfg, plan, ctx.group, OptimConfig())._sync_partial_grads()
    grads = {n: p.grad for n, p in shard.named_parameters() if p.requires_grad}
    out["grad_err"] = {}
    for n, p in ref.named_parameters():
        if not p.requires_grad:
            continue
        spec = shard_spec(n, cfg, plan, ctx.rank)
        want = p.grad if spec is None else p.grad.narrow(spec.dim, spec.start, grads[n].shape[spec.dim])
        out["grad_err"][n] = float((grads[n] - want).abs().max()) if want.numel() else 0.0
        out.setdefault("grad_scale", {})[n] = float(want.abs().max()) if want.numel() else 0.0
    out["gathered_equal"] = all(
        torch.equal(v, dict(ref.named_parameters())[k])
        for k, v in gather_state(shard, cfg, plan, ctx.group).items()
    ) if lora is None else True
    return out


def _full_shape(name: str, cfg: ModelConfig, lora: LoRAConfig) -> tuple[int, int]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    out = {"q_proj": cfg.num_heads * d, "k_proj": cfg.num_kv_heads * d,
           "v_proj": cfg.num_kv_heads * d, "o_proj": h, "gate_proj": i, "up_proj": i,
           "down_proj": h}
    module = name.split(".")[-3]
    return (out[module], lora.r)


SPLITS = [[2, 2], [3, 1], [1, 2, 1], [0, 3, 1]]
VARIANTS = ("untied", "tied", "qwen2-bias", "qwen3-qknorm", "lora")


def _all_variants(ctx: WorkerContext, split: list[int]) -> dict[str, dict]:
    # One world per split runs every variant: spawning ranks costs more than the math.
    out = {}
    for variant in VARIANTS:
        cfg = _cfg(
            tied=variant == "tied", qk_norm=variant == "qwen3-qknorm", bias=variant == "qwen2-bias"
        )
        lora = LoRAConfig(r=4, alpha=8.0) if variant == "lora" else None
        out[variant] = _forward_backward(ctx, (cfg, split, lora))
    return out


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_sharded_matches_reference(split: list[int]) -> None:
    for rank_result in run_world(_all_variants, len(split), split):
        for variant, r in rank_result.items():
            torch.testing.assert_close(
                r["tp_logits"], r["ref_logits"], atol=ATOL, rtol=RTOL, msg=lambda m: f"{variant}: {m}"
            )
            assert r["tp_loss"] == pytest.approx(r["ref_loss"], rel=RTOL), variant
            for n, err in r["grad_err"].items():
                assert err <= ATOL + RTOL * r["grad_scale"][n], f"{variant} {n}: grad off by {err}"
            assert r["gathered_equal"], f"{variant}: gathered shards differ from the master"
