"""Training examples and the file formats they are read from.

An :class:`Example` is a sequence of text segments, each marked trainable or not: the
loss sees only tokens of trainable segments. Every format reduces to it:

========================  =====================================================
format                    segments
========================  =====================================================
``{"text"}``              ``(text, True)``
``{"prompt", "completion"}`` ``(prompt, False), (completion, True)`` (joined as is)
Alpaca ``{"instruction", "input"?, "output"}``  ``(alpaca prompt, False), (output, True)``
chat ``{"messages"}``     the chat template's rendering; only assistant turns trainable
plain ``.txt``            one ``(paragraph, True)`` per blank-line-separated paragraph
========================  =====================================================

The JSON format is detected per file from its first record; every later record must
use the same one. ``.json`` files may also hold one JSON array of records.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from xronos.errors import UserError
from xronos.utils import atomic_write_text


class ChatRenderer(Protocol):
    """What chat data needs of a tokenizer: its chat template, and rendering with it
    (:class:`xronos.data.tokenizer.Tokenizer` is one)."""

    @property
    def chat_template(self) -> str | None: ...

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False
    ) -> str: ...


#: The Alpaca prompt (as popularised by alpaca-lora), with and without an ``input``.
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)

#: Format name -> the fields a record of that format must have.
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "prompt/completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
#: Format name -> any field that reveals it (checked in this order).
_MARKERS: dict[str, tuple[str, ...]] = {
    "chat": ("messages",),
    "prompt/completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output", "input"),
    "text": ("text",),
}
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text", ".md")


@dataclass(frozen=True)
class Example:
    """One training example: text segments, each trainable (in the loss) or not."""

    segments: tuple[tuple[str, bool], ...]
    """``(text, trainable)`` pairs; their concatenation is the example's text."""
    source: str = ""
    """Where it came from (``file:line``), for error messages."""
    chat: bool = False
    """Rendered by a chat template, which already places BOS and end-of-turn tokens:
    tokenised as transformers' ``apply_chat_template`` does it, with no special tokens of
    the tokenizer's post-processor and no EOS of its own."""

    @classmethod
    def from_prompt(cls, prompt: str, completion: str, source: str = "") -> Example:
        """A prompt (masked from the loss) followed by its completion (trained on)."""
        return cls(_merge(((prompt, False), (completion, True))), source)

    @classmethod
    def from_text(cls, text: str, source: str = "") -> Example:
        """Plain text, every token trained on."""
        return cls(((text, True),), source)

    @property
    def text(self) -> str:
        return "".join(s for s, _ in self.segments)

    @property
    def prompt(self) -> str:
        """The text before the first trainable segment."""
        out = []
        for s, trainable in self.segments:
            if trainable:
                break
            out.append(s)
        return "".join(out)

    @property
    def completion(self) -> str:
        """The text from the first trainable segment on."""
        return self.text[len(self.prompt) :]


# -- records -> examples ------------------------------------------------------------------
def detect_format(record: dict[str, Any]) -> str | None:
    """The format a JSON record's fields reveal, or None when it has none of them."""
    for name, markers in _MARKERS.items():
        if any(k in record for k in markers):
            return name
    return None


def _string(record: dict[str, Any], key: str, where: str, *, allow_empty: bool = False) -> str:
    value = record.get(key, "")
    if not isinstance(value, str):
        raise UserError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise UserError(f"{where}: field {key!r} is empty; fill it or remove the record")
    return value


def record_to_example(
    record: dict[str, Any], fmt: str, where: str, tokenizer: ChatRenderer | None = None
) -> Example:
    """Convert one record of a known format; ``where`` (``file:line``) goes into errors."""
    missing = [k for k in REQUIRED_FIELDS[fmt] if k not in record]
    if missing:
        fields = " and ".join(repr(k) for k in REQUIRED_FIELDS[fmt])
        raise UserError(
            f"{where}: missing {', '.join(repr(k) for k in missing)}; "
            f"the {fmt} format (from the file's first record) needs {fields}"
        )
    if fmt == "text":
        return Example.from_text(_string(record, "text", where), where)
    if fmt == "prompt/completion":
        prompt = _string(record, "prompt", where, allow_empty=True)
        return Example.from_prompt(prompt, _string(record, "completion", where), where)
    if fmt == "alpaca":
        instruction = _string(record, "instruction", where)
        extra = _string(record, "input", where, allow_empty=True)
        template = ALPACA_PROMPT_INPUT if extra.strip() else ALPACA_PROMPT
        prompt = template.format(instruction=instruction, input=extra)
        return Example.from_prompt(prompt, _string(record, "output", where), where)
    return chat_example(record["messages"], where, tokenizer)


