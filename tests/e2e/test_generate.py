"""``xronos generate`` on 1 and 3 processes prints what transformers' greedy generate does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_models import make_checkpoint, save_word_tokenizer
from xronos.cli import main

PROMPT = "please turn on the light in the kitchen"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generate_matches_transformers(
    tmp_path: Path, arch: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # GQA (8 q heads over 4 KV groups), untied for Llama and tied for Qwen2.
    ref = make_checkpoint(tmp_path, arch, tied=arch == "qwen2", vocab=64, seed=11)
    save_word_tokenizer(tmp_path, 64)
    from tokenizers import Tokenizer

    # The checkpoint's own tokenizer.json (AutoTokenizer would pick a Qwen2 BPE class).
    ids = torch.tensor([Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(PROMPT).ids])
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    want = " ".join(map(str, out[0, ids.shape[1] :].tolist()))
    common = ["generate", "--model", str(tmp_path), "--prompt", PROMPT, "--max-new-tokens", "16"]
    for extra in (["--devices", "3", "--shares", "2,1,1"], ["--devices", "1"]):
        capsys.readouterr()
        assert main([*common, *extra, "--ids"]) == 0
        assert capsys.readouterr().out.strip() == want, extra
