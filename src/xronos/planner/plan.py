"""The Plan: how many units of each segment every device holds.

A *segment* is a group of tensors that ends in one barrier (an all-reduce) and is split
along one axis:

========  ====================================  ======================================
segment   unit of partition                     total units
========  ====================================  ======================================
attn      one query head; a device computes      ``num_heads``
          the K/V of every KV group it touches
          (a cut group's K/V on each side)
mlp       ``mlp_chunk`` intermediate columns      ``ceil(intermediate_size / mlp_chunk)``
vocab     ``vocab_chunk`` vocabulary rows          ``ceil(vocab_size / vocab_chunk)``
========  ====================================  ======================================

Device ``i`` holds the contiguous units ``[sum(split[:i]), sum(split[:i+1]))``; the last
unit of a segment may be shorter than the chunk. A device may hold zero units.
The Plan is data: it is computed once (by the planner, or evenly, or from user shares),
written to ``plan.json`` and broadcast, and ``shard_model`` reads it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from xronos.config import ModelConfig
from xronos.errors import UserError

SEGMENTS = ("attn", "mlp", "vocab")


def segment_kind(segment: str, layer: int | None = None) -> str:
    """The tag a collective that closes ``segment`` (of decoder ``layer``) carries in its
    recorded span's ``kind``: how measurements are attributed back to the plan's segments
    (see :func:`parse_segment_kind`)."""
    if segment not in SEGMENTS:
        raise ValueError(f"unknown segment {segment!r}; one of {SEGMENTS}")
    return segment if layer is None else f"{segment}@{layer}"


def parse_segment_kind(kind: str) -> tuple[str, int | None] | None:
    """``(segment, layer or None)`` of a tag made by :func:`segment_kind`; None for a span
    that closes no segment (gradient norm, checkpoint, ...)."""
    segment, _, layer = kind.partition("@")
    if segment not in SEGMENTS:
        return None
    return segment, int(layer) if layer else None


def default_mlp_chunk(intermediate_size: int) -> int:
    """Largest SIMD-friendly chunk (64 .. 8) that divides the MLP width into at least 64
    units (fine enough to balance within ~2 %), else 8."""
    for g in (64, 32, 16, 8):
        if intermediate_size % g == 0 and intermediate_size // g >= 64:
            return g
    return 8


def default_vocab_chunk(vocab_size: int) -> int:
    """Vocabulary rows per unit: about 256 units in all, a multiple of 8."""
    return max(8, 8 * math.ceil(vocab_size / 256 / 8))


def segment_units(cfg: ModelConfig, mlp_chunk: int, vocab_chunk: int) -> dict[str, int]:
    return {
        "attn": cfg.num_heads,
        "mlp": math.ceil(cfg.intermediate_size / mlp_chunk),
        "vocab": math.ceil(cfg.vocab_size / vocab_chunk),
    }


def proportional_split(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Integer split of ``total`` proportional to ``weights`` (largest remainder)."""
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
    s = sum(weights)
    raw = [total * w / s for w in weights]
    out = [math.floor(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], -weights[i]))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Units per device per segment, plus what the planner predicted for them."""

    strategy: str
    """How the plan was made: ``xronos``, ``tp-even``, ``shares`` or ``single``."""
    devices: tuple[str, ...]
    """Device names, in rank order."""
    attn: tuple[int, ...]
    """Query heads per device."""
    mlp: tuple[int, ...]
    """MLP chunks per device."""
    vocab: tuple[int, ...]
    """Vocabulary chunks per device."""
    mlp_chunk: int
    """Intermediate columns in one MLP unit."""
    vocab_chunk: int
    """Vocabulary rows in one vocab unit."""
    predicted_s: dict[str, tuple[float, ...]] = field(default_factory=dict, compare=False)
    """Per segment, the predicted time of each device (seconds; planner output, optional)."""

    def __post_init__(self) -> None:
        for seg in SEGMENTS:
            split = getattr(self, seg)
            object.__setattr__(self, seg, tuple(int(u) for u in split))
            if len(split) != len(self.devices):
                raise ValueError(
                    f"plan: {seg} has {len(split)} entries for {len(self.devices)} devices"
                )
            if any(u < 0 for u in split):
                raise ValueError(f"plan: negative units in {seg}: {split}")
        object.__setattr__(self, "devices", tuple(self.devices))

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def split(self, segment: str) -> tuple[int, ...]:
        return getattr(self, segment)  # type: ignore[no-any-return]

    def check(self, cfg: ModelConfig) -> None:
        """Raise UserError if the plan does not cover ``cfg`` exactly."""
        totals = segment_units(cfg, self.mlp_chunk, self.vocab_chunk)
        for seg, total in totals.items():
            if sum(self.split(seg)) != total:
                raise UserError(
                    f"plan: {seg} units sum to {sum(self.split(seg))} but the model has {total}; "
                    "re-run `xronos plan` for this model"
                )

    # -- element ranges ------------------------------------------------------------------
    def bounds(self, segment: str, rank: int, total_elems: int) -> tuple[int, int]:
        """[start, end) along the partitioned dim of ``segment`` for ``rank``.

        ``total_elems`` is the full length of that dim in units of the segment's element:
        query heads for attn, intermediate columns for mlp, vocabulary rows for vocab.
        """
        chunk = {"attn": 1, "mlp": self.mlp_chunk, "vocab": self.vocab_chunk}[segment]
        split = self.split(segment)
        start_u = sum(split[:rank])
        return min(start_u * chunk, total_elems), min((start_u + split[rank]) * chunk, total_elems)

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def from_shares(
        cls,
        cfg: ModelConfig,
        shares: Sequence[float],
        devices: Sequence[str] | None = None,
        strategy: str = "shares",
        mlp_chunk: int | None = None,
        vocab_chunk: int | None = None,
    ) -> Plan:
        """Every segment split in proportion to ``shares`` (e.g. 2,1,1 -> 50/25/25 %)."""
        mlp_chunk = mlp_chunk or default_mlp_chunk(cfg.intermediate_size)
        vocab_chunk = vocab_chunk or default_vocab_chunk(cfg.vocab_size)
        totals = segment_units(cfg, mlp_chunk, vocab_chunk)
        names = tuple(devices) if devices else tuple(f"dev{i}" for i in range(len(shares)))
        return cls(
            strategy=strategy,
            devices=names,
            attn=proportional_split(totals["attn"], shares),
            mlp=proportional_split(totals["mlp"], shares),
            vocab=proportional_split(totals["vocab"], shares),
            mlp_chunk=mlp_chunk,
            vocab_chunk=vocab_chunk,
        )

    @classmethod
    def even(cls, cfg: ModelConfig, devices: Sequence[str]) -> Plan:
        """Megatron's even split. Where a segment does not divide evenly the remainder goes
        to the first devices (Megatron would refuse; we take the nearest split)."""
        return cls.from_shares(cfg, [1.0] * len(devices), devices, strategy="tp-even")

    @classmethod
    def single(cls, cfg: ModelConfig, device: str = "dev0") -> Plan:
        return cls.from_shares(cfg, [1.0], [device], strategy="single")

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["predicted_s"] = {k: list(v) for k, v in self.predicted_s.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        try:
            return cls(
                strategy=str(d["strategy"]),
                devices=tuple(d["devices"]),
                attn=tuple(d["attn"]),
                mlp=tuple(d["mlp"]),
                vocab=tuple(d["vocab"]),
                mlp_chunk=int(d["mlp_chunk"]),
                vocab_chunk=int(d["vocab_chunk"]),
                predicted_s={k: tuple(v) for k, v in d.get("predicted_s", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(
                f"plan: malformed plan JSON ({e}); regenerate it with `xronos plan`"
            ) from e

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise UserError(f"plan: invalid JSON at line {e.lineno}: {e.msg}") from e

    def table(self) -> str:
        """A plain-text table: device, units per segment, predicted time and idle."""
        rows = [("device", "attn", "mlp", "vocab", "pred. s/step", "pred. idle s")]
        pred = self.predicted_s  # empty for a plan made without profiles (tp-even): "-"
        worst = {s: max(pred[s]) for s in pred}
        for i, name in enumerate(self.devices):
            busy = sum(pred[s][i] for s in SEGMENTS if s in pred)
            idle = sum(worst[s] - pred[s][i] for s in pred)
            times = (f"{busy:.4f}", f"{idle:.4f}") if pred else ("-", "-")
            rows.append((name, str(self.attn[i]), str(self.mlp[i]), str(self.vocab[i]), *times))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        return "\n".join(
            "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows
        )
