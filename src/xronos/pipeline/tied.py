"""A tied embedding matrix across a pipeline: the last stage owns it, the first reads rows.

With tied embeddings the first stage looks tokens up in the matrix that the last stage
uses as its LM head. The LM head's gradient is dense (every row), the embedding's touches
only the rows of the step's tokens. So the last stage owns the matrix (it alone keeps
AdamW's moments and updates it) and, per step (``T`` = the step's distinct tokens, at most
its token count)::

    step start   last ──rows of T (|T| × H)──► first     the first stage's copy of
                                                          those rows is made current
    schedule     ... forwards and backwards ...
    after it     first ──their gradient (|T| × H)──► last   added to the LM head's

Rows the first stage does not hold current are never read that step, and the embedding's
gradient does not depend on the values it reads, so the sum the last stage updates with is
the single device's. A stage of several ranks (a hybrid's TP stage) holds a range of the
rows per member: each member of one end exchanges with each member of the other end the
step's rows that both hold (the pairs tile the step's tokens, each row travels once).

Before, both ends swapped the whole matrix's gradient (``V × H`` each way): on the
``small`` preset 16.8 MB, against ``|T| × H`` ≤ 0.5 MB for a 4 × 64 batch.
"""

from __future__ import annotations

import torch

from xronos.config import ModelConfig
from xronos.model.llama import LlamaForCausalLM
from xronos.pipeline.layout import StageLayout
from xronos.pipeline.schedule import P2P, TIED_ROWS_TAG, TIED_TAG


def tied_pairs(
    layout: StageLayout, cfg: ModelConfig, rank: int, ids: torch.Tensor
) -> list[tuple[int, str, torch.Tensor]]:
    """For ``rank``, a member of the first or the last stage: per member of the other end
    that holds some of the same rows, (its group rank, the pair's name
    ``{first}->{last}``, the ids of ``ids`` (sorted, distinct) within the rows both hold)."""
    stage, me = layout.stage_of(rank), layout.member(rank)
    last = len(layout.groups) - 1
    peer = last if stage == 0 else 0
    lo, hi = layout.vocab_rows(cfg, stage)[me]
    out = []
    for k, (a, b) in enumerate(layout.vocab_rows(cfg, peer)):
        rows = ids[(ids >= max(lo, a)) & (ids < min(hi, b))]
        if rows.numel():
            first, end = (me, k) if stage == 0 else (k, me)
            out.append(
                (layout.groups[peer][k], f"{layout.end(0, first)}->{layout.end(last, end)}", rows)
            )
    return out


class TiedRows:
    """This rank's end of the tied matrix's exchange (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, layout: StageLayout, cfg: ModelConfig, rank: int):
        self.weight, self.layout, self.cfg, self.rank = weight, layout, cfg, rank
        stage = layout.stage_of(rank)
        self.owner = stage == len(layout.groups) - 1
        self.lo = layout.vocab_rows(cfg, stage)[layout.member(rank)][0]
        self._pairs: list[tuple[int, str, torch.Tensor]] = []

    @classmethod
    def of(
        cls, model: LlamaForCausalLM, layout: StageLayout, cfg: ModelConfig, rank: int
    ) -> TiedRows | None:
        """The exchange of ``model`` (a stage) when it is an end of a pipeline of a tied
        model whose embedding trains; None otherwise (a frozen matrix is the same on both)."""
        stage, n = layout.stage_of(rank), len(layout.groups)
        if not cfg.tie_word_embeddings or n == 1 or stage not in (0, n - 1):
            return None
        weight = model.model.embed_tokens.weight
        return cls(weight, layout, cfg, rank) if weight.requires_grad else None

    def read(self, ids: torch.Tensor, p2p: P2P) -> None:
        """Step start: the owner sends the rows of ``ids`` (the step's distinct tokens); the
        first stage waits for them and writes them into its copy."""
        self._pairs = tied_pairs(self.layout, self.cfg, self.rank, ids)
        if self.owner:
            for peer, name, rows in self._pairs:
                p2p.send(
                    f"tied/rows/{name}", peer, self.weight.detach()[rows - self.lo], TIED_ROWS_TAG
                )
            return
        got = self._receive(p2p, "rows", TIED_ROWS_TAG)
        with torch.no_grad():
            for rows, t in got:
                self.weight[rows - self.lo] = t

    def sync(self, p2p: P2P) -> None:
        """After the schedule: the first stage sends the gradient of the rows it read (and
        drops its own); the owner adds it to the LM head's."""
        if not self.owner:
            grad = self.weight.grad
            grad = grad if grad is not None else torch.zeros_like(self.weight)
            for peer, name, rows in self._pairs:
                p2p.send(f"tied/grad/{name}", peer, grad[rows - self.lo], TIED_TAG)
            self.weight.grad = None
            return
        got = self._receive(p2p, "grad", TIED_TAG)
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        for rows, t in got:
            self.weight.grad.index_add_(0, rows - self.lo, t)

    def _receive(self, p2p: P2P, kind: str, tag: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Post every pair's receive of ``kind``, then wait for each: (rows, what came)."""
        h, dtype = self.cfg.hidden_size, self.weight.dtype
        for peer, name, rows in self._pairs:
            p2p.post_recv(f"tied/{kind}/{name}", peer, torch.empty(len(rows), h, dtype=dtype), tag)
        return [(rows, p2p.wait_recv(f"tied/{kind}/{name}")) for _, name, rows in self._pairs]
