"""What one rank recorded during one training step, and how it travels to rank 0.

A :class:`StepRecord` holds the step's bounds and two lists of :class:`Span`:

- ``collectives``: blocking communication, ``start`` = *arrive* (the rank enters the call),
  ``end`` = *leave* (the call returns). All-reduces in TP; ``send:<msg>`` / ``recv:<msg>``
  waits in PP (see :mod:`xronos.metrics.analysis` for the naming convention).
- ``computes``: optional explicit compute spans (a microbatch's forward or backward in PP),
  tagged with a ``kind``.

Times are ``time.perf_counter()`` seconds (CLOCK_MONOTONIC on Linux, shared by every process
on one host). Records from another host are moved onto rank 0's clock with
:meth:`StepRecord.shifted` and the offset from :func:`xronos.metrics.clock.estimate_clock_offset`.

Two wire forms:

- :meth:`StepRecord.to_dict` / :meth:`StepRecord.from_dict`: JSON-able, any size.
- :func:`pack_records` / :func:`unpack_records`: one fixed-size float64 tensor, for gloo
  collectives that need equal sizes on every rank (``all_gather``/``gather``). Names travel
  inside the tensor (UTF-8, 6 bytes per float64, exact below 2**53), so ranks need no shared
  name table and pipeline stages may record different events.

Tensor layout (all float64)::

    [MAGIC, n_records, max_events, name_bytes]                                   header
    per record: [rank, step, start, end, n_coll, n_comp, device(w)]              w = ceil(nb/6)
                + max_events x [start, end, is_compute, name(w), kind(w)]        zero padded
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

COLLECTIVE = "collective"
"""Default ``kind`` of a communication span."""
COMPUTE = "compute"
"""Default ``kind`` of an explicit compute span."""
LANE = "lane"
"""``kind`` of the compute span that bounds one lane's work in an overlapped step (its name
is ``L<k>``; that lane's collectives are named ``L<k>:<name>``)."""

_MAGIC = 7_263_021.0  # marks a packed-records tensor; guards against unpacking other data
_HEADER = 4
_BYTES_PER_FLOAT = 6  # 48-bit integers are exact in a float64 mantissa
_RECORD_FIXED = 6


@dataclass(frozen=True, slots=True)
class Span:
    """A named interval ``[start, end]`` in seconds; for communication ``start`` is the
    arrive time and ``end`` the leave time."""

    name: str
    start: float
    end: float
    kind: str = COLLECTIVE

    @property
    def arrive(self) -> float:
        return self.start

    @property
    def leave(self) -> float:
        return self.end

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_list(self) -> list[Any]:
        return [self.name, self.start, self.end, self.kind]

    @classmethod
    def from_list(cls, item: Sequence[Any]) -> Span:
        name, start, end, kind = item
        return cls(str(name), float(start), float(end), str(kind))


@dataclass(frozen=True)
class Phase:
    """One piece of a rank's step: ``kind`` is ``compute``, ``transfer`` or ``idle``."""

    kind: str
    start: float
    end: float
    name: str


