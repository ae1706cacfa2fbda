"""The communication model: links as ``latency + bytes / bandwidth``, and what a step sends.

**Links — a star.** Every device hangs off one switch by its own link, with a latency
``lat_i`` (seconds per message) and a bandwidth ``bw_i`` (bytes per second)::

        dev0 ──(lat0, bw0)──┐
        dev1 ──(lat1, bw1)──┼── switch
        dev2 ──(lat2, bw2)──┘

so a message of ``b`` bytes from ``i`` to ``j`` takes ``lat_i + lat_j + b / min(bw_i, bw_j)``
(:func:`pair`). A ring all-reduce of ``b`` bytes over ``r`` ranks takes ``2(r − 1)`` rounds,
each moving ``b / r`` bytes over every edge of the ring at once, so a round lasts as long as
the slowest edge: ``2(r − 1) · (max_edge lat + b / (r · min bw))`` (:func:`ring`, then
:meth:`LinkModel.allreduce_s`). Two ranks exchange their whole tensors in one round
(:mod:`xronos.comm.exchange`): ``lat + b / bw``. With one rank nothing moves.

**Measurement** (:mod:`xronos.profiler.run`): every pair of devices exchanges messages of
two sizes; a line through those points is the pair's link (:meth:`LinkModel.fit`), and
:func:`star_links` turns the pairs into per-device links: ``bw_i`` is the best bandwidth any
pair with ``i`` reached (equal to ``bw_i`` unless ``i`` is the fastest, where it is the
second fastest — which changes no prediction, since every pair and ring with ``i`` has
another member), and the latencies solve ``lat_i + lat_j = L_ij`` in least squares. The
all-reduce over the whole profiled group is measured too, at two sizes; for exactly that
group the measured line is used, for any other subset the star model.

**Bulk.** A link may pass a burst at a higher rate than it sustains (a token bucket, a TCP
window opening): a line through the activation's sizes then under-prices a message many
times larger, such as a pipeline's tied-embedding gradient. Each pair also exchanges a
message four times the activation; the rate it implies beyond the line's largest size (the
*knee*) prices every byte past the knee (:meth:`LinkModel.with_bulk`).

**Traffic of a tensor-parallel step** (:func:`tp_traffic`), per segment barrier: ``attn``
and ``mlp`` each close with two all-reduces of the activation (``B·S·H`` fp32) per layer —
one forward after the row-parallel projection, one backward before the column-parallel
ones; ``vocab`` with one (the backward all-reduce before the LM head) plus the loss's small
all-gather of two floats per token; ``step`` holds the gradient-norm all-reduce (and, with
tied embeddings, the vocab-parallel embedding's all-reduce of the activation). The LoRA
gradients' one flattened all-reduce per step is not counted (its size is the adapters',
small next to the activations').
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

#: ``(count, bytes)`` of the collectives that close one barrier.
Traffic = dict[str, list[tuple[int, int]]]


@dataclass(frozen=True)
class LinkModel:
    """``t(b) = latency_s + b / bandwidth_bps`` seconds for a message of ``b`` bytes."""

    latency_s: float
    """Fixed cost per message (seconds)."""
    bandwidth_bps: float
    """Bytes per second (``inf``: bytes cost nothing)."""
    knee_bytes: float = math.inf
    """Up to this many bytes a message costs the line; inf: the line throughout."""
    bulk_bps: float = math.inf
    """Bytes per second beyond ``knee_bytes`` (unused while the knee is inf): a shaped link
    passes a burst at line rate and the rest at its sustained rate, so a message much larger
    than the line's sizes needs a point of its own (:meth:`with_bulk`)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"link latency must be finite and >= 0, got {self.latency_s}")
        if not self.bandwidth_bps > 0 or not self.bulk_bps > 0:
            raise ValueError(
                f"link bandwidths must be > 0, got {self.bandwidth_bps} and {self.bulk_bps}"
            )
        if not self.knee_bytes >= 0:
            raise ValueError(f"link knee must be >= 0 bytes, got {self.knee_bytes}")

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> LinkModel:
        """Least-squares line through ``(bytes, seconds)`` points (two sizes or more).

        A negative intercept (noise on a fast link) becomes 0; a flat or falling line
        (bytes cost nothing measurable) becomes an infinite bandwidth.
        """
        if len({b for b, _ in points}) < 2:
            raise ValueError(f"LinkModel.fit needs points at two sizes or more, got {points}")
        n = len(points)
        mb = sum(b for b, _ in points) / n
        mt = sum(t for _, t in points) / n
        slope = sum((b - mb) * (t - mt) for b, t in points) / sum((b - mb) ** 2 for b, _ in points)
        if slope <= 0:
            return cls(max(0.0, mt), math.inf)
        return cls(max(0.0, mt - slope * mb), 1.0 / slope)

    def with_bulk(self, knee_bytes: float, nbytes: float, seconds: float) -> LinkModel:
        """This line up to ``knee_bytes`` (the largest size it was fitted on), and beyond it
        the rate that a message of ``nbytes > knee_bytes`` taking ``seconds`` implies; a
        message no slower than the line keeps the line."""
        extra = seconds - self.p2p_s(knee_bytes)
        if nbytes <= knee_bytes or extra <= 0:
            return self
        bulk = (nbytes - knee_bytes) / extra
        if bulk >= self.bandwidth_bps:
            return self
        return replace(self, knee_bytes=knee_bytes, bulk_bps=bulk)

    @property
    def sustained_bps(self) -> float:
        """Bytes per second of a message far beyond the knee."""
        return self.bulk_bps if math.isfinite(self.knee_bytes) else self.bandwidth_bps

    def p2p_s(self, nbytes: float) -> float:
        """One message of ``nbytes`` bytes over this link."""
        line = min(nbytes, self.knee_bytes)
        bulk = nbytes - line
        return self.latency_s + line / self.bandwidth_bps + (bulk / self.bulk_bps if bulk else 0.0)

    def allreduce_s(self, nbytes: float, ranks: int) -> float:
        """A ring all-reduce of ``nbytes`` over ``ranks`` ranks whose slowest edge is this
        link; two ranks exchange their tensors in one round (:mod:`xronos.comm.exchange`)."""
        if ranks <= 1:
            return 0.0
        if ranks == 2:
            return self.p2p_s(nbytes)
        return 2 * (ranks - 1) * self.p2p_s(nbytes / ranks)

    def to_dict(self) -> dict[str, float | str]:
        def num(x: float) -> float | str:
            return x if math.isfinite(x) else "inf"

        d: dict[str, float | str] = {
            "latency_s": self.latency_s,
            "bandwidth_bps": num(self.bandwidth_bps),
        }
        if math.isfinite(self.knee_bytes):
            d |= {"knee_bytes": self.knee_bytes, "bulk_bps": num(self.bulk_bps)}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinkModel:
        return cls(
            float(d["latency_s"]),
            float(d["bandwidth_bps"]),
            float(d.get("knee_bytes", math.inf)),
            float(d.get("bulk_bps", math.inf)),
        )


