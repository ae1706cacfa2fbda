"""Bad input gets one clear line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.hf_models import make_checkpoint, save_word_tokenizer
from xronos.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()  # drop what setting up the checkpoint printed
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def _assert_one_line(code: int, err: str, *needles: str) -> None:
    assert code != 0
    assert len(err.splitlines()) == 1, err
    assert err.startswith("xronos: error: ")
    for n in needles:
        assert n in err, err


def test_unknown_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, err = _run(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    _assert_one_line(code, err, "FalconForCausalLM", "LlamaForCausalLM")


def test_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    _assert_one_line(code, err, "nope", "preset")


def test_missing_weights_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_checkpoint(tmp_path)
    save_word_tokenizer(tmp_path, 96)
    (tmp_path / "model.safetensors").unlink()
    code, err = _run(capsys, "generate", "--model", str(tmp_path), "--prompt", "the light")
    _assert_one_line(code, err, "model.safetensors")


def test_tokenizer_larger_than_vocabulary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_checkpoint(tmp_path, vocab=16)
    save_word_tokenizer(tmp_path, 64)  # 23 tokens > 16 rows
    code, err = _run(capsys, "generate", "--model", str(tmp_path), "--prompt", "the light")
    _assert_one_line(code, err, "16", "tokenizer")


@pytest.mark.parametrize(
    ("shares", "needle"),
    [("2,1", "2 entries but --devices is 3"), ("2,0,1", "positive"), ("2,x,1", "numbers")],
)
def test_bad_shares(capsys: pytest.CaptureFixture[str], shares: str, needle: str) -> None:
    code, err = _run(capsys, "generate", "--prompt", "hi", "--devices", "3", "--shares", shares)
    _assert_one_line(code, err, needle)
