"""Tokenising examples into ``(input_ids, labels)`` and batching them.

**Label convention** (as in Hugging Face): ``labels`` are *unshifted* — ``labels[t]`` is
the token at position ``t`` or ``-100`` where that token is not trained on (prompt,
BOS, padding). The model shifts: logits at ``t`` are scored against ``labels[t + 1]``.

::

    text      <bos> command : ▁turn ▁on \\n action :  ▁turn_on ( ... )  <eos> <pad> <pad>
    input_ids   1     c     :   t     o   \\n   a    :     t     ( ... )    2     0     0
    labels    -100  -100  -100 -100 -100 -100 -100 -100    t     ( ... )    2   -100  -100

**Special tokens** are those the model's tokenizer adds, as transformers adds them:
``tokenizer(text)`` runs the tokenizer's post-processor (a BOS for Llama-style
tokenizers, nothing for ChatML ones such as SmolLM2's or Qwen's, whatever
``tokenizer_config.json`` names as ``bos_token``), and chat text is tokenised as
``apply_chat_template`` tokenises it: with no post-processor tokens, the template places
its own. A text that already begins with the post-processor's leading tokens (a prompt
formatted by a chat template that writes its BOS) does not get them twice. Training
appends EOS to non-chat examples so that the model learns to stop.

A token is trainable when any of its characters lies in a trainable segment of the
example (the whole text is tokenised once, then each token is labelled from its
character offsets, so prompt and completion tokenise exactly as the full text does, and
the prompt's tokens are those :func:`encode_prompt` gives wherever the completion does
not merge with the prompt's last token).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, overload

import numpy as np
import torch

from xronos.data.formats import Example
from xronos.data.tokenizer import Encoding, Tokenizer
from xronos.errors import UserError

IGNORE_INDEX = -100
Truncation = Literal["truncate", "drop", "error"]
TRUNCATION_MODES = ("truncate", "drop", "error")


@dataclass
class TokenizedDataset:
    """Token ids and labels of each kept example, and what tokenisation did."""

    input_ids: list[list[int]]
    labels: list[list[int]]
    """Unshifted: -100 where a token is not trained on (the model shifts)."""
    seq_len: int
    sources: list[str] = field(default_factory=list)
    num_examples: int = 0
    """Examples given to :func:`tokenize`."""
    num_truncated: int = 0
    """Kept, but cut to ``seq_len`` tokens."""
    num_dropped: int = 0
    """Longer than ``seq_len`` and left out (``truncation="drop"``)."""
    num_no_target: int = 0
    """Left out because no trainable token remained (e.g. the prompt filled seq_len)."""

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        return self.input_ids[i], self.labels[i]

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.input_ids))

    @property
    def num_target_tokens(self) -> int:
        """Tokens that contribute to the loss."""
        return sum(sum(1 for x in row if x != IGNORE_INDEX) for row in self.labels)

    def subset(self, indices: Sequence[int]) -> TokenizedDataset:
        """The examples at ``indices`` (counts of the whole are not carried over)."""
        return TokenizedDataset(
            [self.input_ids[i] for i in indices],
            [self.labels[i] for i in indices],
            self.seq_len,
            [self.sources[i] for i in indices] if self.sources else [],
            num_examples=len(indices),
        )

    def summary(self) -> str:
        """One line for the run log."""
        line = f"{len(self)} of {self.num_examples} examples, {self.num_tokens} tokens "
        line += f"({self.num_target_tokens} trained on), seq_len {self.seq_len}"
        extras = [
            f"{n} {what}"
            for n, what in (
                (self.num_truncated, "truncated"),
                (self.num_dropped, "dropped as too long"),
                (self.num_no_target, "dropped with nothing to train on"),
            )
            if n
        ]
        return line + (f"; {', '.join(extras)}" if extras else "")


def _special(enc: Encoding, add_special_tokens: bool) -> Encoding:
    """``enc`` (encoded with the post-processor) as it is fed to the model: with the
    post-processor's tokens when ``add_special_tokens``, except leading ones that the text
    itself already begins with (they are not doubled)."""
    if not add_special_tokens:
        return enc.text_only()
    n = enc.lead()
    if n and enc.ids[n : 2 * n] == enc.ids[:n] and not any(enc.added[n : 2 * n]):
        return Encoding(enc.ids[n:], enc.offsets[n:], enc.added[n:])
    return enc


def _labelled(example: Example, enc: Encoding) -> tuple[list[int], list[int]]:
    """Labels for ``enc``: the id where a token of the text overlaps a trainable segment;
    tokens the post-processor added before the text are masked, those after it are
    trained on when the example ends in a trainable segment."""
    mask = np.zeros(len(example.text) + 1, dtype=bool)
    pos = 0
    for text, trainable in example.segments:
        mask[pos : pos + len(text)] = trainable
        pos += len(text)
    ends_trainable = example.segments[-1][1]
    labels, seen_text = [], False
    for token, (start, end), added in zip(enc.ids, enc.offsets, enc.added, strict=True):
        if added:
            hit = seen_text and ends_trainable
        else:
            hit = bool(mask[start:end].any()) if end > start else bool(mask[start])
            seen_text = True
        labels.append(token if hit else IGNORE_INDEX)
    return list(enc.ids), labels


def _encode(
    examples: Sequence[Example], tokenizer: Tokenizer, add_special_tokens: bool, add_eos: bool
) -> Iterator[tuple[list[int], list[int]]]:
    encoded = tokenizer.encode_batch([ex.text for ex in examples], add_special_tokens=True)
    eos = tokenizer.eos_id
    for ex, enc in zip(examples, encoded, strict=True):
        ids, labels = _labelled(ex, _special(enc, add_special_tokens and not ex.chat))
        if add_eos and eos is not None and not ex.chat and ids[-1:] != [eos]:
            ids, labels = [*ids, eos], [*labels, eos if ex.segments[-1][1] else IGNORE_INDEX]
        yield ids, labels


def tokenize(
    examples: Sequence[Example],
    tokenizer: Tokenizer,
    seq_len: int,
    truncation: Truncation = "truncate",
    add_special_tokens: bool = True,
    add_eos: bool = True,
) -> TokenizedDataset:
    """Tokenise examples into unshifted ``(input_ids, labels)`` of at most ``seq_len``.

    The tokenizer's post-processor adds its special tokens (``add_special_tokens``), and
    EOS is appended (trainable when the example ends in a trainable segment) unless the
    tokenizer lacks one or already put it there; rendered chats get neither, as their
    template places its own (see the module's notes). Longer examples are cut to
    ``seq_len`` (``"truncate"``), left out (``"drop"``) or refused (``"error"``); examples
    with no trainable token left are left out. Raises UserError when nothing is left.
    """
    if truncation not in TRUNCATION_MODES:
        raise UserError(f"--truncation {truncation!r}: use one of {', '.join(TRUNCATION_MODES)}")
    if seq_len < 2:
        raise UserError(f"--seq-len {seq_len} is too short; use at least 2")
    out = TokenizedDataset([], [], seq_len, num_examples=len(examples))
    for ex, (ids, labels) in zip(
        examples, _encode(examples, tokenizer, add_special_tokens, add_eos), strict=True
    ):
        if len(ids) > seq_len:
            if truncation == "error":
                raise UserError(
                    f"{ex.source or 'an example'}: {len(ids)} tokens, longer than --seq-len "
                    f"{seq_len}; raise --seq-len or use --truncation truncate or drop"
                )
            if truncation == "drop":
                out.num_dropped += 1
                continue
            ids, labels = ids[:seq_len], labels[:seq_len]
            out.num_truncated += 1
        if all(x == IGNORE_INDEX for x in labels[1:]):  # label 0 is never predicted
            out.num_no_target += 1
            continue
        out.input_ids.append(ids)
        out.labels.append(labels)
        out.sources.append(ex.source)
    _check_not_empty(out)
    return out


def _check_not_empty(out: TokenizedDataset) -> None:
    if len(out):
        return
    n, s = out.num_examples, out.seq_len
    if n == 0:
        raise UserError("no examples to tokenise; check --data")
    if out.num_dropped == n:
        raise UserError(
            f"all {n} examples are longer than --seq-len {s}; "
            "raise --seq-len or use --truncation truncate"
        )
    raise UserError(
        f"none of the {n} examples has a token to train on within --seq-len {s}; "
        "raise --seq-len or check that completions are not empty"
    )


def encode_prompt(tokenizer: Tokenizer, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """Ids of a prompt for generation, as transformers' ``tokenizer(prompt)`` gives them
    and as :func:`tokenize` starts a sequence: with the post-processor's special tokens,
    which a prompt already formatted by a chat template does not get twice (so it
    tokenises as :func:`encode_chat` of its messages)."""
    (enc,) = tokenizer.encode_batch([prompt], add_special_tokens=True)
    return list(_special(enc, add_special_tokens).ids)


def encode_chat(
    tokenizer: Tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    """Ids of a conversation rendered with the model's chat template, as transformers'
    ``apply_chat_template(messages, add_generation_prompt, tokenize=True)`` gives them
    (the template places the special tokens: the post-processor adds none)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


# -- train/eval split -------------------------------------------------------------------------
T = TypeVar("T")


def _seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (stable across runs and platforms)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@overload
def split_train_eval(
    items: TokenizedDataset, eval_fraction: float, seed: int = 0
) -> tuple[TokenizedDataset, TokenizedDataset]: ...
@overload
def split_train_eval(
    items: Sequence[T], eval_fraction: float, seed: int = 0
) -> tuple[list[T], list[T]]: ...
def split_train_eval(
    items: TokenizedDataset | Sequence[T], eval_fraction: float, seed: int = 0
) -> tuple[TokenizedDataset, TokenizedDataset] | tuple[list[T], list[T]]:
    """Split into (train, eval): ``round(n * eval_fraction)`` items (at least one when the
    fraction is positive) drawn by a permutation seeded with ``seed``; order is kept."""
    if not 0 <= eval_fraction < 1:
        raise UserError(f"--eval-fraction {eval_fraction}: use a value in [0, 1)")
    n = len(items)
    n_eval = max(1, round(n * eval_fraction)) if eval_fraction > 0 else 0
    if n_eval >= n and n_eval:
        raise UserError(
            f"{n} examples are too few to hold out {n_eval} for evaluation; "
            "add data or lower --eval-fraction"
        )
    gen = torch.Generator().manual_seed(_seed(seed, n))
    held = set(torch.randperm(n, generator=gen)[:n_eval].tolist())
    train_idx = [i for i in range(n) if i not in held]
    eval_idx = sorted(held)
    if isinstance(items, TokenizedDataset):
        return items.subset(train_idx), items.subset(eval_idx)
    return [items[i] for i in train_idx], [items[i] for i in eval_idx]


# -- batching --------------------------------------------------------------------------------
class Batcher:
    """Shuffled, padded batches, deterministic in (seed, epoch) and resumable.

    Every rank of a tensor-parallel group builds the same Batcher and so sees the same
    batches. ``next_batch()`` runs on across epochs; iterating yields the rest of the
    current epoch. ``state_dict()`` records (epoch, position): a Batcher restored from it
    yields exactly the batches the original would have yielded next.
    """

    def __init__(
        self,
        dataset: TokenizedDataset,
        batch_size: int,
        seed: int = 0,
        pad_id: int = 0,
        *,
        pad_to: Literal["fixed", "longest"] = "fixed",
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        """Args:
        dataset: the tokenised examples.
        batch_size: examples per batch (B).
        seed: with the epoch number, decides each epoch's order.
        pad_id: input id of padding (its labels are -100).
        pad_to: ``"fixed"`` pads every batch to ``dataset.seq_len`` (stable shapes, as
            profiling and planning assume); ``"longest"`` to the longest in the batch.
        shuffle: False keeps the data set's order (for evaluation).
        drop_last: leave out the last partial batch, so that every batch has B rows.
        """
        if batch_size < 1:
            raise UserError(f"--batch-size {batch_size}: use at least 1")
        if drop_last and len(dataset) < batch_size:
            raise UserError(
                f"{len(dataset)} examples are fewer than --batch-size {batch_size}; "
                "lower --batch-size or add data"
            )
        self.dataset, self.batch_size, self.seed, self.pad_id = dataset, batch_size, seed, pad_id
        self.pad_to, self.shuffle, self.drop_last = pad_to, shuffle, drop_last
        self.epoch = 0
        self.position = 0
        """Batches of the current epoch already yielded."""
        self._order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        n, b = len(self.dataset), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def order(self, epoch: int) -> list[int]:
        """The example order of ``epoch``."""
        if self._order is None or self._order[0] != epoch:
            n = len(self.dataset)
            if self.shuffle:
                gen = torch.Generator().manual_seed(_seed(self.seed, epoch))
                self._order = (epoch, torch.randperm(n, generator=gen).tolist())
            else:
                self._order = (epoch, list(range(n)))
        return self._order[1]

    def collate(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, both LongTensor ``[B, S]``, right-padded."""
        rows = [self.dataset[i] for i in indices]
        width = self.dataset.seq_len if self.pad_to == "fixed" else max(len(r[0]) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for b, (ids, labs) in enumerate(rows):
            input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            labels[b, : len(labs)] = torch.tensor(labs, dtype=torch.long)
        return input_ids, labels

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch, moving on to a freshly shuffled epoch after the last one."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        indices = self.order(self.epoch)[start : start + self.batch_size]
        self.position += 1
        return self.collate(indices)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The remaining batches of the current epoch (then the next epoch begins)."""
        while self.position < len(self):
            yield self.next_batch()
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_examples": len(self.dataset),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from ``state``; it must come from the same data, seed and batch size."""
        mine = self.state_dict()
        for key in ("num_examples", "batch_size", "seed"):
            if key in state and int(state[key]) != mine[key]:
                raise UserError(
                    f"the checkpoint's data position is for {key} {state[key]}, but this run "
                    f"has {mine[key]}; resume with the same data, --batch-size and --seed"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
