"""The planner's byte counts and their scaling to a measured step."""

from __future__ import annotations

import pytest
import torch

from xronos.config import small
from xronos.model.llama import MLP
from xronos.profiler.bytes import base_bytes, memory_scale, unit_bytes, whole_need
from xronos.profiler.measure import Shape

SHAPE = Shape(cfg=small(), batch_size=4, seq_len=64, mlp_chunk=32, vocab_chunk=32)
MIB = 2**20


def test_the_scale_makes_the_whole_model_need_what_was_measured() -> None:
    counted = whole_need(SHAPE)
    for measured in (counted + 64 * MIB, 2 * counted):
        k = memory_scale(SHAPE, measured)
        assert k > 1
        # the per-unit and replicated bytes at that scale add up to the measurement (each
        # count rounds down to whole bytes: a few bytes per unit)
        assert whole_need(SHAPE, k) == pytest.approx(measured, abs=4096)


def test_the_scale_moves_activations_only_and_never_below_the_count() -> None:
    # a measurement under the count (memory the process had freed and took back) keeps it
    assert memory_scale(SHAPE, whole_need(SHAPE) // 2) == 1.0
    k = 1.5
    weights_only = unit_bytes(SHAPE, 0.0)
    for seg, b in unit_bytes(SHAPE, k).items():
        act = unit_bytes(SHAPE)[seg] - weights_only[seg]
        assert b - weights_only[seg] == pytest.approx(k * act, abs=1), seg
    assert base_bytes(SHAPE, 0.0) == 64 * MIB  # tied, full fine-tuning: the runtime's growth


def test_an_mlp_unit_counts_what_autograd_keeps() -> None:
    """The MLP's activation bytes per unit are what autograd saves for its backward (its
    weights and its input, the replicated norm's output, excluded): gate, its SiLU, up and
    their product, one value a token each per column."""
    cfg = SHAPE.cfg.replace(intermediate_size=SHAPE.mlp_chunk)  # one unit
    mlp = MLP(cfg)
    x = torch.randn(SHAPE.batch_size, SHAPE.seq_len, cfg.hidden_size, requires_grad=True)
    kept: dict[int, int] = {}
    skip = {t.untyped_storage().data_ptr() for t in (x, *mlp.parameters())}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            kept[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    per_layer = (unit_bytes(SHAPE)["mlp"] - unit_bytes(SHAPE, 0.0)["mlp"]) // cfg.num_layers
    assert sum(kept.values()) == per_layer
