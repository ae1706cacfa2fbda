"""Loading training examples from JSONL, JSON arrays and text files, and the errors."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from xronos.data import Example, builtin_tokenizer, load_examples, save_jsonl
from xronos.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_INPUT
from xronos.errors import UserError


def write_jsonl(path: Path, records: Sequence[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_text_records_are_fully_trainable(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "one"}, {"text": "two", "id": 7}])
    examples = load_examples(path)
    assert [e.segments for e in examples] == [(("one", True),), (("two", True),)]
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:2"]


def test_prompt_completion_masks_the_prompt(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q: 2+2?\nA:", "completion": " 4"}])
    (ex,) = load_examples(path)
    assert ex.segments == (("Q: 2+2?\nA:", False), (" 4", True))
    assert (ex.prompt, ex.completion) == ("Q: 2+2?\nA:", " 4")


def test_alpaca_uses_the_template_with_and_without_input(tmp_path: Path) -> None:
    records = [
        {"instruction": "Add.", "input": "2 and 3", "output": "5"},
        {"instruction": "Greet.", "input": "", "output": "Hi"},
        {"instruction": "Wave.", "output": "*waves*"},
    ]
    with_input, empty_input, no_input = load_examples(write_jsonl(tmp_path / "a.jsonl", records))
    assert with_input.prompt == ALPACA_PROMPT_INPUT.format(instruction="Add.", input="2 and 3")
    assert "### Input:" in with_input.prompt and with_input.completion == "5"
    assert empty_input.prompt == ALPACA_PROMPT.format(instruction="Greet.")
    assert "### Input:" not in no_input.prompt and no_input.completion == "*waves*"


def test_chat_marks_only_assistant_turns(tmp_path: Path) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "lights"},
        {"role": "assistant", "content": "on"},
    ]
    tok = builtin_tokenizer()
    (ex,) = load_examples(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]), tok)
    assert ex.chat
    assert ex.text == tok.apply_chat_template(messages)
    trainable = [text for text, t in ex.segments if t]
    assert trainable == [" hello<eos>", " on<eos>"]
    assert all("user" not in text and "system" not in text for text in trainable)


def test_plain_text_is_one_example_per_paragraph(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("first line\nsame paragraph\n\n\nsecond\n  \nthird\n")
    examples = load_examples(path)
    assert [e.text for e in examples] == ["first line\nsame paragraph", "second", "third"]
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:5", f"{path}:7"]


def test_json_array_and_directory(tmp_path: Path) -> None:
    (tmp_path / "b.json").write_text(json.dumps([{"text": "x"}, {"text": "y"}], indent=2))
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "completion": "c"}])
    (tmp_path / "ignored.csv").write_text("a,b\n")
    examples = load_examples(tmp_path)
    assert [e.text for e in examples] == ["pc", "x", "y"]  # files in name order
    (tmp_path / "one.json").write_text(json.dumps({"text": "z"}, indent=2))
    assert [e.text for e in load_examples(tmp_path / "one.json")] == ["z"]


def test_save_jsonl_round_trips(tmp_path: Path) -> None:
    examples = [Example.from_prompt("a: ", "b"), Example.from_text("plain")]
    save_jsonl(tmp_path / "out.jsonl", examples)
    assert [e.segments for e in load_examples(tmp_path / "out.jsonl")] == [
        e.segments for e in examples
    ]


# -- errors -------------------------------------------------------------------------------
def error_of(path: Path | str, tokenizer: object = None) -> str:
    with pytest.raises(UserError) as info:
        load_examples(path, tokenizer)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_and_empty_files(tmp_path: Path) -> None:
    assert "not found" in error_of(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    assert "empty" in error_of(tmp_path / "empty.jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    assert "unsupported" in error_of(tmp_path / "data.csv")


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "broken"\n')
    assert error_of(path).startswith(f"{path}:3: malformed JSON")


def test_missing_field_names_the_expected_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "c"}])
    message = error_of(path)
    assert message.startswith(f"{path}:2: missing 'completion'")
    assert "'prompt' and 'completion'" in message
    path = write_jsonl(tmp_path / "e.jsonl", [{"input": "x", "output": "y"}])
    assert "missing 'instruction'" in error_of(path) and "alpaca" in error_of(path)


def test_mixed_formats_and_unknown_records(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"prompt": "p", "completion": "c"}])
    message = error_of(path)
    assert message.startswith(f"{path}:2: mixed formats") and "text" in message
    path = write_jsonl(tmp_path / "e.jsonl", [{"question": "?"}])
    assert error_of(path).startswith(f"{path}:1: no known fields")
    path = write_jsonl(tmp_path / "f.jsonl", [["text", "a"]])
    assert "expected a JSON object" in error_of(path)
    path = write_jsonl(tmp_path / "g.jsonl", [{"text": 5}])
    assert "'text' must be a string" in error_of(path)
    path = write_jsonl(tmp_path / "h.jsonl", [{"prompt": "p", "completion": ""}])
    assert "'completion' is empty" in error_of(path)


def test_chat_errors(tmp_path: Path) -> None:
    user_only = [{"messages": [{"role": "user", "content": "hi"}]}]
    good = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ]
    path = write_jsonl(tmp_path / "a.jsonl", good)
    assert "chat template" in error_of(path)  # no tokenizer given
    path = write_jsonl(tmp_path / "b.jsonl", user_only)
    assert error_of(path, builtin_tokenizer()).startswith(f"{path}:1: no 'assistant' message")
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user"}]}])
    assert "message 1 needs a string 'content'" in error_of(path, builtin_tokenizer())
