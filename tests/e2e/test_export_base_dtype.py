"""A LoRA run over a bf16 base (``--base-dtype bf16``): the base is held in bf16, adapters
and optimizer state in fp32, and the export rebuilds the bf16 base it trained on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.test_export import _hf_logits, _ids
from tests.hf_models import make_checkpoint
from xronos.checkpoint import checkpoint_path, read_checkpoint_meta, save_checkpoint
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.export import export_hf
from xronos.export.merged import merged_state_dict
from xronos.model.lora import LoRAConfig
from xronos.planner.plan import Plan
from xronos.train.batches import RandomBatches
from xronos.train.optim import OptimConfig
from xronos.train.source import ModelSource
from xronos.train.trainer import Trainer

tf = pytest.importorskip("transformers")


@pytest.mark.slow
def test_bf16_base_trains_fp32_adapters_and_exports(tmp_path: Path) -> None:
    base = tmp_path / "base"
    make_checkpoint(base, "llama", seed=3)
    src = ModelSource.from_name(str(base), lora=LoRAConfig(r=4, alpha=8.0))
    src = ModelSource(**{**src.__dict__, "base_dtype": torch.bfloat16})
    cfg: ModelConfig = src.cfg
    plan = Plan.single(cfg)
    model = src.build(plan, TPGroup())
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    trainer = Trainer(model, cfg, plan, TPGroup(), OptimConfig(lr=1e-2))
    batches = RandomBatches(cfg.vocab_size, batch_size=2, seq_len=16, seed=4, repeat=True)
    for _ in range(4):
        trainer.step(batches.next_step())
    states = [s for s in trainer.optimizer.state.values() if s]
    assert states and all(v.dtype == torch.float32 for s in states for v in s.values() if v.ndim)
    ckpt = checkpoint_path(tmp_path / "run", trainer.steps_done)
    save_checkpoint(
        ckpt,
        model=model,
        optimizer=trainer.optimizer,
        step=trainer.steps_done,
        cfg=cfg,
        plan=plan,
        group=TPGroup(),
        extra={"model": {"dir": str(base), "seed": 0}, "data": {"epoch": 0, "position": 4}},
    )
    assert read_checkpoint_meta(ckpt)["base"]["dtype"] == "bfloat16"
    export_hf(ckpt, tmp_path / "merged")
    saved = load_file(tmp_path / "merged" / "model.safetensors")
    with torch.no_grad():
        live = merged_state_dict(model)
    # The export rebuilt the same bf16 base and merged the same adapters: bit-identical.
    assert saved.keys() == live.keys()
    for name, t in live.items():
        assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], t), name
    base_q = load_file(base / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    q = saved["model.layers.0.self_attn.q_proj.weight"].float()
    assert (q - base_q.bfloat16().float()).abs().max() > 1e-3, "the adapters changed nothing"
    merged = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = _ids(cfg)
    with torch.no_grad():
        want = model.eval()(ids).float()
    got = _hf_logits(merged, ids).float()
    # Both compute in bf16 (8 mantissa bits, ~0.4 % per rounding) in different orders;
    # over two layers logits of magnitude ~1 differ by a few 1e-2 at most.
    assert (got - want).abs().max() < 0.1
