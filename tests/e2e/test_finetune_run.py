"""`xronos finetune` end to end: resume (also onto another cluster), NaN stop, export,
generate from a run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from xronos.checkpoint import complete_checkpoints
from xronos.cli import main

SMALL = [
    "--train-size",
    "96",
    "--batch-size",
    "8",
    "--seq-len",
    "48",
    "--eval-size",
    "2",
    "--max-new-tokens",
    "4",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "2",
    "--no-emulate",
    "--comm-dtype",
    "fp32",  # exact payloads: the losses are compared with single's
]
# Losses of a resumed run equal the uninterrupted run's: same data order (the batcher's
# position is in the checkpoint), same optimizer state. Onto another plan only the order of
# the all-reduce sums changes: at most 2.4e-7 relative measured; 1e-5 (docs/architecture.md,
# Exactness).
LOSS_RTOL = 1e-5


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _ok(*argv: str) -> None:
    assert main(list(argv)) == 0


@pytest.mark.slow
def test_resume_matches_uninterrupted_and_reshards(tmp_path: Path) -> None:
    whole, part = tmp_path / "whole", tmp_path / "part"
    common = [*SMALL, "--cluster", "ci-2dev", "--strategy", "tp-even"]
    _ok("finetune", *common, "--steps", "6", "--save-every", "3", "--out", str(whole))
    _ok("finetune", *common, "--steps", "3", "--out", str(part))
    # continue on three devices under the Xronos plan: a 2-device checkpoint, resharded
    _ok(
        "finetune",
        "--resume",
        str(part),
        "--steps",
        "6",
        "--cluster",
        "default",
        "--strategy",
        "xronos",
        "--no-emulate",
    )
    # a pipeline's checkpoint holds its stages' AdamW state: it resumes as a pipeline
    pipe = tmp_path / "pipe"
    piped = [*SMALL, "--cluster", "ci-2dev", "--strategy", "pp-1f1b"]
    _ok("finetune", *piped, "--steps", "3", "--out", str(pipe))
    _ok("finetune", "--resume", str(pipe), "--steps", "6", "--no-emulate")
    want, got = _losses(whole), _losses(part)
    piped_losses = _losses(pipe)
    assert sorted(piped_losses) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert piped_losses[step] == pytest.approx(want[step], rel=LOSS_RTOL), step
    # devices.json names each device's worker as it was started (the resumed run's three)
    table = json.loads((part / "devices.json").read_text())["devices"]
    assert [d["rank"] for d in table] == [0, 1, 2] and all(d["pid"] > 0 for d in table)
    assert all(d["cgroups"] == [] for d in table)  # not emulated
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert got[step] == pytest.approx(want[step], rel=LOSS_RTOL), step
    assert want[6] < want[1], "the run should learn"


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_last_good_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "nan"
    code = main(
        [
            "finetune",
            *SMALL,
            "--cluster",
            "ci-2dev",
            "--steps",
            "8",
            "--save-every",
            "1",
            "--lr",
            "1e30",
            "--max-grad-norm",
            "0",
            "--warmup-steps",
            "0",
            "--out",
            str(run),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2, err
    assert "at step" in err and "last good checkpoint is" in err, err
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts and all((run / "checkpoints" / c / "COMPLETE").is_file() for c in ckpts)


@pytest.mark.slow
def test_export_and_generate_from_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    from xronos.data import encode_prompt, resolve_tokenizer

    run = tmp_path / "lora"
    _ok(
        "finetune",
        *SMALL,
        "--cluster",
        "ci-2dev",
        "--steps",
        "3",
        "--no-full",
        "--lora-rank",
        "4",
        "--out",
        str(run),
    )
    text = "command: lights off in the kitchen\naction:"
    prompt = ["--prompt", text, "--max-new-tokens", "6"]
    capsys.readouterr()
    _ok("generate", "--model", str(run), *prompt, "--ids")
    one = capsys.readouterr().out.strip()
    _ok("generate", "--model", str(run), *prompt, "--ids", "--devices", "2", "--shares", "3,1")
    assert capsys.readouterr().out.strip() == one

    _ok("export", str(run), "--format", "hf", "--out", str(tmp_path / "hf"))
    _ok("export", str(run), "--format", "peft", "--out", str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([encode_prompt(resolve_tokenizer("tiny"), text)])
    with torch.no_grad():
        out = merged.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    # the merged export continues the prompt exactly as Xronos does from the run directory
    assert " ".join(map(str, out[0, ids.shape[1] :].tolist())) == one


@pytest.mark.slow
def test_every_strategy_follows_the_same_losses(tmp_path: Path) -> None:
    """Same data, same seed, same mathematics: the pipeline and tensor-parallel strategies
    of `xronos finetune` reproduce the single-device losses, with activation checkpointing
    too."""
    runs = {}
    for name in ("single", "xronos", "pp-gpipe", "pp-1f1b", "xronos --gradient-checkpointing"):
        strategy, *extra = name.split()
        runs[name] = tmp_path / name.replace(" ", "")
        _ok(
            "finetune",
            *SMALL,
            *extra,
            "--cluster",
            "ci-2dev",
            "--strategy",
            strategy,
            "--steps",
            "3",
            "--eval-size",
            "0",
            "--out",
            str(runs[name]),
        )
    checkpointed = json.loads((runs[name] / "config.json").read_text())["config"]
    assert checkpointed["gradient_checkpointing"] is True
    want = _losses(runs["single"])
    for strategy, run in runs.items():
        got = _losses(run)
        assert got.keys() == want.keys(), strategy
        for step, loss in want.items():
            assert got[step] == pytest.approx(loss, rel=LOSS_RTOL), (strategy, step)


@pytest.mark.slow
def test_resume_of_an_incompatible_run_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "full"
    _ok(
        "finetune",
        *SMALL,
        "--cluster",
        "ci-2dev",
        "--steps",
        "2",
        "--eval-size",
        "0",
        "--out",
        str(run),
    )
    capsys.readouterr()
    code = main(
        [
            "finetune",
            "--resume",
            str(run),
            "--steps",
            "4",
            "--no-full",
            "--lora-rank",
            "4",
            "--no-emulate",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("xronos: error: "), err
    assert "was written for full fine-tuning" in err[0] and "LoRA" in err[0], err


@pytest.mark.slow
def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    """As Hugging Face's ``save_total_limit``: older checkpoints go as newer ones land, and
    a resume continues from the newest and keeps the limit (it is in the run's config)."""
    run = tmp_path / "run"
    tiny = ["--model", "tiny", "--cluster", "ci-2dev", "--strategy", "tp-even", "--no-emulate"]
    tiny += ["--eval-size", "0"]
    _ok(
        "finetune",
        *tiny,
        "--steps",
        "5",
        "--save-every",
        "1",
        "--save-total-limit",
        "2",
        "--out",
        str(run),
    )
    assert [p.name for _, p in complete_checkpoints(run)] == ["step-00000004", "step-00000005"]
    _ok("finetune", "--resume", str(run), "--steps", "7", "--no-emulate")
    assert [p.name for _, p in complete_checkpoints(run)] == ["step-00000006", "step-00000007"]
    # without a limit, --save-every keeps them all
    _ok("finetune", *tiny, "--steps", "3", "--save-every", "1", "--out", str(tmp_path / "all"))
    assert len(complete_checkpoints(tmp_path / "all")) == 3
