"""Checkpoints in one process: round trip, atomicity, no pickle, refusing a wrong resume."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import xronos.checkpoint.save as save_mod
from xronos.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
)
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig
from xronos.errors import UserError
from xronos.model.llama import LlamaForCausalLM
from xronos.model.lora import LoRAConfig
from xronos.parallel.shard import build_model
from xronos.parallel.spec import shard_spec
from xronos.planner.plan import Plan
from xronos.train.batches import RandomBatches
from xronos.train.optim import OptimConfig
from xronos.train.trainer import Trainer

CFG = ModelConfig(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
)
LORA = LoRAConfig(r=4, alpha=8.0, dropout=0.1)
EXTRA = {"model": {"preset": "test", "seed": 5}, "data": {"epoch": 0, "position": 2}}


def _trained(
    lora: LoRAConfig | None, cfg: ModelConfig = CFG, seed: int = 5, steps: int = 2
) -> tuple[LlamaForCausalLM, Trainer]:
    plan = Plan.single(cfg)
    model = build_model(cfg, plan, TPGroup(), seed=seed, lora=lora)
    trainer = Trainer(model, cfg, plan, TPGroup(), OptimConfig(lr=1e-2))
    batches = RandomBatches(cfg.vocab_size, batch_size=2, seq_len=8, seed=1)
    for _ in range(steps):
        trainer.step(batches.next_step())
    return model, trainer


def _save(ckpt: Path, model: LlamaForCausalLM, trainer: Trainer, cfg: ModelConfig = CFG) -> None:
    save_checkpoint(
        ckpt,
        model=model,
        optimizer=trainer.optimizer,
        step=trainer.steps_done,
        cfg=cfg,
        plan=Plan.single(cfg),
        group=TPGroup(),
        extra=EXTRA,
    )


def _load(ckpt: Path, model: LlamaForCausalLM, trainer: Trainer, cfg: ModelConfig = CFG) -> dict:
    loaded = load_checkpoint(
        ckpt,
        model=model,
        optimizer=trainer.optimizer,
        cfg=cfg,
        plan=Plan.single(cfg),
        group=TPGroup(),
    )
    trainer.steps_done = loaded.step
    return loaded.extra


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_round_trip_restores_params_optimizer_and_step(tmp_path: Path, lora: LoRAConfig) -> None:
    model, trainer = _trained(lora, steps=3)
    ckpt = checkpoint_path(tmp_path, trainer.steps_done)
    _save(ckpt, model, trainer)
    fresh, fresh_trainer = _trained(lora, steps=0)
    assert _load(ckpt, fresh, fresh_trainer) == EXTRA
    assert fresh_trainer.steps_done == 3
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, q), name  # frozen ones rebuilt from the seed, others loaded
        if p.requires_grad:
            want, got = trainer.optimizer.state[p], fresh_trainer.optimizer.state[q]
            assert want.keys() == got.keys() == {"step", "exp_avg", "exp_avg_sq"}
            for kind in want:
                assert torch.equal(want[kind], got[kind]), f"{name} {kind}"


def test_a_shard_resumed_from_a_whole_model_takes_the_same_update(tmp_path: Path) -> None:
    """A checkpoint of one device loaded onto rank 1 of two: every trained tensor's next
    AdamW step equals the whole model's, sliced. The row-parallel ones (o_proj, down_proj)
    take a column slice of the saved moments, which the fused kernel must get contiguous."""
    model, trainer = _trained(None, steps=3)
    ckpt = checkpoint_path(tmp_path, trainer.steps_done)
    _save(ckpt, model, trainer)
    plan = Plan.even(CFG, ["a", "b"])
    group = TPGroup(rank=1, size=2).silent()
    shard = build_model(CFG, plan, group, seed=5)
    shard_trainer = Trainer(shard, CFG, plan, group, OptimConfig(lr=1e-2))
    load_checkpoint(
        ckpt, model=shard, optimizer=shard_trainer.optimizer, cfg=CFG, plan=plan, group=group
    )
    gen = torch.Generator().manual_seed(2)
    whole = dict(model.named_parameters())
    sliced = 0
    for name, q in shard.named_parameters():
        p = whole[name]
        p.grad = torch.randn(p.shape, generator=gen)
        spec = shard_spec(name, CFG, plan, 1)
        part = p.grad if spec is None else p.grad.narrow(spec.dim, spec.start, q.shape[spec.dim])
        q.grad = part.clone()
        sliced += spec is not None and spec.dim == 1
    assert sliced >= 2  # o_proj and down_proj at least: the strided case is exercised
    trainer.optimizer.step()
    shard_trainer.optimizer.step()
    for name, q in shard.named_parameters():
        p, spec = whole[name], shard_spec(name, CFG, plan, 1)
        want = p if spec is None else p.narrow(spec.dim, spec.start, q.shape[spec.dim])
        # the same elementwise update on the same numbers: bit for bit
        assert torch.equal(q.detach(), want.detach()), name


def test_latest_checkpoint_takes_the_newest_complete_one(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    model, trainer = _trained(LORA)
    for step in (2, 10):
        _save(checkpoint_path(tmp_path, step), model, trainer)
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 10)
    # a later save that never finished: renamed into place but no COMPLETE marker
    unfinished = checkpoint_path(tmp_path, 20)
    _save(unfinished, model, trainer)
    (unfinished / "COMPLETE").unlink()
    (tmp_path / "checkpoints" / "step-00000030.tmp-4242").mkdir()  # a killed save's staging
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 10)
    with pytest.raises(UserError, match="incomplete"):
        read_checkpoint_meta(unfinished)
    # saving the same step again replaces the unfinished directory
    _save(unfinished, model, trainer)
    assert latest_checkpoint(tmp_path) == unfinished


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), RuntimeError("boom")])
def test_crash_while_writing_leaves_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    model, trainer = _trained(LORA)
    _save(checkpoint_path(tmp_path, 2), model, trainer)
    real_write = save_mod.write_tensors

    def crashing_write(path: Path, tensors: dict[str, Any], metadata: dict[str, str]) -> None:
        half = dict(list(tensors.items())[: len(tensors) // 2])
        real_write(path, half, metadata)  # half of the file reached the disk
        raise error

    monkeypatch.setattr(save_mod, "write_tensors", crashing_write)
    target = checkpoint_path(tmp_path, 4)
    with pytest.raises(UserError if isinstance(error, OSError) else RuntimeError) as info:
        _save(target, model, trainer)
    if isinstance(error, OSError):
        assert str(info.value).startswith(f"could not write checkpoint {target}: ")
    assert not target.exists()
    assert sorted(p.name for p in target.parent.iterdir()) == ["step-00000002"]
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 2)


def test_crash_before_the_marker_leaves_an_ignored_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, trainer = _trained(None)
    _save(checkpoint_path(tmp_path, 2), model, trainer)

    def no_marker(path: Path, text: str) -> None:
        raise RuntimeError("killed before COMPLETE")

    monkeypatch.setattr(save_mod, "atomic_write_text", no_marker)
    with pytest.raises(RuntimeError, match="killed"):
        _save(checkpoint_path(tmp_path, 4), model, trainer)
    assert checkpoint_path(tmp_path, 4).is_dir()
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 2)


def _is_safetensors(path: Path) -> bool:
    """safetensors = u64 header length + JSON header + raw tensor bytes (no code)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return 8 + n + end == len(data)


