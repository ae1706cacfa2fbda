"""Loading Hugging Face checkpoints: each rank reads only its slices; configs in v4/v5 shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_models import make_checkpoint
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.parallel.shard import build_model
from xronos.parallel.spec import shard_spec
from xronos.planner.plan import Plan


def _poison_outside(path: Path, cfg: ModelConfig, plan: Plan, rank: int) -> dict:
    """Overwrite every element that ``rank`` must not read with NaN; return clean tensors."""
    clean = load_file(path / "model.safetensors")
    poisoned = {}
    for name, t in clean.items():
        spec = shard_spec(name, cfg, plan, rank)
        p = t.clone()
        if spec is not None:
            keep = p.narrow(spec.dim, spec.start, spec.end - spec.start).clone()
            p.fill_(float("nan"))
            p.narrow(spec.dim, spec.start, spec.end - spec.start).copy_(keep)
        poisoned[name] = p
    save_file(poisoned, path / "model.safetensors", metadata={"format": "pt"})
    return clean


# 8 query heads in 4 KV groups: 2 : 1 : 1 gives whole groups (4 : 2 : 2 heads); 3 : 3 : 2
# cuts group 1, whose K/V rows ranks 0 and 1 both read.
@pytest.mark.parametrize("shares", [[2, 1, 1], [3, 3, 2]], ids=["2-1-1", "3-3-2"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_rank_reads_only_its_slices(
    tmp_path: Path, tied: bool, rank: int, shares: list[float]
) -> None:
    make_checkpoint(tmp_path, "llama", tied=tied)
    cfg = ModelConfig.from_pretrained(tmp_path)
    plan = Plan.from_shares(cfg, shares, mlp_chunk=8, vocab_chunk=8)
    clean = _poison_outside(tmp_path, cfg, plan, rank)
    # A fake 3-rank group: build_model only creates the seams, it does not communicate.
    model = build_model(cfg, plan, TPGroup(rank=rank, size=3), model_dir=tmp_path)
    for name, p in model.named_parameters():
        spec = shard_spec(name, cfg, plan, rank)
        want = clean[name]
        if spec is not None:
            want = want.narrow(spec.dim, spec.start, spec.end - spec.start)
        assert torch.isfinite(p).all(), f"{name}: read bytes of another rank"
        assert torch.equal(p.detach(), want), name


def test_sharded_index_checkpoint(tmp_path: Path) -> None:
    ref = make_checkpoint(tmp_path, "qwen2", max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg = ModelConfig.from_pretrained(tmp_path)
    model = build_model(cfg, Plan.single(cfg), TPGroup(), model_dir=tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-5, rtol=1e-4)


def test_config_v4_and_v5_shapes_agree() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    v4 = ModelConfig.from_hf_dict(
        {**base, "rope_theta": 5e5, "rope_scaling": scaling, "torch_dtype": "bfloat16"}
    )
    v5 = ModelConfig.from_hf_dict(
        {**base, "rope_parameters": {**scaling, "rope_theta": 5e5}, "dtype": "bfloat16"}
    )
    assert v4 == v5
    assert v4.rope_theta == 5e5 and v4.rope_scaling == scaling


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    ref = make_checkpoint(tmp_path, "llama", rope_scaling=scaling)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    model = build_model(cfg, Plan.single(cfg), TPGroup(), model_dir=tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (1, 100))  # past the original context
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope type 'yarn'"),
    ],
)
def test_unsupported_config_is_one_clear_line(tmp_path: Path, change: dict, needle: str) -> None:
    make_checkpoint(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(UserError) as err:
        ModelConfig.from_pretrained(tmp_path)
    assert needle in str(err.value) and "supported" in str(err.value)
    assert "\n" not in str(err.value)
