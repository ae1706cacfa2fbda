"""Batches: what one optimizer step trains on, and the one definition of a trained token.

A step is a list of micro-batches (gradient accumulation); each micro-batch is
``(input_ids (B, S), labels (B, S))`` with ``-100`` where no loss is taken. Labels are
*unshifted*: position ``t`` predicts ``labels[t + 1]``, so the tokens a step trains on are
``labels[:, 1:] != -100`` (:func:`label_count`) — the figure behind every tokens/s.

A :class:`StepSource` hands the loop one step at a time and can save and restore its
position (checkpoints). Two implementations: :class:`DatasetBatches` (a tokenized data set,
shuffled per epoch) and :class:`RandomBatches` (seeded random ids, for benchmarks and tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from xronos.data import Batcher, TokenizedDataset

Batch = tuple[torch.Tensor, torch.Tensor]  # input_ids (B, S), labels (B, S); -100 = ignore


def label_count(batches: Sequence[Batch]) -> int:
    """Next-token labels that count in the loss: the tokens a step trains on."""
    return sum(int((labels[:, 1:] != -100).sum()) for _, labels in batches)


class StepSource(Protocol):
    """Yields the micro-batches of one optimizer step at a time, deterministically."""

    def next_step(self) -> list[Batch]: ...

    def peek(self) -> list[Batch]:
        """The micro-batches ``next_step`` would return, without advancing."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class RandomBatches:
    """Random token ids: step ``k`` is a pure function of (seed, k), so every strategy and
    every rank sees the same data. Labels equal the ids (every position counts)."""

    vocab_size: int
    batch_size: int
    seq_len: int
    grad_accum: int = 1
    seed: int = 0
    repeat: bool = False
    """Yield the same step every time (a memorisation task whose loss must fall)."""
    position: int = 0
    """The next step to yield."""

    def _make(self, step: int) -> list[Batch]:
        key = 0 if self.repeat else step
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        micro = []
        for _ in range(self.grad_accum):
            ids = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len), generator=gen)
            micro.append((ids, ids.clone()))
        return micro

    def next_step(self) -> list[Batch]:
        self.position += 1
        return self._make(self.position - 1)

    def peek(self) -> list[Batch]:
        return self._make(self.position)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


@dataclass
class DatasetBatches:
    """A tokenized data set cut into padded batches, reshuffled every epoch (seeded)."""

    dataset: TokenizedDataset
    batch_size: int
    seed: int = 0
    pad_id: int = 0
    grad_accum: int = 1
    _batcher: Batcher | None = field(default=None, repr=False)

    @property
    def batcher(self) -> Batcher:
        if self._batcher is None:
            self._batcher = Batcher(
                self.dataset, self.batch_size, seed=self.seed, pad_id=self.pad_id
            )
        return self._batcher

    def next_step(self) -> list[Batch]:
        return [self.batcher.next_batch() for _ in range(self.grad_accum)]

    def peek(self) -> list[Batch]:
        saved = self.batcher.state_dict()
        try:
            return self.next_step()
        finally:
            self.batcher.load_state_dict(saved)

    def state_dict(self) -> dict[str, Any]:
        return self.batcher.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batcher.load_state_dict(state)