@dataclass(frozen=True)
class StepRecord:
    """One rank's recording of one training step."""

    rank: int
    device: str
    step: int
    start: float
    end: float
    collectives: tuple[Span, ...] = ()
    computes: tuple[Span, ...] = ()

    @property
    def duration(self) -> float:
        return self.end - self.start

    def shifted(self, offset_s: float) -> StepRecord:
        """The same record with every time plus ``offset_s`` (moves it onto another clock)."""

        def move(spans: tuple[Span, ...]) -> tuple[Span, ...]:
            return tuple(replace(s, start=s.start + offset_s, end=s.end + offset_s) for s in spans)

        return replace(
            self,
            start=self.start + offset_s,
            end=self.end + offset_s,
            collectives=move(self.collectives),
            computes=move(self.computes),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; spans as ``[name, start, end, kind]`` lists."""
        return {
            "rank": self.rank,
            "device": self.device,
            "step": self.step,
            "start": self.start,
            "end": self.end,
            "collectives": [s.to_list() for s in self.collectives],
            "computes": [s.to_list() for s in self.computes],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRecord:
        return cls(
            rank=int(data["rank"]),
            device=str(data["device"]),
            step=int(data["step"]),
            start=float(data["start"]),
            end=float(data["end"]),
            collectives=tuple(Span.from_list(s) for s in data.get("collectives", ())),
            computes=tuple(Span.from_list(s) for s in data.get("computes", ())),
        )


def _words(name_bytes: int) -> int:
    return math.ceil(name_bytes / _BYTES_PER_FLOAT)


def packed_size(n_records: int, max_events: int, name_bytes: int = 48) -> int:
    """Number of float64 elements :func:`pack_records` produces for these sizes."""
    w = _words(name_bytes)
    per_record = _RECORD_FIXED + w + max_events * (3 + 2 * w)
    return _HEADER + n_records * per_record


@functools.lru_cache(maxsize=4096)
def _name_words(text: str, name_bytes: int) -> tuple[float, ...]:
    """``text`` as the float64 words it travels in (cached: a step's span names are the
    last step's, and encoding them anew every step costs the slowest device most)."""
    raw = text.encode()
    if len(raw) > name_bytes:
        raise ValueError(
            f"span or device name {text!r} is {len(raw)} bytes, over the packing limit of "
            f"{name_bytes}; pass a larger name_bytes to pack_records"
        )
    raw = raw.ljust(_words(name_bytes) * _BYTES_PER_FLOAT, b"\0")
    return tuple(
        float(int.from_bytes(raw[i : i + _BYTES_PER_FLOAT], "little"))
        for i in range(0, len(raw), _BYTES_PER_FLOAT)
    )


def _decode(words: Sequence[float]) -> str:
    return _text(tuple(words))


@functools.lru_cache(maxsize=4096)
def _text(words: tuple[float, ...]) -> str:
    raw = b"".join(int(x).to_bytes(_BYTES_PER_FLOAT, "little") for x in words)
    return raw.rstrip(b"\0").decode()


def pack_records(
    records: Sequence[StepRecord], max_events: int, name_bytes: int = 48
) -> torch.Tensor:
    """Pack ``records`` into one 1-D float64 tensor of :func:`packed_size` elements.

    Every rank that takes part in the same gather must pass the same number of records,
    ``max_events`` and ``name_bytes`` so the tensors have equal sizes.

    Args:
        records: this rank's records (e.g. the steps since the last gather).
        max_events: room per record for collectives + computes together.
        name_bytes: room for each UTF-8 name (span, kind, device).
    """
    if max_events < 0 or name_bytes <= 0:
        raise ValueError("max_events must be >= 0 and name_bytes > 0")
    w = _words(name_bytes)
    out: list[float] = [_MAGIC, float(len(records)), float(max_events), float(name_bytes)]
    for rec in records:
        n_events = len(rec.collectives) + len(rec.computes)
        if n_events > max_events:
            raise ValueError(
                f"step {rec.step} on rank {rec.rank} has {n_events} events, over "
                f"max_events={max_events}; pack with a larger max_events"
            )
        out += [float(rec.rank), float(rec.step), rec.start, rec.end]
        out += [float(len(rec.collectives)), float(len(rec.computes))]
        out += _name_words(rec.device, name_bytes)
        for is_compute, spans in ((0.0, rec.collectives), (1.0, rec.computes)):
            for span in spans:
                out += [span.start, span.end, is_compute]
                out += _name_words(span.name, name_bytes)
                out += _name_words(span.kind, name_bytes)
        out += [0.0] * ((max_events - n_events) * (3 + 2 * w))
    return torch.tensor(out, dtype=torch.float64)


def unpack_records(packed: torch.Tensor) -> list[StepRecord]:
    """Inverse of :func:`pack_records` (self-describing: reads sizes from the header)."""
    values = packed.detach().to(torch.float64).flatten().tolist()
    if len(values) < _HEADER or values[0] != _MAGIC:
        raise ValueError("tensor was not produced by pack_records")
    n_records, max_events, name_bytes = (int(v) for v in values[1:_HEADER])
    if len(values) != packed_size(n_records, max_events, name_bytes):
        raise ValueError("packed records tensor has the wrong size for its header")
    w = _words(name_bytes)
    pos = _HEADER
    records = []
    for _ in range(n_records):
        rank, step, start, end, n_coll, n_comp = values[pos : pos + _RECORD_FIXED]
        device = _decode(values[pos + _RECORD_FIXED : pos + _RECORD_FIXED + w])
        pos += _RECORD_FIXED + w
        spans: list[list[Span]] = [[], []]
        for _e in range(int(n_coll) + int(n_comp)):
            s, e, is_compute = values[pos : pos + 3]
            name = _decode(values[pos + 3 : pos + 3 + w])
            kind = _decode(values[pos + 3 + w : pos + 3 + 2 * w])
            spans[int(is_compute)].append(Span(name, s, e, kind))
            pos += 3 + 2 * w
        pos += (max_events - int(n_coll) - int(n_comp)) * (3 + 2 * w)
        records.append(
            StepRecord(int(rank), device, int(step), start, end, tuple(spans[0]), tuple(spans[1]))
        )
    return records
