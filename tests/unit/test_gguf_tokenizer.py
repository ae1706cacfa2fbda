"""Tokenizers rebuilt from GGUF metadata encode as the tokenizer.json they were written from,
with llama.cpp's pre-tokenizer rules chosen by ``tokenizer.ggml.pre``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_gguf_io import TEMPLATE, make_model, make_tokenizer
from xronos.export.gguf import write_gguf
from xronos.model.gguf_io import GGUFReader
from xronos.model.gguf_tokenizer import (
    PRE_FAMILIES,
    detect_pre,
    load_gguf_tokenizer,
    pre_tokenizer,
    tokenizer_from_gguf,
)

TEXTS = [
    "turn on the kitchen light please",
    "it's 7 o'clock, I'M home and YOU'RE late; don't",
    "set 21.5 degrees at 06:30 — 1234567890!!!",
    "   indented\tline\n\n  two spaces  \r\n end   ",
    "Ünïcödé wörds: café, 中文 $x=42 <think>hm</think>",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
]
STYLES = {"smollm": "smollm", "gpt2": "gpt-2", "llama3": "llama-bpe", "qwen2": "qwen2"}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One GGUF per pre-tokenizer style, with the tokenizer it was written from."""
    root = tmp_path_factory.mktemp("gguf_tok")
    _, state, config = make_model(root, "llama", tied=True)
    out = {}
    for style in STYLES:
        tok = make_tokenizer(style, bos=style == "llama3")
        path = root / f"{style}.gguf"
        write_gguf(path, state, config, tok, TEMPLATE, "f32", special_ids={"pad": 0})
        out[style] = (path, tok)
    return out


@pytest.mark.parametrize("style", list(STYLES))
def test_pre_tokenizer_is_detected_and_stored(written: dict, style: str) -> None:
    path, tok = written[style]
    assert detect_pre(tok) == STYLES[style]
    with GGUFReader(path) as r:
        assert r.metadata("tokenizer.ggml.pre") == STYLES[style]
        assert r.metadata("tokenizer.ggml.model") == "gpt2"
        assert len(r.metadata("tokenizer.ggml.tokens")) == 304  # padded to the embedding
        assert r.metadata("tokenizer.ggml.token_type")[-3:] == [5, 5, 5]  # UNUSED [PAD] rows
        assert r.metadata("tokenizer.ggml.add_bos_token") is (style == "llama3")


@pytest.mark.parametrize("style", list(STYLES))
def test_gguf_tokenizer_encodes_as_the_original(written: dict, style: str) -> None:
    path, tok = written[style]
    backend, special, template = tokenizer_from_gguf(path)
    for text in TEXTS:
        want = tok.encode(text, add_special_tokens=False).ids
        assert backend.encode(text, add_special_tokens=False).ids == want, text
        assert backend.decode(want, skip_special_tokens=False) == tok.decode(
            want, skip_special_tokens=False
        )
    assert special == {"bos": "<|im_start|>", "eos": "<|im_end|>", "pad": "<|endoftext|>"}
    assert template == TEMPLATE


def test_add_bos_and_special_tokens(written: dict) -> None:
    path, tok = written["llama3"]
    backend, _, _ = tokenizer_from_gguf(path)
    with_bos = backend.encode("hello", add_special_tokens=True).ids
    assert with_bos == tok.encode("hello", add_special_tokens=True).ids
    assert with_bos[0] == 1  # the config's bos_token_id
    think = tok.token_to_id("<think>")
    assert backend.encode("a<think>b").ids.count(think) == 1  # a user-defined token stays whole


def test_xronos_tokenizer_from_gguf(written: dict) -> None:
    path, _ = written["smollm"]
    t = load_gguf_tokenizer(path)
    assert (t.bos_id, t.eos_id, t.pad_id) == (1, 2, 0)
    text = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    assert t.encode(text)[0] == t.bos_id


def test_smollm_rule_splits_every_digit() -> None:
    """llama.cpp's ``smollm`` (and ``starcoder``/``refact``) isolate each digit before the
    GPT-2 split; ``llama-bpe`` groups up to three, ``gpt-2`` keeps the run whole."""

    def pieces(pre: str, text: str) -> list[str]:
        return [p for p, _ in pre_tokenizer(pre).pre_tokenize_str(text)]

    assert pieces("smollm", "in 2024") == ["in", "Ġ", "2", "0", "2", "4"]
    assert pieces("llama-bpe", "in 20245") == ["in", "Ġ", "202", "45"]
    assert pieces("qwen2", "in 2024") == ["in", "Ġ", "2", "0", "2", "4"]
    assert pieces("gpt-2", "in 2024") == ["in", "Ġ2024"]
    assert pieces("default", "a+b 1234") == ["a", "+", "b", "Ġ", "123", "4"]
    assert PRE_FAMILIES["starcoder"] == PRE_FAMILIES["smollm"]


def test_unknown_pre_tokenizer_is_a_user_error() -> None:
    from xronos.errors import UserError

    with pytest.raises(UserError, match="not supported"):
        pre_tokenizer("tekken")


def test_real_smollm2_tokenizer() -> None:
    from tests.unit.test_gguf_io import smollm2_file

    path: Path = smollm2_file()
    backend, special, template = tokenizer_from_gguf(path)
    assert special["bos"] == "<|im_start|>" and special["eos"] == "<|im_end|>"
    assert template is not None and "<|im_start|>" in template
    enc = backend.encode("It is 2024.", add_special_tokens=False)
    assert enc.tokens == ["It", "Ġis", "Ġ", "2", "0", "2", "4", "."]
    assert backend.encode("<|im_start|>user").ids[0] == 1
