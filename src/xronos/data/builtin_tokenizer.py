"""The built-in tokenizer of the model presets (512 tokens, no files, same every time),
and :func:`resolve_tokenizer`, which picks it or a model directory's tokenizer.

It is a WordPiece model over a fixed pre-tokenisation, so it round-trips any ASCII text
exactly and keeps the built-in smart-home data set short::

    normalise    " " -> "▁"                 (spaces become visible, and recoverable)
    pre-tokenise ▁?[A-Za-z_]+ | ▁?[0-9] | any other single character
    WordPiece    whole word if in the vocabulary, else its letters: "▁" "##x" "##y" ...
    post-process "<bos>" before the text (what ``encode(text, add_special_tokens=True)``
                 and transformers' ``tokenizer(text)`` add; chat text, tokenised as
                 ``apply_chat_template`` does it, gets its BOS from the template instead)
    decode       strip "##", "▁" -> " ", concatenate

Vocabulary (ids in this order): ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3; the
characters (``▁``, ASCII letters and ``_`` with and without ``##``, digits with and
without ``▁``, ASCII punctuation, newline, tab); the chat roles; then the most frequent words of the
smart-home training commands (ties broken alphabetically) up to 512. Characters outside
ASCII become ``<unk>``: for other text, use a model directory with its own tokenizer.
"""

from __future__ import annotations

import functools
import string
from collections import Counter

import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors

from xronos.config import PRESETS
from xronos.data import smarthome
from xronos.data.tokenizer import Tokenizer, load_tokenizer

VOCAB_SIZE = 512
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
SPACE = "▁"
WORD_CHARS = string.ascii_letters + "_"
PRE_TOKEN = Regex(f"{SPACE}?[A-Za-z_]+|{SPACE}?[0-9]|[^A-Za-z0-9_]")
CHAT_ROLES = ("system", "user", "assistant")
"""Whole tokens, so the built-in chat template stays short."""
CORPUS_SIZE = 4000
"""Smart-home training examples (seed 0) whose words fill the vocabulary."""

#: A plain chat template over the built-in special tokens (prefix-stable: assistant turns
#: end with ``<eos>``, and the generation prompt is the start of an assistant turn).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _base_vocab() -> list[str]:
    chars = [*SPECIALS, SPACE]
    chars += [c for ch in WORD_CHARS for c in (ch, f"##{ch}")]
    chars += [c for d in string.digits for c in (d, SPACE + d)]
    chars += [c for c in string.punctuation if c != "_"] + ["\n", "\t"]
    return chars + list(CHAT_ROLES)


def _pipeline(vocab: dict[str, int]) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(
        models.WordPiece(vocab, unk_token="<unk>", max_input_chars_per_word=100)
    )
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(PRE_TOKEN, behavior="isolated")
    tok.decoder = decoders.Sequence(
        [decoders.Replace(Regex("^##"), ""), decoders.Replace(SPACE, " "), decoders.Fuse()]
    )
    tok.add_special_tokens(list(SPECIALS))
    bos = ("<bos>", vocab["<bos>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B:1", special_tokens=[bos]
    )
    return tok


def _word_counts(tok: tokenizers.Tokenizer) -> Counter[str]:
    """Pre-tokens of two or more characters in the smart-home corpus, with counts."""
    counts: Counter[str] = Counter()
    normalizer, pre_tokenizer = tok.normalizer, tok.pre_tokenizer
    assert normalizer is not None and pre_tokenizer is not None
    for ex in smarthome.generate("train", CORPUS_SIZE, seed=0):
        for piece in (ex.prompt, ex.completion):
            normal = normalizer.normalize_str(piece)
            counts.update(w for w, _ in pre_tokenizer.pre_tokenize_str(normal) if len(w) > 1)
    return counts


@functools.lru_cache(maxsize=1)
def builtin_tokenizer() -> Tokenizer:
    """The tokenizer of the ``tiny``/``small`` presets (``<pad>``=0, ``<bos>``=1,
    ``<eos>``=2, ``<unk>``=3, 512 tokens). Built in memory, deterministically."""
    vocab = {token: i for i, token in enumerate(_base_vocab())}
    counts = _word_counts(_pipeline(dict(vocab)))
    for word, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(vocab) == VOCAB_SIZE:
            break
        vocab.setdefault(word, len(vocab))
    return Tokenizer(
        _pipeline(vocab),
        special_tokens={"pad": "<pad>", "bos": "<bos>", "eos": "<eos>", "unk": "<unk>"},
        chat_template=CHAT_TEMPLATE,
        name="built-in tokenizer",
    )


def resolve_tokenizer(model: str) -> Tokenizer:
    """The tokenizer for ``--model``: the built-in one for a preset, else the directory's."""
    return builtin_tokenizer() if model in PRESETS else load_tokenizer(model)
