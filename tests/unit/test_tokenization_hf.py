"""Token ids as transformers produces them, for tokenizers that add a BOS and ones that
do not: plain prompts (``tokenizer(text)``), chats (``apply_chat_template``), prompts
already formatted as chat text, and training sequences."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from xronos.data import (
    IGNORE_INDEX,
    Example,
    Tokenizer,
    builtin_tokenizer,
    encode_chat,
    encode_prompt,
    load_tokenizer,
    tokenize,
)
from xronos.data.formats import chat_example
from xronos.errors import UserError

transformers = pytest.importorskip("transformers")

#: Llama 3's template: the BOS is written by the template (its first message).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
#: SmolLM2's template: ChatML with a default system message; no BOS.
SMOLLM2 = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are "
    "a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: Qwen 2.5's template without tools (as a chat_template.jinja file).
QWEN = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Turn off the kitchen lights, please.",
    "command: lights off in the kitchen\naction: turn_off(device=light, room=kitchen)",
    "You are a helpful assistant. Set the thermostat to 21 degrees.",
] * 10
PROMPT = "command: lights off in the kitchen\naction:"
COMPLETION = " turn_off(device=light, room=kitchen)"
USER = [{"role": "user", "content": "Turn off the kitchen lights, please."}]
CHAT = [*USER, {"role": "assistant", "content": "turn_off(device=light, room=kitchen)"}]


def _bpe(specials: list[str], post_processor: Any) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on a few sentences, with ``specials`` as ids 0, 1, ..."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    if post_processor is not None:
        tok.post_processor = post_processor
    return tok


def _write(path: Path, tok: tokenizers.Tokenizer, config: dict[str, Any], **files: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def llama3(path: Path, bos_entry: bool = True) -> Path:
    """A TemplateProcessing post-processor adds ``<|begin_of_text|>``. Without
    ``bos_entry``, tokenizer_config.json names no bos_token (the template writes it)."""
    template = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", 0)],
    )
    post = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    tok = _bpe(LLAMA_SPECIALS, post)
    config: dict[str, Any] = {"eos_token": "<|eot_id|>"}
    if bos_entry:
        config.update(bos_token="<|begin_of_text|>", chat_template=LLAMA3)
        return _write(path, tok, config)
    literal = LLAMA3.replace("bos_token + content", "'<|begin_of_text|>' + content")
    return _write(path, tok, config, **{"chat_template.jinja": literal})


def smollm2(path: Path) -> Path:
    """bos_token ``<|im_start|>`` in tokenizer_config.json, but no post-processor adds it."""
    tok = _bpe(CHATML_SPECIALS, processors.ByteLevel(trim_offsets=True))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": SMOLLM2,
    }
    return _write(path, tok, config)


def qwen(path: Path) -> Path:
    """bos_token null; config.json still names ``<|endoftext|>`` as bos_token_id."""
    tok = _bpe(CHATML_SPECIALS, None)
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    model_config = json.dumps({"bos_token_id": 0, "eos_token_id": 2})
    return _write(path, tok, config, **{"chat_template.jinja": QWEN, "config.json": model_config})


def preset(path: Path) -> Path:
    """The built-in tokenizer, saved as a model directory."""
    builtin_tokenizer().save(path)
    return path


CASES: dict[str, Callable[[Path], Path]] = {
    "llama3": llama3,
    "llama3-no-bos-entry": lambda p: llama3(p, bos_entry=False),
    "smollm2": smollm2,
    "qwen": qwen,
    "preset": preset,
}


def _chat_ids(hf: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    ids = hf.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
    )
    return list(ids)


@pytest.mark.parametrize("case", CASES)
def test_prompts_tokenize_as_transformers_does(tmp_path: Path, case: str) -> None:
    model = CASES[case](tmp_path / case)
    hf = transformers.AutoTokenizer.from_pretrained(model)
    tok = load_tokenizer(model)
    assert encode_prompt(tok, PROMPT) == hf(PROMPT)["input_ids"]
    chat = _chat_ids(hf, USER, generation_prompt=True)
    assert encode_chat(tok, USER) == chat
    # the same prompt, given already formatted, gets the template's specials only
    formatted = hf.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert encode_prompt(tok, formatted) == chat


def test_the_bos_comes_from_the_post_processor_only(tmp_path: Path) -> None:
    smol, llama = load_tokenizer(smollm2(tmp_path / "s")), load_tokenizer(llama3(tmp_path / "l"))
    assert smol.bos_id == smol.encode("<|im_start|>")[0]  # named, but never added
    assert encode_prompt(smol, PROMPT) == smol.encode(PROMPT)
    assert encode_prompt(llama, PROMPT) == [0, *llama.encode(PROMPT)]
    assert encode_prompt(builtin_tokenizer(), "x")[0] == builtin_tokenizer().bos_id


@pytest.mark.parametrize("case", CASES)
def test_training_sequences_start_as_prompts_do(tmp_path: Path, case: str) -> None:
    model = CASES[case](tmp_path / case)
    hf = transformers.AutoTokenizer.from_pretrained(model)
    tok = load_tokenizer(model)
    assert tok.eos_id is not None
    ds = tokenize([Example.from_prompt(PROMPT, COMPLETION)], tok, seq_len=128)
    (ids,), (labels,) = ds.input_ids, ds.labels
    assert ids == [*hf(PROMPT + COMPLETION)["input_ids"], tok.eos_id]
    prompt = encode_prompt(tok, PROMPT)
    assert ids[: len(prompt)] == prompt  # as generation starts from the prompt
    assert labels == [IGNORE_INDEX] * len(prompt) + ids[len(prompt) :]


@pytest.mark.parametrize("case", CASES)
def test_chat_training_matches_apply_chat_template(tmp_path: Path, case: str) -> None:
    model = CASES[case](tmp_path / case)
    hf = transformers.AutoTokenizer.from_pretrained(model)
    tok = load_tokenizer(model)
    example = chat_example(CHAT, "x:1", tok)
    ds = tokenize([example], tok, seq_len=256)
    (ids,), (labels,) = ds.input_ids, ds.labels
    assert ids == _chat_ids(hf, CHAT, generation_prompt=False)
    # the eval prompt of a chat example is the generation prompt of its first turns
    prompt = encode_prompt(tok, example.prompt)
    assert prompt == _chat_ids(hf, USER, generation_prompt=True) == ids[: len(prompt)]
    assert all(x == IGNORE_INDEX for x in labels[: len(prompt)])
    trained = tok.decode([x for x in labels if x != IGNORE_INDEX], skip_special_tokens=False)
    assert trained.lstrip().startswith("turn_off(device=light, room=kitchen)")


@pytest.mark.parametrize(
    ("case", "flags"),
    [
        ("llama3", {"add_bos_token": False}),
        ("smollm2", {"add_bos_token": True}),
        ("smollm2", {"add_bos_token": True, "add_eos_token": True}),
        ("qwen", {"add_bos_token": True, "add_eos_token": True}),
    ],
)
def test_add_bos_and_eos_flags_leave_the_post_processor_alone(
    tmp_path: Path, case: str, flags: dict[str, bool]
) -> None:
    model = CASES[case](tmp_path / case)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
    hf = transformers.AutoTokenizer.from_pretrained(model)
    tok = load_tokenizer(model)
    assert encode_prompt(tok, PROMPT) == hf(PROMPT)["input_ids"]
    ds = tokenize([Example.from_prompt(PROMPT, COMPLETION)], tok, seq_len=128)
    (ids,), (labels,) = ds.input_ids, ds.labels
    assert ids == [*hf(PROMPT + COMPLETION)["input_ids"], tok.eos_id]
    assert labels[-1] == tok.eos_id


# -- xronos generate --chat -------------------------------------------------------------------
def _generate(monkeypatch: pytest.MonkeyPatch, *argv: str) -> list[tuple[int, ...]]:
    """Run ``xronos generate`` on the tiny preset; return the prompts it would decode from."""
    import xronos.cli.generate as cli

    prompts: list[tuple[int, ...]] = []

    def worker(ctx: Any, job: Any) -> list[list[int]]:
        prompts.extend(job.prompts)
        return [[2]]

    monkeypatch.setattr(cli, "generate_worker", worker)
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["generate", "--model", "tiny", "--max-new-tokens", "1", *argv])
    assert cli.run(args) == 0
    return prompts


def test_generate_chat_applies_the_template(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = builtin_tokenizer()
    text = "hall lights on"
    (plain,) = _generate(monkeypatch, "--prompt", text)
    (chat,) = _generate(monkeypatch, "--prompt", text, "--chat")
    assert list(plain) == encode_prompt(tok, text)
    messages = [{"role": "user", "content": text}]
    assert list(chat) == encode_chat(tok, messages) != list(plain)
    assert tok.decode(chat, skip_special_tokens=False) == "<bos>user: hall lights on\nassistant:"


def test_generate_chat_needs_a_chat_template(monkeypatch: pytest.MonkeyPatch) -> None:
    import xronos.cli.generate as cli

    plain = Tokenizer(builtin_tokenizer().backend, special_tokens={"eos": "<eos>"})
    monkeypatch.setattr(cli, "resolve_tokenizer", lambda model: plain)
    with pytest.raises(UserError) as info:
        _generate(monkeypatch, "--prompt", "hi", "--chat")
    assert str(info.value) == "--chat: tiny has no chat template; give the prompt without --chat"
