"""Tokenizers: a Hugging Face ``tokenizer.json`` with its special tokens and chat template.

Special tokens are added as transformers' fast tokenizers add them: by the tokenizer's own
post-processor (``encode(text, add_special_tokens=True)``), never from the ``bos_token`` of
``tokenizer_config.json`` alone. SmolLM2 names ``<|im_start|>`` as its BOS yet adds none;
Llama 3's post-processor adds ``<|begin_of_text|>``. As in transformers 5, the
``add_bos_token``/``add_eos_token`` entries of ``tokenizer_config.json`` do not change
what a ``tokenizer.json`` adds.

Chat templates are rendered as transformers renders them: Jinja2 in a sandboxed
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``,
a ``tojson`` filter, the special tokens (``bos_token``, ``eos_token``, ...) as variables
and the ``{% generation %}`` tag accepted (and rendered as plain text).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from xronos.errors import UserError
from xronos.utils import atomic_write_text

SPECIAL_KEYS = ("bos", "eos", "pad", "unk")


@dataclass(frozen=True)
class Encoding:
    """The tokens of one text, with where each came from."""

    ids: list[int]
    offsets: list[tuple[int, int]]
    """``(start, end)`` character offsets in the text; ``(0, 0)`` for added tokens."""
    added: list[bool]
    """True for a token the post-processor added (a BOS, ...), False for one of the text."""

    def text_only(self) -> Encoding:
        """Without the post-processor's tokens (as ``add_special_tokens=False`` encodes)."""
        keep = [i for i, a in enumerate(self.added) if not a]
        return Encoding(
            [self.ids[i] for i in keep], [self.offsets[i] for i in keep], [False] * len(keep)
        )

    def lead(self) -> int:
        """How many tokens the post-processor put before the text."""
        return next((i for i, a in enumerate(self.added) if not a), len(self.added))


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template of its model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: dict[str, str] | None = None,
        special_ids: dict[str, int] | None = None,
        chat_template: str | None = None,
        name: str = "",
    ) -> None:
        """Args:
        backend: the tokenizer; its truncation and padding are switched off.
        special_tokens: ``{"bos": "<s>", ...}`` for any of bos/eos/pad/unk.
        special_ids: ids for roles that ``special_tokens`` does not name (from config.json).
        chat_template: Jinja2 source, or None.
        name: where it came from, for messages.
        """
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        self.name = name
        self.chat_template = chat_template
        self._ids: dict[str, int | None] = dict.fromkeys(SPECIAL_KEYS)
        self._ids.update(special_ids or {})
        for key, token in (special_tokens or {}).items():
            token_id = backend.token_to_id(token)
            if token_id is not None:
                self._ids[key] = token_id
        self._template: jinja2.Template | None = None
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1

    # -- vocabulary --------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """One more than the largest token id (added tokens included)."""
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        """The BOS the model's files name; only the post-processor decides whether
        encoding adds it (SmolLM2 names one and adds none)."""
        return self._ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self._ids["eos"]

    @property
    def pad_id(self) -> int:
        """The pad token, else EOS, else 0: padded positions are masked from the loss and
        come after the real tokens, so their value never reaches a prediction."""
        for key in ("pad", "eos"):
            if self._ids[key] is not None:
                return self._ids[key]  # type: ignore[return-value]
        return 0

    def token(self, key: str) -> str | None:
        """The text of special token ``key`` (bos/eos/pad/unk), or None."""
        token_id = self._ids.get(key)
        return None if token_id is None else self.backend.id_to_token(token_id)

    # -- text <-> ids ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids.
        ``add_special_tokens`` runs the tokenizer's own post-processor (e.g. a BOS)."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[Encoding]:
        """For each text: its ids, their character offsets and which ones the
        post-processor added (only with ``add_special_tokens``)."""
        out = []
        for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens):
            added = [s is None for s in e.sequence_ids]
            out.append(Encoding(list(e.ids), list(e.offsets), added))
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False
    ) -> str:
        """Render ``messages`` (``[{"role", "content"}, ...]``) with the chat template."""
        if self.chat_template is None:
            raise UserError(
                f"{self.name or 'the tokenizer'}: no chat template; use a model that has one "
                "or prompt/completion data"
            )
        try:
            if self._template is None:
                self._template = _environment().from_string(self.chat_template)
            specials = {f"{k}_token": self.token(k) for k in SPECIAL_KEYS}
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **specials,
            )
        except jinja2.TemplateError as e:
            raise UserError(f"chat template: {e}") from e

    # -- files ---------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (transformers reads them
        with ``AutoTokenizer``/``PreTrainedTokenizerFast``)."""
        directory = Path(directory)
        atomic_write_text(directory / "tokenizer.json", self.backend.to_str(pretty=True))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        config.update({f"{k}_token": self.token(k) for k in SPECIAL_KEYS if self.token(k)})
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        atomic_write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2))


# -- Jinja2 environment as transformers builds it -------------------------------------------
class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: rendered as its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's API

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)  # type: ignore[no-any-return]


def _raise(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


# -- loading ---------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from e
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory (``tokenizer.json`` plus the special
    tokens of ``tokenizer_config.json``, ``special_tokens_map.json`` or ``config.json``)."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"{path}: not found; Xronos reads fast tokenizers (tokenizer.json): save one with "
            "transformers' AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust parser raises plain Exception
        raise UserError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0]})") from e
    config = _read_json(model_dir / "tokenizer_config.json")
    special_map = _read_json(model_dir / "special_tokens_map.json")
    tokens: dict[str, str] = {}
    for key in SPECIAL_KEYS:
        name = f"{key}_token"
        text = _token_text(config.get(name)) or _token_text(special_map.get(name))
        if text is not None:
            tokens[key] = text
    model_config = _read_json(model_dir / "config.json")
    ids: dict[str, int] = {}
    for key in ("bos", "eos", "pad"):
        value = model_config.get(f"{key}_token_id")
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            ids[key] = value
    return Tokenizer(
        backend,
        special_tokens=tokens,
        special_ids=ids,
        chat_template=_chat_template(model_dir, config),
        name=str(model_dir),
    )


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Fail when the tokenizer can emit ids past the model's embedding rows."""
    if tokenizer.vocab_size > model_vocab_size:
        raise UserError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary has "
            f"{model_vocab_size} rows; use the tokenizer that came with the model"
        )
