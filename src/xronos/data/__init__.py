"""Data for fine-tuning: tokenizers, file formats, tokenisation and batching, and the
built-in smart-home data set."""

from xronos.data import smarthome
from xronos.data.builtin_tokenizer import builtin_tokenizer, resolve_tokenizer
from xronos.data.dataset import (
    IGNORE_INDEX,
    Batcher,
    TokenizedDataset,
    encode_chat,
    encode_prompt,
    split_train_eval,
    tokenize,
)
from xronos.data.formats import Example, load_examples, save_jsonl
from xronos.data.tokenizer import Tokenizer, check_vocab, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "Batcher",
    "Example",
    "TokenizedDataset",
    "Tokenizer",
    "builtin_tokenizer",
    "check_vocab",
    "encode_chat",
    "encode_prompt",
    "load_examples",
    "load_tokenizer",
    "resolve_tokenizer",
    "save_jsonl",
    "smarthome",
    "split_train_eval",
    "tokenize",
]
