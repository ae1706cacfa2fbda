"""Rotary position embeddings, with Llama 3's frequency scaling and linear scaling.

``rotate_half`` convention (Hugging Face): the head dim is split into two halves
``[x1, x2]`` and rotated as ``[x1·cos − x2·sin, x2·cos + x1·sin]``. RoPE acts within each
head, so slicing heads across devices leaves it unchanged (it is replicated work).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xronos.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """(d/2,) rotary inverse frequencies, after ``rope_scaling`` if any; computed on the CPU
    even where the model is built on ``meta``, whose factory functions import torch's
    compiler (2 s and 71 MiB a process)."""
    d = cfg.head_dim
    steps = torch.arange(0, d, 2, dtype=torch.float64, device="cpu")
    inv = 1.0 / (cfg.rope_theta ** (steps / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)

    def forward(
        self, start: int, length: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (S, d) for positions ``start .. start+length-1``."""
        pos = torch.arange(start, start + length, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)  # (S, d/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (S, d)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(
    q: torch.Tensor,  # (B, nq, S, d)
    k: torch.Tensor,  # (B, nkv, S, d)
    cos: torch.Tensor,  # (S, d)
    sin: torch.Tensor,  # (S, d)
) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
