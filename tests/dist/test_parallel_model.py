"""Sharded model == the matching slices of the unsharded reference, forward and backward.

Each rank builds the same seeded reference model (one device) and its own shard under an
uneven plan, runs the same batch through both, and compares logits, loss and the gradient
of every parameter with the slice of the reference gradient it should hold. Attention is
split by query heads; splits that cut a KV group make two ranks hold (and compute) its K/V,
whose gradients must then be summed between them (a must-fail control checks that the sum
is needed). Every rank's
parameters then reassemble into the reference's; for the LoRA adapters the layout is checked
against the rule of docs/architecture.md (Units and the Plan), and their gradients are
reassembled too, both after and (as a must-fail control) before the all-reduce of the
per-rank partial sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.dist.world import WorkerContext, run_world
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.model.lora import LoRAConfig
from xronos.parallel.gather import gather_state, gather_tensor
from xronos.parallel.shard import build_model
from xronos.parallel.spec import kv_heads, owned_part, partial_grad, shard_spec, shared_kv_heads
from xronos.planner.plan import Plan

# fp32 throughout; sharding only reassociates sums (all-reduce of partial matmuls), so
# differences are a few ulps of the magnitudes involved (|logits| ~ 1, |grads| ~ 1e-2).
ATOL = 1e-5
RTOL = 1e-4


def _cfg(tied: bool, qk_norm: bool = False, bias: bool = False) -> ModelConfig:
    return ModelConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        tie_word_embeddings=tied,
        qk_norm=qk_norm,
        attention_bias=bias,
        head_dim=16 if qk_norm else 0,
    )


def _plan(cfg: ModelConfig, split: list[int]) -> Plan:
    # attn gets exactly ``split`` query heads; mlp and vocab proportional to it (so a 0 in
    # ``split`` is a rank with no units of any segment: it only runs replicated work)
    p = Plan.from_shares(cfg, [float(s) for s in split], mlp_chunk=8, vocab_chunk=8)
    return Plan(
        strategy="test",
        devices=p.devices,
        attn=tuple(split),
        mlp=p.mlp,
        vocab=p.vocab,
        mlp_chunk=8,
        vocab_chunk=8,
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
                    full = torch.randn(
                        p.shape if m is ref else _full_shape(n, cfg, lora),
                        generator=torch.Generator().manual_seed(len(n)),
                    )
                    spec = shard_spec(n, cfg, plan, ctx.rank) if m is shard else None
                    with torch.no_grad():
                        p.copy_(
                            full
                            if spec is None
                            else full.narrow(spec.dim, spec.start, spec.end - spec.start)
                        )
    out: dict[str, Any] = {}
    for tag, m in (("ref", ref), ("tp", shard)):
        loss = m.loss_sum(ids, labels)
        loss.backward()
        out[tag + "_loss"] = float(loss.detach())
        with torch.no_grad():
            out[tag + "_logits"] = m(ids)
    # Adapter gradients as the backward left them: the replicated factors still hold
    # per-rank partial sums (the must-fail control below).
    unsynced = {n: _grad(p).clone() for n, p in shard.named_parameters() if ".lora_" in n}
    kv_unsynced = {n: _grad(p).clone() for n, p in shard.named_parameters() if _kv_split(n)}
    _all_reduce_partial_grads(shard, cfg, plan, ctx.group)
    grads = {n: _grad(p) for n, p in shard.named_parameters() if p.requires_grad}
    out["grad_err"], out["grad_scale"], out["kv_unsynced_err"] = {}, {}, {}
    k0, k1 = kv_heads(cfg, plan, ctx.rank)
    holds_shared = any(k0 <= g < k1 for g in shared_kv_heads(cfg, plan))
    for n, p in ref.named_parameters():
        if not p.requires_grad:
            continue
        spec = shard_spec(n, cfg, plan, ctx.rank)
        full = _grad(p)
        want = full if spec is None else full.narrow(spec.dim, spec.start, grads[n].shape[spec.dim])
        out["grad_err"][n] = float((grads[n] - want).abs().max()) if want.numel() else 0.0
        out["grad_scale"][n] = float(want.abs().max()) if want.numel() else 0.0
        if holds_shared and n in kv_unsynced:  # a shared group's rows before their sum
            out["kv_unsynced_err"][n] = float((kv_unsynced[n] - want).abs().max())
    ref_params = dict(ref.named_parameters())
    out["gathered_equal"] = all(
        torch.equal(v, ref_params[k]) for k, v in gather_state(shard, cfg, plan, ctx.group).items()
    )
    if lora is not None:
        out["lora"] = _reassembled_lora(shard, ref_params, unsynced, cfg, plan, ctx.group)
    return out


def _kv_split(name: str) -> bool:
    """Split along K/V heads: k/v weight and bias, and LoRA B on k/v (docs/architecture.md,
    Units and the Plan)."""
    module = name.split(".")[-3] if ".lora_" in name else name.split(".")[-2]
    return module in ("k_proj", "v_proj") and ".lora_A." not in name


def _all_reduce_partial_grads(
    model: torch.nn.Module, cfg: ModelConfig, plan: Plan, group: TPGroup
) -> None:
    """Sum the gradients that ``partial_grad`` names as per-rank partials over the ranks,
    and the K/V rows of KV groups several ranks hold over those ranks, as a training step
    does before its update (here one all-reduce per tensor, K/V rows placed at their
    full-tensor position in a zero buffer: simple, and the sum is the same)."""
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if partial_grad(n):
            p.grad = _grad(p).clone()
            group.all_reduce(p.grad, f"test.{n}")
        elif _kv_split(n) and (spec := shard_spec(n, cfg, plan, group.rank)) is not None:
            full = torch.zeros([cfg.num_kv_heads * cfg.head_dim, *p.shape[1:]])
            full.narrow(0, spec.start, spec.end - spec.start).copy_(_grad(p))
            group.all_reduce(full, f"test.{n}")
            p.grad = full.narrow(0, spec.start, spec.end - spec.start).clone()


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    # a rank with no units of a segment may get no gradient at all: it contributed zero
    return p.grad if p.grad is not None else torch.zeros_like(p)


#: docs/architecture.md, "LoRA follows its base layer", written out independently of
#: ``shard_spec``: the dim of each factor's weight that is split (None: replicated).
#: ``lora_A.weight`` is ``[r, in]`` and ``lora_B.weight`` is ``[out, r]``: a column-parallel
#: base splits *out* (B's dim 0), a row-parallel base splits *in* (A's dim 1).
LORA_SPLIT_DIM = {("column", "A"): None, ("column", "B"): 0, ("row", "A"): 1, ("row", "B"): None}
COLUMN_BASES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_BASES = ("o_proj", "down_proj")


def _lora_role(name: str) -> tuple[str, str]:
    """``...q_proj.lora_A.weight`` -> ("column", "A")."""
    module, factor = name.split(".")[-3], name.split(".")[-2].removeprefix("lora_")
    assert module in COLUMN_BASES + ROW_BASES, name
    return ("column" if module in COLUMN_BASES else "row"), factor


def _copies(
    t: torch.Tensor, dim: int | None, group: TPGroup, name: str, cfg: ModelConfig, plan: Plan
) -> list[torch.Tensor]:
    """The full tensor as every rank's pieces give it: one concatenation of the shards (a
    shared KV group's rows from its owner only), or, for a replicated tensor, every rank's
    copy (each must be the whole thing)."""
    if dim is None:
        return group.all_gather(t.detach().contiguous(), name)
    return [gather_tensor(owned_part(t, name, cfg, plan, group.rank)[0], dim, group, name)]


def _reassembled_lora(
    shard: torch.nn.Module,
    ref_params: dict[str, torch.nn.Parameter],
    unsynced: dict[str, torch.Tensor],
    cfg: ModelConfig,
    plan: Plan,
    group: TPGroup,
) -> dict[str, dict]:
    """Per adapter weight: does its layout follow the rule, do the ranks' pieces reassemble
    into the reference weight and gradient, and how far off the gradient was before the
    partial sums were all-reduced."""
    out = {}
    for n, p in shard.named_parameters():
        if ".lora_" not in n:
            continue
        dim = LORA_SPLIT_DIM[_lora_role(n)]
        spec = shard_spec(n, cfg, plan, group.rank)
        want, want_grad = ref_params[n].detach(), _grad(ref_params[n])
        whole = [d for d in range(p.dim()) if d != dim]  # dims every rank holds in full
        r = {
            "spec_follows_rule": (spec is None)
            if dim is None
            else (spec is not None and spec.dim == dim),
            "local_shape_ok": all(p.shape[d] == want.shape[d] for d in whole),
            "params_equal": all(torch.equal(c, want) for c in _copies(p, dim, group, n, cfg, plan)),
            "grad_err": max(
                float((c - want_grad).abs().max())
                for c in _copies(_grad(p), dim, group, n, cfg, plan)
            ),
            "grad_scale": float(want_grad.abs().max()),
        }
        if dim is None:  # a replicated factor: its gradient is a partial sum until all-reduced
            r["unsynced_err"] = max(
                float((c - want_grad).abs().max())
                for c in _copies(unsynced[n], dim, group, n, cfg, plan)
            )
        out[n] = r
    return out


def _full_shape(name: str, cfg: ModelConfig, lora: LoRAConfig) -> tuple[int, int]:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    out = {
        "q_proj": cfg.num_heads * d,
        "k_proj": cfg.num_kv_heads * d,
        "v_proj": cfg.num_kv_heads * d,
        "o_proj": h,
        "gate_proj": i,
        "up_proj": i,
        "down_proj": h,
    }
    module = name.split(".")[-3]
    return (out[module], lora.r)


# query heads per rank (8 heads in 4 KV groups of 2): whole groups, and splits that cut a
# group (3-5: ranks 0 and 1 share group 1; 1-4-3: groups 0 and 2 shared; 3-0-5: a zero-head
# rank between the two ranks that share group 1)
SPLITS = [[4, 4], [6, 2], [2, 4, 2], [0, 6, 2], [3, 5], [1, 4, 3], [3, 0, 5]]
CUTS_A_GROUP = ([3, 5], [1, 4, 3], [3, 0, 5])
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


def _prefixed(tag: str) -> Callable[[str], str]:
    return lambda message: f"{tag}: {message}"


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_sharded_matches_reference(split: list[int]) -> None:
    rank_results = run_world(_all_variants, len(split), split)
    for rank_result in rank_results:
        for variant, r in rank_result.items():
            torch.testing.assert_close(
                r["tp_logits"],
                r["ref_logits"],
                atol=ATOL,
                rtol=RTOL,
                msg=_prefixed(variant),
            )
            assert r["tp_loss"] == pytest.approx(r["ref_loss"], rel=RTOL), variant
            for n, err in r["grad_err"].items():
                assert err <= ATOL + RTOL * r["grad_scale"][n], f"{variant} {n}: grad off by {err}"
            assert r["gathered_equal"], f"{variant}: gathered shards differ from the master"
            # Must-fail control: before the sum over the ranks sharing a KV group, the
            # shared rows' gradient is only this rank's part (same tolerance as above).
            for n, err in r["kv_unsynced_err"].items():
                tol = ATOL + RTOL * r["grad_scale"][n]
                assert err > 10 * tol, f"{variant} {n}: a shared K/V gradient looked complete"
        _check_lora(rank_result["lora"]["lora"])
    holds_shared = [bool(r["untied"]["kv_unsynced_err"]) for r in rank_results]
    assert any(holds_shared) == (split in CUTS_A_GROUP), holds_shared


def _check_lora(result: dict[str, dict]) -> None:
    # 7 adapted projections x 2 layers x (A, B)
    assert len(result) == 28, sorted(result)
    for n, r in result.items():
        laid_out = r["spec_follows_rule"] and r["local_shape_ok"]
        assert laid_out, f"{n}: not laid out per the LoRA rule"
        assert r["params_equal"], f"{n}: the ranks' pieces do not reassemble the reference"
        # same tolerance as every other gradient: fp32 reassociation of the sharded sums
        tol = ATOL + RTOL * r["grad_scale"]
        assert r["grad_err"] <= tol, f"{n}: reassembled gradient off by {r['grad_err']}"
        if "unsynced_err" in r:
            # Must-fail control: without the partial-gradient all-reduce the same
            # comparison fails (every split here has at least two ranks holding units).
            assert r["unsynced_err"] > 10 * tol, f"{n}: a partial gradient looked complete"