def slowest(links: Sequence[LinkModel], latency_s: float) -> LinkModel:
    """A link with ``latency_s`` that is as narrow as the narrowest of ``links`` at every size."""
    knee = min(x.knee_bytes for x in links)
    return LinkModel(
        latency_s,
        min(x.bandwidth_bps for x in links),
        knee,
        min(x.sustained_bps for x in links) if math.isfinite(knee) else math.inf,
    )


def pair(a: LinkModel, b: LinkModel) -> LinkModel:
    """The path between two devices of the star: latencies add, the narrower link limits."""
    return slowest((a, b), a.latency_s + b.latency_s)


def ring(links: Sequence[LinkModel]) -> LinkModel:
    """The slowest edge of a ring through ``links`` (in order): what every round waits for."""
    if len(links) < 2:
        return LinkModel(0.0, math.inf)
    edges = [pair(links[i], links[(i + 1) % len(links)]) for i in range(len(links))]
    return slowest(edges, max(e.latency_s for e in edges))


def star_links(n: int, pairs: Mapping[tuple[int, int], LinkModel]) -> list[LinkModel]:
    """Per-device links of the star from measured pair links ``{(i, j): link}``, ``i < j``.

    Args:
        n: devices.
        pairs: every pair's fitted link (all ``n(n−1)/2`` of them).
    """
    missing = [(i, j) for i in range(n) for j in range(i + 1, n) if (i, j) not in pairs]
    if n < 2 or missing:
        raise ValueError(f"star_links: need every pair of {n} devices; missing {missing}")

    def of(i: int, j: int) -> LinkModel:
        return pairs[(min(i, j), max(i, j))]

    bw = [max(of(i, j).bandwidth_bps for j in range(n) if j != i) for i in range(n)]
    bulk = [max(of(i, j).sustained_bps for j in range(n) if j != i) for i in range(n)]
    knee = min(p.knee_bytes for p in pairs.values())
    if n == 2:
        lat = [pairs[(0, 1)].latency_s / 2] * 2
    else:
        # Σ_{j≠i} L_ij = (n−2)·lat_i + S  and  Σ_{pairs} L = (n−1)·S, S = Σ lat.
        total = sum(p.latency_s for p in pairs.values()) / (n - 1)
        lat = [
            max(0.0, (sum(of(i, j).latency_s for j in range(n) if j != i) - total) / (n - 2))
            for i in range(n)
        ]
    if not math.isfinite(knee):
        return [LinkModel(lat[i], bw[i]) for i in range(n)]
    return [LinkModel(lat[i], bw[i], knee, bulk[i]) for i in range(n)]


