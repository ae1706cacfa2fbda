"""Vocab-parallel LM head, cross-entropy and (for tied models) embedding.

Rank ``r`` holds vocabulary rows ``[v0_r, v1_r)`` of the output embedding ``W (V, H)``;
sizes are arbitrary, zero included. No rank ever materialises full logits in training.

Cross-entropy in one collective (instead of Megatron's three)::

    z_r   = h @ W_rᵀ                               (N, V_r)   local logits
    lse_r = logsumexp(z_r)                         (N,)       -inf when V_r = 0
    t_r   = z_r[n, y_n − v0_r] if y_n ∈ [v0_r, v1_r) else 0
    [lse_*, t_*] = all_gather([lse_r, t_r])        (R, 2, N)  equal shapes on every rank
    lse   = logsumexp_r(lse_*),  loss_n = lse − Σ_r t_*
    dz_r  = softmax part exp(z_r − lse) − onehot_r(y)       no communication

The gradient of ``h`` is a per-rank partial; the seam before the head all-reduces it
(:func:`~xronos.parallel.columns.project_columns`, overlapped with the head's gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xronos.comm.mappings import TPGroup, copy_to_tp, reduce_from_tp
from xronos.model.head import chunked_loss_sum, chunks
from xronos.parallel.columns import project_columns
from xronos.planner.plan import segment_kind

VOCAB = segment_kind("vocab")  # the segment these collectives close (calibration)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits: torch.Tensor, targets: torch.Tensor, v0: int, group: TPGroup
    ) -> torch.Tensor:
        # logits: (N, V_r) fp32; targets: (N,) with -100 = ignored
        n, v_local = logits.shape
        valid = targets != -100
        local_t = targets - v0
        owned = valid & (local_t >= 0) & (local_t < v_local)
        idx = torch.where(owned, local_t, torch.zeros_like(local_t))
        if v_local > 0:
            lse_r = torch.logsumexp(logits, dim=-1)
            t_r = logits.gather(1, idx.unsqueeze(1)).squeeze(1) * owned
        else:
            lse_r = logits.new_full((n,), float("-inf"))
            t_r = logits.new_zeros(n)
        stats = torch.stack([lse_r, t_r])  # (2, N)
        gathered = torch.stack(group.all_gather(stats, "vocab.ce", VOCAB))  # (R, 2, N)
        lse = torch.logsumexp(gathered[:, 0], dim=0)  # (N,)
        target_logit = gathered[:, 1].sum(0)
        loss = ((lse - target_logit) * valid).sum()
        ctx.save_for_backward(logits, lse, idx, owned, valid)
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        logits, lse, idx, owned, valid = ctx.saved_tensors
        grad = torch.exp(logits - lse.unsqueeze(1))
        if grad.shape[1] > 0:
            grad.scatter_add_(1, idx.unsqueeze(1), -owned.to(grad.dtype).unsqueeze(1))
        grad *= valid.to(grad.dtype).unsqueeze(1) * g
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, v0: int, group: TPGroup
) -> torch.Tensor:
    """Summed cross-entropy over targets != -100 from each rank's logit slice."""
    return _VocabParallelCE.apply(logits, targets, v0, group)  # type: ignore[no-any-return]


class VocabParallelHead(nn.Module):
    """Replaces ``LMHead`` on a sharded model; ``lm_head`` holds rows ``[v0, v0 + V_r)``."""

    def __init__(self, lm_head: nn.Linear, v0: int, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.lm_head = lm_head
        self.v0, self.vocab_size, self.group = v0, vocab_size, group
        self.chunked = False
        """The loss in chunks of tokens, logits computed again in backward (activation
        checkpointing, :func:`~xronos.model.head.chunked_loss_sum`)."""

    def local_logits(self, h: torch.Tensor) -> torch.Tensor:
        (logits,) = project_columns(h, self.group, "head", VOCAB, (self.lm_head,))
        return logits

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full logits (B, S, V), gathered: for inference and tests, never in training."""
        local = self.local_logits(h).detach()
        width = self.group.all_gather(torch.tensor([local.shape[-1]]), "vocab.sizes")
        pad = max(int(w) for w in width)
        padded = F.pad(local, (0, pad - local.shape[-1]))
        parts = self.group.all_gather(padded, "vocab.logits")
        return torch.cat([p[..., : int(w)] for p, w in zip(parts, width, strict=True)], dim=-1)

    def loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n = targets.numel()  # explicit: a rank may hold zero vocabulary rows
        if chunks(self.chunked, self.lm_head, h, n):
            x = copy_to_tp(h, self.group, "head", VOCAB).reshape(n, h.shape[-1])
            return chunked_loss_sum(
                x, self.lm_head.weight, targets.reshape(n), self.v0, self._stats
            )
        logits = self.local_logits(h).float()
        return vocab_parallel_cross_entropy(
            logits.reshape(n, logits.shape[-1]), targets.reshape(n), self.v0, self.group
        )

    def _stats(self, mine: torch.Tensor) -> list[torch.Tensor]:
        return self.group.all_gather(mine, "vocab.ce", VOCAB)

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """argmax over the full vocabulary of (B, H) hidden states -> (B,) token ids, with
        ties broken towards the lowest id as ``torch.argmax`` does on one device."""
        local = self.local_logits(h).detach().float()  # (B, V_r)
        if local.shape[-1] > 0:
            val, arg = local.max(dim=-1)
            arg = arg + self.v0
        else:
            val = local.new_full(local.shape[:1], float("-inf"))
            arg = torch.full(local.shape[:1], self.vocab_size, dtype=torch.long)
        parts = self.group.all_gather(torch.stack([val, arg.to(val.dtype)]), "vocab.greedy")
        stacked = torch.stack(parts)  # (R, 2, B)
        best = stacked[:, 0].max(dim=0).values
        cand = torch.where(stacked[:, 0] == best, stacked[:, 1], float("inf"))
        return cand.min(dim=0).values.long()


class VocabParallelEmbedding(nn.Module):
    """Token embedding split by vocabulary rows (used when the embedding is tied to the
    vocab-parallel head): look up owned ids, zero the rest, all-reduce (B, S, H)."""

    def __init__(self, weight: torch.Tensor, v0: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.v0, self.group = v0, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.v0
        owned = (local >= 0) & (local < self.weight.shape[0])
        if self.weight.shape[0] > 0:
            x = F.embedding(torch.where(owned, local, 0), self.weight) * owned.unsqueeze(-1)
        else:
            x = self.weight.new_zeros(*ids.shape, self.weight.shape[1]) + 0 * self.weight.sum()
        return reduce_from_tp(x, self.group, "embed", VOCAB)
