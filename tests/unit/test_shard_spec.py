"""Which K/V rows each rank holds and owns when the attention is split by query heads,
checked against a brute-force reading of the rule (docs/architecture.md, Units and the Plan)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xronos.config import ModelConfig
from xronos.parallel.spec import kv_heads, owned_spec, shard_spec, shared_kv_heads
from xronos.planner.plan import Plan

K = "model.layers.0.self_attn.k_proj.weight"


def _cfg(heads: int, kv: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        hidden_size=heads * 4,
        intermediate_size=32,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv,
    )


def _plan(cfg: ModelConfig, attn: tuple[int, ...]) -> Plan:
    base = Plan.from_shares(cfg, [1.0] * len(attn), mlp_chunk=8, vocab_chunk=8)
    return dataclasses.replace(base, attn=attn)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[ModelConfig, tuple[int, ...]]:
    kv = draw(st.integers(1, 4))
    cfg = _cfg(kv * draw(st.integers(1, 4)), kv)
    n = draw(st.integers(2, 5))
    cuts = sorted(draw(st.lists(st.integers(0, cfg.num_heads), min_size=n - 1, max_size=n - 1)))
    bounds = [0, *cuts, cfg.num_heads]
    return cfg, tuple(b - a for a, b in itertools.pairwise(bounds))


@given(_cases())
@settings(max_examples=200, deadline=None)
def test_held_and_owned_kv_rows_follow_the_rule(case: tuple[ModelConfig, tuple[int, ...]]) -> None:
    cfg, attn = case
    plan = _plan(cfg, attn)
    q, d = cfg.q_per_kv, cfg.head_dim
    holders: dict[int, list[int]] = {g: [] for g in range(cfg.num_kv_heads)}
    start = 0
    owned_rows: list[int] = []
    for r, n in enumerate(attn):
        heads = range(start, start + n)
        groups = sorted({h // q for h in heads})  # brute force: the groups its heads touch
        for g in groups:
            holders[g].append(r)
        held, own = shard_spec(K, cfg, plan, r), owned_spec(K, cfg, plan, r)
        assert held is not None and own is not None
        if groups:
            assert (held.start, held.end) == (groups[0] * d, (groups[-1] + 1) * d)
        else:  # a zero-head rank holds no K/V
            assert held.start == held.end
        assert list(range(*kv_heads(cfg, plan, r))) == groups
        # owner of a group = the rank holding its first query head
        mine = [g for g in groups if g * q in heads]
        assert list(range(own.start // d, own.end // d)) == mine
        assert own.start == own.end or held.start <= own.start <= own.end <= held.end
        owned_rows += mine
        start += n
    assert owned_rows == list(range(cfg.num_kv_heads))  # every row owned exactly once
    assert shared_kv_heads(cfg, plan) == tuple(g for g, rs in holders.items() if len(rs) > 1)


def test_a_cut_group_is_held_by_both_sides() -> None:
    cfg = _cfg(4, 2)  # 2 query heads per KV group
    plan = _plan(cfg, (2, 1, 1))
    assert [kv_heads(cfg, plan, r) for r in range(3)] == [(0, 1), (1, 2), (1, 2)]
    assert [kv_heads(cfg, plan, r, owned=True) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]
    assert shared_kv_heads(cfg, plan) == (1,)
    # a zero-head rank inside a group holds nothing
    plan = _plan(cfg, (1, 0, 3))
    assert [kv_heads(cfg, plan, r) for r in range(3)] == [(0, 1), (1, 1), (0, 2)]


@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
)
def test_query_heads_are_the_attention_unit(name: str) -> None:
    cfg = _cfg(4, 2)
    plan = _plan(cfg, (3, 1))
    d = cfg.head_dim
    assert shard_spec(name, cfg, plan, 0) == owned_spec(name, cfg, plan, 0)
    spec = shard_spec(name, cfg, plan, 1)
    assert spec is not None and (spec.start, spec.end) == (3 * d, 4 * d)
