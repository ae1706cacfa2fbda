"""Tokenizers from GGUF metadata, splitting text as llama.cpp does.

A GGUF file has no ``tokenizer.json``: it stores the byte-level BPE vocabulary
(``tokenizer.ggml.tokens``), its merges, token types and special ids, and names the
pre-tokenizer rules in ``tokenizer.ggml.pre``. llama.cpp applies, for each name, a list of
regexes one after another, each splitting every piece the previous one left (a match and the
text between matches both become pieces). :func:`pre_tokenizer` rebuilds that list as a
``tokenizers`` ``Sequence`` of isolated ``Split`` steps followed by the byte-level mapping.

Notably ``smollm`` (also ``starcoder``, ``refact``) first isolates every digit — ``"2024"`` is
four tokens — which a GPT-2 style converter without that rule does not do.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from xronos.errors import UserError
from xronos.model.gguf_io import GGUFReader

if TYPE_CHECKING:
    from xronos.data.tokenizer import Tokenizer

# llama.cpp's regexes (src/llama-vocab.cpp, llm_tokenizer_bpe), by pre-tokenizer family.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: family -> the regexes llama.cpp applies in order.
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "smollm": (r"\p{N}", _GPT2),
}
#: ``tokenizer.ggml.pre`` -> family (the names llama.cpp maps to the same rules).
PRE_FAMILIES = {
    "default": "default",
    "gpt-2": "gpt2",
    "phi-2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "dbrx": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "stablelm2": "qwen2",
    "smollm": "smollm",
    "starcoder": "smollm",
    "refact": "smollm",
}
#: Pre-tokenizer names for which llama.cpp looks a whole piece up before merging.
IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3"}
#: llama.cpp token types (``tokenizer.ggml.token_type``).
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


class GGUFTokenizer(NamedTuple):
    """What a GGUF file says of its tokenizer."""

    backend: tokenizers.Tokenizer
    """The tokenizer, with llama.cpp's pre-tokenizer rules and its BOS/EOS post-processor."""
    special_tokens: dict[str, str]
    """``{"bos": "<|im_start|>", "eos": ..., "pad": ..., "unk": ...}`` for the ids the file sets."""
    chat_template: str | None
    """``tokenizer.chat_template``, or None."""


def pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The ``tokenizers`` pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre`` value ``pre``."""
    family = PRE_FAMILIES.get(pre)
    if family is None:
        raise UserError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_FAMILIES)}"
        )
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[family]
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _split_merge(merge: str) -> tuple[str, str]:
    """``"Ġ t"`` -> ``("Ġ", "t")``: split at the first space after the first character, as
    llama.cpp does (a merge's left part may itself be a space)."""
    pos = merge.find(" ", 1)
    if pos < 0:
        raise UserError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
    return merge[:pos], merge[pos + 1 :]


def build_tokenizer(
    tokens: list[str],
    merges: list[str],
    token_types: list[int] | None,
    pre: str,
    *,
    bos_id: int | None = None,
    eos_id: int | None = None,
    add_bos: bool = False,
    add_eos: bool = False,
) -> tokenizers.Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from GGUF-style vocabulary data.

    Args:
        tokens: token text by id (byte-level spelling, as in ``tokenizer.json``).
        merges: ``"left right"`` strings, best first.
        token_types: llama.cpp types by id; CONTROL tokens become special added tokens and
            USER_DEFINED ones plain added tokens (both always matched whole in text).
        pre: ``tokenizer.ggml.pre``.
        bos_id, eos_id, add_bos, add_eos: what ``encode(add_special_tokens=True)`` adds.
    """
    vocab = {tok: i for i, tok in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=[_split_merge(m) for m in merges],
        ignore_merges=pre in IGNORE_MERGES,
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    types = token_types or []
    special = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types, strict=False)
        if ty == CONTROL
    ]
    plain = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == USER_DEFINED
    ]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
    first = [tokens[bos_id]] if add_bos and bos_id is not None else []
    last = [tokens[eos_id]] if add_eos and eos_id is not None else []
    if first or last:
        ids = [(t, tokens.index(t)) for t in dict.fromkeys(first + last)]
        single = " ".join([*(f"{t}:0" for t in first), "$A:0", *(f"{t}:0" for t in last)])
        pair = (
            single + " " + " ".join([*(f"{t}:1" for t in first), "$B:1", *(f"{t}:1" for t in last)])
        )
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=ids
        )
    return tok


def tokenizer_from_gguf(path: str | Path) -> GGUFTokenizer:
    """The tokenizer a GGUF file describes (byte-level BPE, ``tokenizer.ggml.model == "gpt2"``).

    Raises:
        UserError: another tokenizer model (SentencePiece ``llama``, ...), no merges, or a
            pre-tokenizer this module does not know.
    """
    with GGUFReader(path) as r:
        meta: dict[str, Any] = {
            k: r.metadata(f"tokenizer.ggml.{k}")
            for k in (
                "model",
                "pre",
                "tokens",
                "merges",
                "token_type",
                "bos_token_id",
                "eos_token_id",
                "padding_token_id",
                "unknown_token_id",
                "add_bos_token",
                "add_eos_token",
            )
        }
        template = r.metadata("tokenizer.chat_template")
    if meta["model"] != "gpt2":
        raise UserError(
            f"{path}: tokenizer model {meta['model']!r} is not supported (only byte-level BPE, "
            "'gpt2'); use the model's tokenizer.json instead"
        )
    if not meta["tokens"] or not meta["merges"]:
        raise UserError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges missing")
    tokens: list[str] = list(meta["tokens"])
    pre = str(meta["pre"] or "default")
    ids = {
        "bos": meta["bos_token_id"],
        "eos": meta["eos_token_id"],
        "pad": meta["padding_token_id"],
        "unk": meta["unknown_token_id"],
    }
    # llama.cpp adds BOS by default for the llama3 family unless the file says otherwise
    add_bos = meta["add_bos_token"]
    if add_bos is None:
        add_bos = PRE_FAMILIES.get(pre) == "llama3"
    backend = build_tokenizer(
        tokens,
        list(meta["merges"]),
        meta["token_type"],
        pre,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        add_bos=bool(add_bos),
        add_eos=bool(meta["add_eos_token"]),
    )
    special = {k: tokens[int(v)] for k, v in ids.items() if v is not None and 0 <= v < len(tokens)}
    return GGUFTokenizer(backend, special, template)


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """:func:`tokenizer_from_gguf` wrapped in Xronos's :class:`xronos.data.tokenizer.Tokenizer`."""
    from xronos.data.tokenizer import Tokenizer

    backend, special, template = tokenizer_from_gguf(path)
    return Tokenizer(backend, special_tokens=special, chat_template=template, name=str(path))


# -- the other way: which llama.cpp rules reproduce a tokenizer.json ------------------------
_PROBE = (
    "Hello world! I'M here, you're there; it's 2024-05-17 at 12345.678 $x=42\n\n"
    "  indented\tline   with   spaces  \r\n éèà Ünïcödé 中文字符 ...!!! ?? 'quoted' don't\n"
)
#: The candidates :func:`detect_pre` tries, most specific first.
DETECTABLE = ("smollm", "llama-bpe", "qwen2", "gpt-2", "default")


def detect_pre(backend: tokenizers.Tokenizer) -> str:
    """The ``tokenizer.ggml.pre`` value whose llama.cpp rules split text exactly as
    ``backend``'s own pre-tokenizer does (compared on a probe text with digits, contractions
    in both cases, runs of spaces and newlines, punctuation and non-Latin letters).

    Raises:
        UserError: ``backend`` has no pre-tokenizer, or none of :data:`DETECTABLE` agrees.
    """
    own = backend.pre_tokenizer
    if own is None:
        raise UserError("the tokenizer has no pre-tokenizer; pass the GGUF pre-tokenizer name")
    want = [p for p, _ in own.pre_tokenize_str(_PROBE)]
    for pre in DETECTABLE:
        if [p for p, _ in pre_tokenizer(pre).pre_tokenize_str(_PROBE)] == want:
            return pre
    raise UserError(
        "the tokenizer splits text unlike any of llama.cpp's pre-tokenizers "
        f"{', '.join(DETECTABLE)}; pass the right name explicitly"
    )
