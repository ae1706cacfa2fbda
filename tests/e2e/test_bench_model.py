"""``xronos bench --model PATH_OR_PRESET --lora-rank R``: the scenario's workload on another
model; bench.json records what ran, and what ran is that model (its first loss is the
checkpoint's own loss on the bench's first batch, as transformers computes it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_models import make_checkpoint
from xronos.cli import build_parser, main
from xronos.cli.bench import CHECKPOINT_LORA_RANK, workload
from xronos.errors import UserError
from xronos.train.batches import RandomBatches

# Same model, same batch, fp32: our loss and transformers' agree to reassociation (2.8e-8
# relative measured).
LOSS_RTOL = 1e-5


def _workload(*argv: str) -> tuple[str, int]:
    scenario, source = workload(build_parser().parse_args(["bench", "--scenario", "smoke", *argv]))
    rank = source.lora.r if source.lora else 0
    assert rank == scenario.lora_rank
    return scenario.model, rank


def test_model_and_rank_overrides(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "ckpt")
    ckpt = str(tmp_path / "ckpt")
    assert _workload() == ("small", 0)  # the scenario's own: a preset, full fine-tuning
    assert _workload("--model", "tiny") == ("tiny", 0)  # a preset stays full, as finetune
    assert _workload("--model", ckpt) == (ckpt, CHECKPOINT_LORA_RANK)  # a checkpoint: LoRA
    assert _workload("--model", ckpt, "--lora-rank", "4") == (ckpt, 4)
    assert _workload("--model", ckpt, "--lora-rank", "0") == (ckpt, 0)  # full, on request
    assert _workload("--lora-rank", "2") == ("small", 2)
    shaped, _ = workload(
        build_parser().parse_args(["bench", "--batch-size", "3", "--seq-len", "9"])
    )
    assert (shaped.batch_size, shaped.seq_len) == (3, 9)
    _, source = workload(build_parser().parse_args(["bench", "--model", ckpt]))
    assert source.model_dir == str(Path(ckpt).resolve()) and source.cfg.hidden_size == 64


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "no/such/dir"], "no such directory and not a preset"),
        (["--model", "missing.gguf"], "no such GGUF file"),
        (["--lora-rank", "-3"], "--lora-rank must be ≥ 1, or 0 for full fine-tuning"),
        (["--seq-len", "1"], "--batch-size must be ≥ 1 and --seq-len ≥ 2"),
        (["--batch-size", "0"], "--batch-size must be ≥ 1 and --seq-len ≥ 2"),
        (["--seq-len", "4096"], "--seq-len 4096 exceeds the model's context of 1024 tokens"),
    ],
)
def test_bad_model_or_rank_is_one_line(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UserError, match=needle.replace("(", r"\(")):
        workload(build_parser().parse_args(["bench", *argv]))
    out = tmp_path / "b"
    assert main(["bench", "--scenario", "smoke", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err
    assert not out.exists()


def _reference_loss(ckpt: Path, vocab: int, batch: int, seq: int) -> float:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    ids, labels = RandomBatches(vocab, batch, seq, seed=0).next_step()[0]
    with torch.no_grad():
        return float(model(input_ids=ids, labels=labels).loss)


@pytest.mark.slow
def test_bench_runs_a_saved_checkpoint_with_lora(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, vocab=96, hidden=64, layers=2, heads=8, kv_heads=4)
    out = tmp_path / "bench"
    argv = ["bench", "--scenario", "smoke", "--model", str(ckpt), "--lora-rank", "4"]
    argv += ["--comm-dtype", "fp32"]  # exact payloads: the losses are compared
    argv += ["--strategies", "xronos,single", "--steps", "1", "--warmup", "0", "--out", str(out)]
    assert main(argv) == 0
    bench = json.loads((out / "bench.json").read_text())
    assert bench["model"] == str(ckpt)
    work = bench["workload"]
    assert work["model_path"] == str(ckpt.resolve()) and not work["preset"]
    assert (work["training"], work["lora_rank"]) == ("lora", 4)
    assert (work["layers"], work["hidden_size"], work["vocab_size"]) == (2, 64, 96)
    assert (work["batch_size"], work["seq_len"]) == (4, 16)  # the smoke scenario's batch
    # LoRA's B starts at zero: the first step's loss is the checkpoint's own
    want = _reference_loss(ckpt, 96, 4, 16)
    for name in ("xronos", "single"):
        assert bench["strategies"][name]["losses"][0] == pytest.approx(want, rel=LOSS_RTOL), name