def test_files_are_json_or_safetensors_and_load_never_unpickles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, trainer = _trained(LORA)
    ckpt = checkpoint_path(tmp_path, 2)
    _save(ckpt, model, trainer)
    for f in ckpt.iterdir():
        if f.suffix == ".safetensors":
            assert _is_safetensors(f), f.name
        else:
            json.loads(f.read_text())  # index.json, meta.json, COMPLETE
    assert {f.name for f in ckpt.iterdir()} == {
        "rank0.safetensors",
        "index.json",
        "meta.json",
        "COMPLETE",
    }

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a checkpoint load must not unpickle")

    for mod, attr in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(mod, attr, forbidden)
    fresh, fresh_trainer = _trained(LORA, steps=0)
    assert _load(ckpt, fresh, fresh_trainer) == EXTRA


@pytest.fixture(scope="module")
def lora_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, trainer = _trained(LORA)
    ckpt = tmp_path_factory.mktemp("run") / "ckpt"
    _save(ckpt, model, trainer)
    return ckpt


@pytest.mark.parametrize(
    ("cfg", "lora", "seed", "message"),
    [
        (
            CFG.replace(hidden_size=64),
            LORA,
            5,
            "was written for a model with hidden_size=32 but this model has hidden_size=64; "
            "resume with the model it was trained on (model test)",
        ),
        (
            CFG.replace(vocab_size=128),
            LORA,
            5,
            "was written for a model with vocab_size=100 but this model has vocab_size=128;",
        ),
        (
            CFG,
            None,
            5,
            "was written for LoRA r=4, alpha=8, targets down_proj,gate_proj,k_proj,o_proj,"
            "q_proj,up_proj,v_proj but this run uses full fine-tuning (no LoRA); "
            "resume with the same LoRA settings",
        ),
        (CFG, LoRAConfig(r=8, alpha=8.0), 5, "but this run uses LoRA r=8, alpha=8,"),
        (
            CFG,
            LoRAConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj")),
            5,
            "but this run uses LoRA r=4, alpha=8, targets q_proj,v_proj;",
        ),
        (
            CFG,
            LORA,
            6,
            "was written for other base weights than this model's (model test); "
            "resume with the base model it was trained on",
        ),
    ],
    ids=["hidden", "vocab", "lora-vs-full", "rank", "targets", "base-weights"],
)
def test_incompatible_resume_names_the_difference(
    lora_ckpt: Path, cfg: ModelConfig, lora: LoRAConfig | None, seed: int, message: str
) -> None:
    model = build_model(cfg, Plan.single(cfg), TPGroup(), seed=seed, lora=lora)
    trainer = Trainer(model, cfg, Plan.single(cfg), TPGroup(), OptimConfig())
    with pytest.raises(UserError) as info:
        _load(lora_ckpt, model, trainer, cfg)
    text = str(info.value)
    assert text.startswith(f"checkpoint {lora_ckpt} was written for ")
    assert message in text
    assert "\n" not in text


def test_full_checkpoint_refuses_a_lora_run(tmp_path: Path) -> None:
    model, trainer = _trained(None)
    _save(tmp_path / "ckpt", model, trainer)
    lora_model, lora_trainer = _trained(LORA, steps=0)
    with pytest.raises(UserError, match=r"written for full fine-tuning .* but this run uses LoRA"):
        _load(tmp_path / "ckpt", lora_model, lora_trainer)


def test_truncated_file_is_reported_as_damaged(lora_ckpt: Path, tmp_path: Path) -> None:
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(lora_ckpt, damaged)
    with open(damaged / "rank0.safetensors", "r+b") as f:
        f.truncate(100)
    model, trainer = _trained(LORA, steps=0)
    with pytest.raises(UserError, match=r"is damaged: rank0\.safetensors has 100 bytes"):
        _load(damaged, model, trainer)