def chat_example(messages: Any, where: str, tokenizer: ChatRenderer | None) -> Example:
    """Render a conversation with the tokenizer's chat template; assistant turns (their
    content and the template's end-of-turn text) are trainable, everything else is not.

    The template is rendered prefix by prefix: for assistant message *i*,
    ``render(messages[:i], add_generation_prompt=True)`` must be a prefix of
    ``render(messages[:i + 1])``; the difference is that turn's trainable span.
    """
    _check_messages(messages, where)
    if tokenizer is None or tokenizer.chat_template is None:
        raise UserError(
            f"{where}: chat 'messages' need a chat template, but the tokenizer has none; "
            "use a model whose tokenizer_config.json has chat_template, or convert the "
            "data to prompt/completion"
        )

    def render(msgs: list[dict[str, Any]], gen: bool) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, add_generation_prompt=gen)
        except UserError as e:
            raise UserError(f"{where}: {e}") from e

    segments: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix, full = render(messages[:i], True), render(messages[: i + 1], False)
        if not prefix.startswith(done) or not full.startswith(prefix):
            raise UserError(
                f"{where}: the chat template renders message {i + 1} differently once later "
                "turns follow, so assistant turns cannot be isolated; convert this data to "
                "prompt/completion"
            )
        segments += [(prefix[len(done) :], False), (full[len(prefix) :], True)]
        done = full
    whole = render(messages, False)
    if not whole.startswith(done):
        raise UserError(f"{where}: the chat template is not prefix-stable; use prompt/completion")
    segments.append((whole[len(done) :], False))
    return Example(_merge(segments), where, chat=True)


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise UserError(f"{where}: message {i} needs a string 'role' and 'content'")
        if not isinstance(m.get("content"), str):
            raise UserError(f"{where}: message {i} needs a string 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no 'assistant' message, so nothing to train on")


def _merge(segments: Iterable[tuple[str, bool]]) -> tuple[tuple[str, bool], ...]:
    """Drop empty segments and join neighbours with the same flag."""
    out: list[tuple[str, bool]] = []
    for text, trainable in segments:
        if not text:
            continue
        if out and out[-1][1] == trainable:
            out[-1] = (out[-1][0] + text, trainable)
        else:
            out.append((text, trainable))
    return tuple(out)


# -- files ---------------------------------------------------------------------------------
def _read(path: Path) -> str:
    if not path.is_file():
        raise UserError(f"{path}: data file not found; check --data")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); re-encode it as UTF-8") from e
    if not text.strip():
        raise UserError(f"{path}: empty file; it holds no examples")
    return text


def _json_records(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for each record of a JSONL file or a ``.json`` array."""
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from e
        for i, record in enumerate(records, 1):
            yield f"{path}: record {i}", record
        return
    if path.suffix == ".json" and len(text.strip().splitlines()) > 1:
        try:  # one pretty-printed record
            yield f"{path}:1", json.loads(text)
            return
        except json.JSONDecodeError:
            pass  # JSON Lines after all: report errors by line below
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: malformed JSON: {e.msg} (column {e.colno})") from e
        yield f"{path}:{lineno}", record


def load_jsonl(path: Path, tokenizer: ChatRenderer | None = None) -> list[Example]:
    """Examples of a JSONL (or ``.json`` array) file, in one format detected from its
    first record."""
    fmt: str | None = None
    examples = []
    for where, record in _json_records(path, _read(path)):
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
        found = detect_format(record)
        if fmt is None:
            if found is None:
                raise UserError(
                    f"{where}: no known fields; expected 'text', 'prompt'+'completion', "
                    "'instruction'+'output' (Alpaca) or 'messages' (chat)"
                )
            fmt = found
        elif found is not None and found != fmt:
            raise UserError(
                f"{where}: mixed formats: this record is {found} but the file's first record "
                f"is {fmt}; use one format per file"
            )
        examples.append(record_to_example(record, fmt, where, tokenizer))
    return examples


def load_text(path: Path) -> list[Example]:
    """One example per paragraph (blank-line separated) of a plain text file; each
    paragraph keeps its inner newlines and is trained on in full."""
    examples: list[Example] = []
    lines: list[str] = []
    start = 0
    for lineno, line in enumerate([*_read(path).splitlines(), ""], 1):
        if line.strip():
            if not lines:
                start = lineno
            lines.append(line)
        elif lines:
            examples.append(Example.from_text("\n".join(lines), f"{path}:{start}"))
            lines = []
    return examples


def _files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    files: list[Path] = []
    for item in map(Path, items):
        if item.is_dir():
            found = sorted(p for p in item.iterdir() if p.suffix in JSON_SUFFIXES + TEXT_SUFFIXES)
            if not found:
                raise UserError(f"{item}: no .jsonl, .json or .txt files in this directory")
            files += found
        else:
            files.append(item)
    return files


def load_examples(
    paths: str | Path | Sequence[str | Path], tokenizer: ChatRenderer | None = None
) -> list[Example]:
    """Read every example of the given files (or directories of them), in order.

    ``tokenizer`` is needed only for chat data (its chat template renders the turns).
    """
    examples: list[Example] = []
    files = _files(paths)
    for path in files:
        if path.suffix in TEXT_SUFFIXES:
            examples += load_text(path)
        elif path.suffix in JSON_SUFFIXES or not path.exists():
            examples += load_jsonl(path, tokenizer)
        else:
            raise UserError(f"{path}: unsupported data file type; use .jsonl, .json or .txt")
    if not examples:
        raise UserError(f"no examples in {', '.join(map(str, files))}; add data")
    return examples


def save_jsonl(path: str | Path, examples: Iterable[Example]) -> None:
    """Write examples as JSONL in one format: ``{"text"}`` when every example is fully
    trainable, else ``{"prompt", "completion"}`` (a prompt followed by a trainable
    completion; a fully trainable example gets an empty prompt)."""
    examples = list(examples)
    for ex in examples:
        if [t for _, t in ex.segments] not in ([True], [False, True]):
            raise ValueError(f"{ex.source or ex.text[:30]!r}: neither text nor prompt/completion")
    as_text = all(len(ex.segments) == 1 for ex in examples)
    lines = [
        json.dumps(
            {"text": ex.text} if as_text else {"prompt": ex.prompt, "completion": ex.completion},
            ensure_ascii=False,
        )
        + "\n"
        for ex in examples
    ]
    atomic_write_text(path, "".join(lines))
