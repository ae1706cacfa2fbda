"""A LLaMA-family decoder as plain single-device PyTorch.

Covers Llama 2/3/3.x, Mistral, SmolLM/TinyLlama (GQA, tied or untied embeddings),
Qwen2/2.5 (bias on q/k/v) and Qwen3 (per-head RMSNorm on q and k). Parameter names match
Hugging Face (``model.layers.0.self_attn.q_proj.weight`` ...), so checkpoints load and
export without renaming.

Nothing here knows about devices. Tensor parallelism arrives from outside
(``xronos.parallel.shard_model``) through two seams per block:

* ``enter`` -- identity on one device; ``copy_to_tp`` (backward all-reduce) when sharded,
  which may also run the projections it feeds (:func:`project`: their backward then
  overlaps that all-reduce with the weight gradients).
* ``exit``  -- identity on one device; ``reduce_from_tp`` (forward all-reduce) when sharded.

and through the *shapes* of the projections: a sharded attention simply has fewer heads
(``q_proj.out_features // head_dim`` query heads, ``k_proj.out_features // head_dim`` KV
heads, and ``q_offset`` when its first KV group is shared with the rank before), a sharded
MLP fewer columns. The forward code reads
the local sizes from the weights and is the same for one device and many.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from xronos.config import ModelConfig
from xronos.model.head import chunked_loss_sum, chunks, head_logits, one_rank
from xronos.model.norm import RMSNorm
from xronos.model.recompute import recomputed
from xronos.model.rope import RotaryEmbedding, apply_rotary


class Head(Protocol):
    """What the model asks of its LM head (single-device or vocab-parallel)."""

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def greedy(self, h: torch.Tensor) -> torch.Tensor: ...


def project(
    enter: nn.Module, x: torch.Tensor, linears: tuple[nn.Module, ...]
) -> tuple[torch.Tensor, ...]:
    """The ``enter`` seam, then each of ``linears`` on its output: the seam's own
    ``project`` where it has one (a sharded block's fuses them), else one after the other."""
    fused = getattr(enter, "project", None)
    if fused is not None:
        return fused(x, linears)  # type: ignore[no-any-return]
    y = enter(x)
    return tuple(lin(y) for lin in linears)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.head_dim = d
        self.q_per_kv = cfg.q_per_kv
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.enter: nn.Module = nn.Identity()
        self.exit: nn.Module = nn.Identity()
        # Query heads of the first local KV group that precede the first local query head
        # (held by another rank when a KV group is shared): 0 on one device.
        self.q_offset = 0

    def forward(
        self,
        x: torch.Tensor,  # (B, S, H)
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        return self.exit(self.local(x, cos_sin, cache))  # type: ignore[no-any-return]

    def local(
        self,
        x: torch.Tensor,  # (B, S, H)
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Everything up to the ``exit`` seam: this rank's partial output (B, S, H)."""
        b, s, _ = x.shape
        d = self.head_dim
        # Local heads: all of them on one device; on a sharded one a contiguous range of
        # query heads and the K/V heads of every group they touch, possibly none (the empty
        # projections then yield zeros, and the seams' collectives still run).
        n_q, n_kv = self.q_proj.weight.shape[0] // d, self.k_proj.weight.shape[0] // d
        q, k, v = project(self.enter, x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(b, s, n_q, d).transpose(1, 2)  # (B, nq, S, d)
        k = k.view(b, s, n_kv, d).transpose(1, 2)  # (B, nkv, S, d)
        v = v.view(b, s, n_kv, d).transpose(1, 2)  # (B, nkv, S, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *cos_sin)
        if cache is not None:
            k, v = cache.update(self, k, v)
        causal = cache is None or s > 1
        mask = cache.mask(s) if cache is not None else None
        if mask is not None:
            causal = False  # the mask is causal too
        if n_q == 0:  # no local query head: nothing to attend (some CPU attention kernels
            # divide their work by the head count); the empty q keeps the seams in the graph
            y = q
        elif self.q_offset == 0 and n_q == n_kv * self.q_per_kv:  # whole KV groups
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.q_per_kv > 1
            )  # (B, nq, S, d)
        else:  # local query head j reads local KV head (q_offset + j) // q_per_kv
            kv = torch.div(
                torch.arange(n_q, device=q.device) + self.q_offset,
                self.q_per_kv,
                rounding_mode="floor",
            )
            y = F.scaled_dot_product_attention(
                q, k.index_select(1, kv), v.index_select(1, kv), attn_mask=mask, is_causal=causal
            )  # (B, nq, S, d)
        y = y.transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(y)  # type: ignore[no-any-return]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.enter: nn.Module = nn.Identity()
        self.exit: nn.Module = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.exit(self.local(x))  # type: ignore[no-any-return]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """Everything up to the ``exit`` seam: this rank's partial output."""
        gate, up = project(self.enter, x, (self.gate_proj, self.up_proj))
        return self.down_proj(F.silu(gate) * up)  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.recompute = False
        """Activation checkpointing (see :mod:`xronos.model.recompute`)."""

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        if self.recompute and cache is None and torch.is_grad_enabled():
            norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
            attn = recomputed(self.self_attn, lambda t: self.self_attn.local(norm1(t), cos_sin))
            x = x + self.self_attn.exit(attn(x))
            mlp = recomputed(self.mlp, lambda t: self.mlp.local(norm2(t)))
            return x + self.mlp.exit(mlp(x))  # type: ignore[no-any-return]
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """An embedding table; on the ``meta`` device without drawing its initial values, which
    would be lost anyway: a random draw on ``meta`` imports torch's compiler, 2 s and 71 MiB
    in every process that builds a model."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))
    return nn.Embedding(rows, dim)


class Decoder(nn.Module):
    """Embedding + blocks + final norm (Hugging Face's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = _embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)
        # Replaced by a vocab-parallel head when sharded; see xronos.parallel.vocab.
        self.head: Head = LMHead(self.lm_head)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, S, H) of ``input_ids`` (B, S): the residual stream's start."""
        return self.model.embed_tokens(input_ids)  # type: ignore[no-any-return]

    def decode(
        self,
        x: torch.Tensor,  # (B, S, H)
        layers: range | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Run decoder ``layers`` (default: all) on the residual stream ``x`` (B, S, H); a
        pipeline stage runs its own range."""
        pos0 = cache.length if cache is not None else 0
        cos_sin = self.rotary(pos0, x.shape[1], x.dtype)
        for i in layers if layers is not None else range(len(self.model.layers)):
            x = self.model.layers[i](x, cos_sin, cache)
        return x

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # (B, S)
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states (B, S, H)."""
        x = self.decode(self.embed(input_ids), cache=cache)
        if cache is not None:
            cache.length += input_ids.shape[1]
        return self.model.norm(x)  # type: ignore[no-any-return]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, S, V_local): the full vocabulary on one device, a slice when sharded."""
        return self.head.logits(self.hidden_states(input_ids))

    def head_loss_sum(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and summed next-token cross-entropy of the residual stream
        ``x`` (B, S, H) against unshifted ``labels`` (B, S) (-100 = ignore)."""
        return self.head.loss_sum(self.model.norm(x)[:, :-1], labels[:, 1:])

    def loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed next-token cross-entropy over labels != -100 (labels are unshifted)."""
        return self.head_loss_sum(self.decode(self.embed(input_ids)), labels)


class LMHead(nn.Module):
    """Single-device LM head; the vocab-parallel one has the same two methods."""

    def __init__(self, lm_head: nn.Linear) -> None:
        super().__init__()
        self.lm_head = lm_head
        self.chunked = False
        """The loss in chunks of tokens, logits computed again in backward (activation
        checkpointing, :func:`~xronos.model.head.chunked_loss_sum`)."""

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)  # type: ignore[no-any-return]

    def loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if chunks(self.chunked, self.lm_head, h, targets.numel()):
            flat = h.reshape(-1, h.shape[-1])
            return chunked_loss_sum(flat, self.lm_head.weight, targets.reshape(-1), 0, one_rank)
        logits = head_logits(self.lm_head, h).float()
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """(B, H) hidden states -> (B,) argmax token ids."""
        return self.lm_head(h).argmax(dim=-1)  # type: ignore[no-any-return]


class KVCache:
    """Per-layer key/value cache for greedy decoding: (B, nkv_local, S_total, d).

    ``valid`` (B, S_prompt), for prompts of different lengths padded on the left: which
    positions hold tokens (every later one does). A token then attends to the valid
    positions up to its own (a padding position only to itself, so that nothing is empty);
    rotary embeddings are relative, so the shift the padding gives changes no score.
    """

    def __init__(self, valid: torch.Tensor | None = None) -> None:
        self.length = 0
        self.valid = valid
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def mask(self, s: int) -> torch.Tensor | None:
        """The attention mask (B, 1, s, S_total) of ``s`` new positions, or None (plain
        causal attention) without padding."""
        if self.valid is None:
            return None
        total = self.length + s
        b, width = self.valid.shape
        if width < total:  # the tokens decoded after the prompts are all real
            self.valid = torch.cat([self.valid, self.valid.new_ones(b, total - width)], 1)
        q_pos = torch.arange(total - s, total).unsqueeze(1)
        k_pos = torch.arange(total).unsqueeze(0)
        allowed = (k_pos <= q_pos).unsqueeze(0) & self.valid.unsqueeze(1)
        return (allowed | (k_pos == q_pos).unsqueeze(0)).unsqueeze(1)

    def update(
        self, attn: nn.Module, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(attn)
        if key in self._kv:
            pk, pv = self._kv[key]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        self._kv[key] = (k, v)
        return k, v


def init_weights(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    """Deterministic initialisation from ``seed``: the same master weights on every rank.

    Linear/embedding weights ~ N(0, std), biases 0, norms 1. Parameters are visited in
    ``named_parameters`` order, so the result depends only on the config and the seed.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
