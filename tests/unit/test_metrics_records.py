"""Span recording in a worker and the two wire forms of a step record."""

from __future__ import annotations

import json

import pytest
import torch

from xronos.metrics import (
    Span,
    SpanRecorder,
    StepRecord,
    current_recorder,
    pack_records,
    packed_size,
    unpack_records,
    use_recorder,
)


def _record(rank: int, n_coll: int, n_comp: int, step: int = 3) -> StepRecord:
    base = 81234.56789 + rank  # perf_counter-sized times: float64 must carry them exactly
    colls = tuple(Span(f"layer{k}.mlp.allreduce", base + k, base + k + 0.25) for k in range(n_coll))
    comps = tuple(
        Span(f"fwd:mb{k} ✓", base + 0.1 * k, base + 0.1 * k + 0.05, "forward")
        for k in range(n_comp)
    )
    return StepRecord(rank, f"device-{rank}", step, base - 1.0, base + 50.0, colls, comps)


def test_recorder_records_spans_in_order_inside_step_bounds() -> None:
    rec = SpanRecorder(rank=2, device="nuc")
    with rec.collective("dropped-before-step"):
        pass
    rec.start_step(5)
    with rec.collective("attn.allreduce"):
        sum(range(1000))
    with rec.compute("fwd:mb0", kind="forward"):
        sum(range(1000))
    rec.arrive("recv:act/mb0/0->1")
    rec.leave()
    record = rec.end_step()
    with rec.collective("dropped-after-step"):
        pass

    assert record is not None
    assert (record.rank, record.device, record.step) == (2, "nuc", 5)
    assert [s.name for s in record.collectives] == ["attn.allreduce", "recv:act/mb0/0->1"]
    assert [(s.name, s.kind) for s in record.computes] == [("fwd:mb0", "forward")]
    times = [record.start]
    for span in (record.collectives[0], record.computes[0], record.collectives[1]):
        times += [span.start, span.end]
    times.append(record.end)
    assert times == sorted(times)


def test_disabled_recorder_records_nothing() -> None:
    rec = SpanRecorder(enabled=False)
    rec.start_step(0)
    with rec.collective("x"):
        pass
    rec.arrive("y")
    rec.leave()
    assert rec.end_step() is None
    assert not rec.in_step


def test_unbalanced_arrive_leave_is_an_error() -> None:
    rec = SpanRecorder()
    rec.start_step(0)
    with pytest.raises(RuntimeError, match="without a matching arrive"):
        rec.leave()
    rec.arrive("pending")
    with pytest.raises(RuntimeError, match="pending"):
        rec.end_step()


def test_use_recorder_scopes_the_current_recorder() -> None:
    outer = current_recorder()
    assert not outer.enabled
    rec = SpanRecorder(rank=1)
    with pytest.raises(KeyError), use_recorder(rec):
        assert current_recorder() is rec
        raise KeyError("boom")
    assert current_recorder() is outer


def test_dict_form_survives_json() -> None:
    record = _record(1, 3, 2)
    again = StepRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert again == record


def test_shifted_moves_every_time() -> None:
    record = _record(0, 2, 1)
    moved = record.shifted(0.5)
    assert moved.start == record.start + 0.5 and moved.end == record.end + 0.5
    assert [s.start - 0.5 for s in moved.collectives] == [s.start for s in record.collectives]
    assert [s.end - 0.5 for s in moved.computes] == [s.end for s in record.computes]


def test_pack_unpack_round_trip_with_uneven_ranks() -> None:
    # Different ranks (pipeline stages) record different events; the tensors must still
    # have one size so gloo can gather them.
    per_rank = [
        [_record(0, 4, 0, step=s) for s in (1, 2)],
        [_record(1, 0, 3, step=s) for s in (1, 2)],
    ]
    packed = [pack_records(recs, max_events=6) for recs in per_rank]
    assert packed[0].dtype == torch.float64
    assert packed[0].shape == packed[1].shape == (packed_size(2, 6),)
    for recs, tensor in zip(per_rank, packed, strict=True):
        assert unpack_records(tensor) == recs


def test_pack_rejects_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match="max_events"):
        pack_records([_record(0, 3, 2)], max_events=4)
    long = StepRecord(0, "d", 0, 0.0, 1.0, (Span("x" * 49, 0.1, 0.2),))
    with pytest.raises(ValueError, match="name_bytes"):
        pack_records([long], max_events=1)
    assert unpack_records(pack_records([long], max_events=1, name_bytes=60)) == [long]
    with pytest.raises(ValueError, match="pack_records"):
        unpack_records(torch.zeros(10, dtype=torch.float64))