def tp_traffic(
    *, num_layers: int, hidden_size: int, tokens: int, tied_embeddings: bool = False
) -> Traffic:
    """The collectives of one tensor-parallel training step, per barrier (see the top).

    Args:
        num_layers: decoder layers.
        hidden_size: ``H``.
        tokens: ``B·S`` tokens of one forward/backward pass.
        tied_embeddings: the embedding is vocab-parallel and all-reduces its output.
    """
    act = 4 * tokens * hidden_size  # fp32 (B, S, H)
    step = [(1, 4)] + ([(1, act)] if tied_embeddings else [])
    return {
        "attn": [(2 * num_layers, act)],
        "mlp": [(2 * num_layers, act)],
        "vocab": [(1, act), (1, 8 * tokens)],
        "step": step,
    }


OVERLAP_SHARE = {"attn": 3 / 12, "mlp": 2 / 9, "vocab": 1 / 3}
"""Of a barrier's compute, the share that runs while its column seams' backward all-reduces
are on the wire (:mod:`xronos.parallel.columns`): the weight gradients of the projections
after the seam, counted in products of equal size per unit. Attention: q, k and v of 12
(four projections, each forward, input gradient and weight gradient; the attention core,
~6 % of the projections' work at 64 tokens and hidden 512, is left out); MLP: gate and up
of 9; the LM head: its weight gradient, 1 of 3. What overlapping costs the CPU that both
computes and moves the bytes is the measured :attr:`Network.overlap_loss`."""


def overlapped_seams(traffic: Traffic) -> dict[str, int]:
    """Per barrier, how many of its activation all-reduces (the largest messages) are a
    column seam's backward, which overlaps the weight gradients: one of each layer's two
    at ``attn`` and ``mlp``, the LM head's at ``vocab``."""
    act = max((b for entries in traffic.values() for _, b in entries), default=0)
    out = {}
    for s in OVERLAP_SHARE:
        count = sum(c for c, b in traffic.get(s, ()) if b == act and act > 0)
        out[s] = count // 2 if s != "vocab" else min(count, 1)
    return out


@dataclass(frozen=True)
class Network:
    """The links among a set of devices, as the planner predicts with them."""

    names: tuple[str, ...]
    """Devices, in rank order."""
    links: tuple[LinkModel, ...]
    """Each device's link to the switch (star model), same order as ``names``."""
    measured: tuple[tuple[str, ...], LinkModel] | None = None
    """The group an all-reduce was measured on, and its line ``t(b)`` (whole operation)."""
    overlap_loss: float = 0.0
    """Of the overlapped seconds, the share the overlap fails to hide
    (:mod:`xronos.profiler.overlap`; 0: hidden as if free)."""

    def link(self, name: str) -> LinkModel:
        return self.links[self.names.index(name)]

    def allreduce_s(self, nbytes: float, ranks: Sequence[str]) -> float:
        """One all-reduce of ``nbytes`` over the devices ``ranks``."""
        if len(ranks) <= 1:
            return 0.0
        if self.measured is not None and set(self.measured[0]) == set(ranks):
            return self.measured[1].p2p_s(nbytes)
        return ring([self.link(r) for r in ranks]).allreduce_s(nbytes, len(ranks))

    def p2p_s(self, nbytes: float, src: str, dst: str) -> float:
        """One message of ``nbytes`` from ``src`` to ``dst`` (0 on the same device)."""
        return 0.0 if src == dst else pair(self.link(src), self.link(dst)).p2p_s(nbytes)

    def hidden_s(
        self, traffic: Traffic, ranks: Sequence[str], barriers: Mapping[str, float]
    ) -> dict[str, float]:
        """Seconds of each barrier's collectives that its weight gradients hide: the
        overlapped seams' all-reduces, up to :data:`OVERLAP_SHARE` of the barrier's
        compute (``barriers``: seconds from one barrier to the next, per segment), less
        :attr:`overlap_loss` of them (negative where overlapping loses)."""
        act = max((b for entries in traffic.values() for _, b in entries), default=0)
        one = self.allreduce_s(act, ranks)
        return {
            s: min(n * one, OVERLAP_SHARE[s] * barriers.get(s, 0.0)) * (1 - self.overlap_loss)
            for s, n in overlapped_seams(traffic).items()
            if n > 0
        }

    def traffic_s(
        self, traffic: Mapping[str, Sequence[tuple[int, int]]], ranks: Sequence[str]
    ) -> dict[str, float]:
        """Seconds of each barrier's collectives over ``ranks``."""
        return {
            seg: sum(c * self.allreduce_s(b, ranks) for c, b in items)
            for seg, items in traffic.items()
        }
