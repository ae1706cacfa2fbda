"""Tokenizers: Hugging Face model directories, chat templates and the built-in tokenizer."""

from __future__ import annotations

import json
import string
from collections.abc import Mapping
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from xronos.config import tiny
from xronos.data import builtin_tokenizer, check_vocab, load_tokenizer, resolve_tokenizer
from xronos.data.builtin_tokenizer import VOCAB_SIZE
from xronos.errors import UserError

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: Llama-3 style: BOS variable, role check through raise_exception, loop controls.
LLAMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% if m['content'] == 'skip' %}{% continue %}{% endif %}"
    "{{ '<|start|>' + m['role'] + '\\n\\n' + m['content'] | trim + '<|eot|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant\\n\\n' }}{% endif %}"
)
#: Block tags on their own lines (trim_blocks/lstrip_blocks matter) and the tojson filter.
MULTILINE = """{% for m in messages %}
    {% if m['role'] == 'system' %}
<<SYS>>{{ m['content'] }}<</SYS>>
    {% else %}
[{{ m['role'] }}] {{ m['content'] | tojson }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[assistant]{% endif %}"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|start|>", "<|eot|>", "<s>"]
MESSAGES = [
    {"role": "system", "content": "You control a house."},
    {"role": "user", "content": "Lights on in the kitchen, please."},
    {"role": "assistant", "content": "turn_on(device=light, room=kitchen)"},
]


def make_model_dir(path: Path, config: Mapping[str, object], **files: str) -> Path:
    """A real byte-level BPE tokenizer.json trained on a few sentences, plus config files."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [m["content"] for m in MESSAGES] * 20 + ["the quick brown fox jumps"] * 5
    tok.train_from_iterator(corpus, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (path / name.replace("__", ".")).write_text(text)
    return path


@pytest.fixture
def chatml_dir(tmp_path: Path) -> Path:
    config = {
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHATML,
    }
    return make_model_dir(tmp_path / "model", config)


def test_hf_directory_loads_and_encodes(chatml_dir: Path) -> None:
    tok = load_tokenizer(chatml_dir)
    backend = tokenizers.Tokenizer.from_file(str(chatml_dir / "tokenizer.json"))
    text = "Lights on in the kitchen, please. Ünïcode too"
    assert tok.encode(text) == backend.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == backend.token_to_id("<|im_end|>")
    assert tok.pad_id == backend.token_to_id("<|endoftext|>")
    assert tok.bos_id is None
    assert tok.vocab_size == backend.get_vocab_size(with_added_tokens=True)
    assert tok.encode("<|im_end|>") == [tok.eos_id]  # special-token text -> its id


def test_special_ids_fall_back_to_config_json(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path / "m", {}, config__json=json.dumps({"eos_token_id": [4, 9]}))
    tok = load_tokenizer(model)
    assert tok.eos_id == 4 and tok.pad_id == 4  # pad falls back to EOS
    assert tok.chat_template is None


def test_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    config = {"bos_token": "<s>", "eos_token": "<|eot|>", "chat_template": CHATML}
    tok = load_tokenizer(make_model_dir(tmp_path / "m", config, chat_template__jinja=LLAMA_LIKE))
    assert tok.chat_template == LLAMA_LIKE
    assert tok.apply_chat_template(MESSAGES[:1]).startswith("<s><|start|>system")


@pytest.mark.parametrize("template", [CHATML, LLAMA_LIKE, MULTILINE])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_chat_template_renders_as_transformers_does(
    tmp_path: Path, template: str, generation_prompt: bool
) -> None:
    transformers = pytest.importorskip("transformers")
    config = {"bos_token": "<s>", "eos_token": "<|eot|>", "chat_template": template}
    model = make_model_dir(tmp_path / "m", config)
    hf = transformers.AutoTokenizer.from_pretrained(model)
    messages = [*MESSAGES, {"role": "user", "content": "skip"}, {"role": "user", "content": " x "}]
    ours = load_tokenizer(model).apply_chat_template(messages, generation_prompt)
    theirs = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert ours == theirs


def test_template_errors_are_user_errors(tmp_path: Path) -> None:
    config = {"bos_token": "<s>", "chat_template": LLAMA_LIKE}
    tok = load_tokenizer(make_model_dir(tmp_path / "m", config))
    with pytest.raises(UserError, match="chat template: unknown role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    config = {"chat_template": "{% for m in messages %}{{ m.content }"}
    with pytest.raises(UserError, match="chat template"):
        load_tokenizer(make_model_dir(tmp_path / "n", config)).apply_chat_template(MESSAGES)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"tokenizer\.json: not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match=r"not a valid tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_saved_tokenizer_reloads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = builtin_tokenizer()
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "command: Could you dim the hall lamp to 30 percent?\naction: set(value=30)"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 0)
    assert hf.apply_chat_template(MESSAGES, tokenize=False) == tok.apply_chat_template(MESSAGES)
    again = load_tokenizer(tmp_path)
    assert again.encode(text) == tok.encode(text) and again.chat_template == tok.chat_template


# -- built-in tokenizer ---------------------------------------------------------------------
def test_builtin_special_ids_and_size_fit_the_tiny_preset() -> None:
    tok = builtin_tokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.backend.id_to_token(3) == "<unk>"
    assert tok.vocab_size <= VOCAB_SIZE == tiny().vocab_size
    check_vocab(tok, tiny().vocab_size)
    assert resolve_tokenizer("tiny") is tok


def test_builtin_is_deterministic() -> None:
    fresh = builtin_tokenizer.__wrapped__()  # a second build, bypassing the cache
    assert fresh.backend.get_vocab() == builtin_tokenizer().backend.get_vocab()
    assert fresh.backend.to_str() == builtin_tokenizer().backend.to_str()


# Printable ASCII plus newline and tab (the characters the built-in vocabulary covers).
ASCII = st.text(alphabet=string.ascii_letters + string.digits + string.punctuation + " \n\t")


@settings(max_examples=200, deadline=None)
@given(ASCII)
def test_builtin_round_trips_ascii(text: str) -> None:
    tok = builtin_tokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.backend.token_to_id("<unk>") not in ids or "<unk>" in text


def test_builtin_unknown_characters_become_unk() -> None:
    tok = builtin_tokenizer()
    assert tok.decode(tok.encode("café"), skip_special_tokens=False) == "caf<unk>"


def test_check_vocab_rejects_a_larger_tokenizer() -> None:
    tok = builtin_tokenizer()
    with pytest.raises(UserError) as info:
        check_vocab(tok, 100)
    assert str(info.value) == (
        f"tokenizer has {tok.vocab_size} tokens but the model's vocabulary has 100 rows; "
        "use the tokenizer that came with the model"
    )
