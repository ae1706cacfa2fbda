"""Exports load in peft and transformers and compute what Xronos computes.

Each test fine-tunes a few steps in one process (build_model + Trainer), saves a
checkpoint, exports it, loads the export with the Hugging Face libraries and compares
logits with the fine-tuned Xronos model's own.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.hf_models import make_checkpoint
from xronos.checkpoint import checkpoint_path, save_checkpoint
from xronos.comm.mappings import TPGroup
from xronos.config import ModelConfig, tiny
from xronos.data.builtin_tokenizer import builtin_tokenizer
from xronos.errors import UserError
from xronos.export import export_hf, export_peft
from xronos.model.llama import LlamaForCausalLM
from xronos.model.lora import LoRAConfig
from xronos.parallel.shard import build_model
from xronos.planner.plan import Plan
from xronos.train.batches import RandomBatches
from xronos.train.optim import OptimConfig
from xronos.train.trainer import Trainer

# fp32 on both sides; transformers/peft evaluate the same products in another order
# (fused attention kernel, LoRA branch added separately), which moves logits of magnitude
# ≲ 1 by a few 1e-7. A wrong or missing adapter moves them by > 1e-3 (asserted below).
ATOL = 1e-5


def _fine_tune(
    cfg: ModelConfig,
    run: Path,
    *,
    model_dir: Path | None,
    lora: LoRAConfig | None,
    seed: int,
    extra_model: dict,
) -> tuple[LlamaForCausalLM, Path]:
    plan = Plan.single(cfg)
    model = build_model(cfg, plan, TPGroup(), model_dir=model_dir, seed=seed, lora=lora)
    trainer = Trainer(model, cfg, plan, TPGroup(), OptimConfig(lr=1e-2 if lora else 2e-3))
    batches = RandomBatches(cfg.vocab_size, batch_size=2, seq_len=16, seed=4, repeat=True)
    for _ in range(4):
        trainer.step(batches.next_step())
    ckpt = checkpoint_path(run, trainer.steps_done)
    save_checkpoint(
        ckpt,
        model=model,
        optimizer=trainer.optimizer,
        step=trainer.steps_done,
        cfg=cfg,
        plan=plan,
        group=TPGroup(),
        extra={"model": extra_model, "data": {"epoch": 0, "position": 4}},
    )
    return model.eval(), ckpt


def _ids(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))


@contextmanager
def _no_warnings() -> Iterator[None]:
    """Fail on any warning (``warnings.warn``, e.g. peft's missing adapter keys) or any
    WARNING log record of transformers/peft (e.g. unexpected or missing weights). API
    deprecation notices between the two libraries (FutureWarning, DeprecationWarning)
    concern their own versions, not the files, and are let through."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(logging.WARNING)
    loggers = [logging.getLogger(n) for n in ("transformers", "peft")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    deprecations = (FutureWarning, DeprecationWarning)
    messages = [str(w.message) for w in caught if not issubclass(w.category, deprecations)]
    messages += [r.getMessage() for r in records]
    assert not messages, messages


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lora_run_exports_peft_adapter_and_merged_model(tmp_path: Path, arch: str) -> None:
    import transformers
    from peft import PeftModel

    base = tmp_path / "base"
    make_checkpoint(base, arch, seed=3)
    cfg = ModelConfig.from_pretrained(base)
    lora = LoRAConfig(r=4, alpha=8.0, dropout=0.05)
    ours, ckpt = _fine_tune(
        cfg,
        tmp_path / "run",
        model_dir=base,
        lora=lora,
        seed=0,
        extra_model={"dir": str(base), "seed": 0},
    )
    ids = _ids(cfg)
    with torch.no_grad():
        want = ours(ids)

    export_peft(ckpt, tmp_path / "adapter")
    with _no_warnings():
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    assert (_hf_logits(hf_base, ids) - want).abs().max() > 1e-3, "the adapters changed nothing"
    with _no_warnings():
        peft_model = PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    torch.testing.assert_close(_hf_logits(peft_model, ids), want, atol=ATOL, rtol=0)

    export_hf(ckpt, tmp_path / "merged")
    with _no_warnings():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(_hf_logits(merged, ids), want, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_full_fine_tune_exports_merged_model_only(tmp_path: Path) -> None:
    import transformers

    base = tmp_path / "base"
    make_checkpoint(base, "llama", tied=True, seed=4)
    cfg = ModelConfig.from_pretrained(base)
    ours, ckpt = _fine_tune(
        cfg,
        tmp_path / "run",
        model_dir=base,
        lora=None,
        seed=0,
        extra_model={"dir": str(base), "seed": 0},
    )
    ids = _ids(cfg)
    with torch.no_grad():
        want = ours(ids)
    with pytest.raises(UserError, match=r"fine-tuned all weights.*export --format hf"):
        export_peft(ckpt, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()

    export_hf(ckpt, tmp_path / "merged")
    with _no_warnings():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.config.tie_word_embeddings
    torch.testing.assert_close(_hf_logits(merged, ids), want, atol=ATOL, rtol=0)
    with _no_warnings():
        original = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    assert (_hf_logits(original, ids) - want).abs().max() > 1e-3, "training changed nothing"


@pytest.mark.slow
def test_preset_lora_run_exports_merged_model(tmp_path: Path) -> None:
    import transformers

    cfg = tiny()
    preset = {"preset": "tiny", "dir": None, "seed": 7}
    ours, ckpt = _fine_tune(
        cfg, tmp_path / "run", model_dir=None, lora=LoRAConfig(r=4), seed=7, extra_model=preset
    )
    ids = _ids(cfg)
    with torch.no_grad():
        want = ours(ids)
    tokenizer = builtin_tokenizer()
    export_hf(ckpt, tmp_path / "merged", tokenizer=tokenizer)
    with _no_warnings():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(_hf_logits(merged, ids), want, atol=ATOL, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    text = "turn on the kitchen light"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    # exporting again replaces the earlier export; a directory with other files is refused
    export_hf(ckpt, tmp_path / "merged", tokenizer=tokenizer)
    (tmp_path / "merged" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"exists and holds notes\.txt"):
        export_hf(ckpt, tmp_path / "merged", tokenizer=tokenizer)
