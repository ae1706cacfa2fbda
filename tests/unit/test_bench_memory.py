"""The bench's memory measurement: each strategy's own peak resident memory, and the table's
rendering of peaks and of a strategy that could not fit."""

from __future__ import annotations

import mmap

import pytest

from xronos.bench.memory import Verdict, take_turns
from xronos.metrics import format_bench_table
from xronos.metrics.rss import PeakRSS, enforced_cap, release, resident_bytes
from xronos.train.session import Strategy

MIB = 2**20


def _touch(nbytes: int) -> mmap.mmap:
    """``nbytes`` of fresh anonymous memory, every page written (so resident)."""
    buf = mmap.mmap(-1, nbytes)
    for off in range(0, nbytes, mmap.PAGESIZE):
        buf[off] = 1
    return buf


def test_peak_is_each_turns_own() -> None:
    peak = PeakRSS()
    if not peak.resettable:
        pytest.skip(f"peak resident memory cannot be reset here ({peak.note})")
    small, big = 48 * MIB, 96 * MIB
    measured = []
    for size in (small, big, small):  # a big turn between two small ones
        release()
        peak.reset()
        start = resident_bytes()
        buf = _touch(size)
        buf.close()  # gone before the turn's peak is read, as a closed session is
        measured.append((start, peak.peak_bytes()))
    grew = [p - s for s, p in measured]
    # Every written page is resident at once (mmap'd pages are fresh, not reused), so a
    # turn's peak grows by its whole size — less what the kernel has not yet counted: it
    # batches each thread's resident-page count (up to 64 pages at a time, 256 KiB; 1 MiB
    # allowed) — plus whatever the interpreter allocates around it.
    slack = MIB
    assert grew[0] >= small - slack and grew[2] >= small - slack
    assert grew[1] >= big - slack
    assert grew[1] > grew[0] + small // 2 and grew[1] > grew[2] + small // 2
    # the third turn does not inherit the second's peak: that is what the reset is for
    assert measured[2][1] < measured[1][1] - small // 2
    # ... and the process's overall peak still has it
    assert peak.overall_bytes() >= measured[1][1]


def test_lifetime_fallback_never_decreases() -> None:
    before = PeakRSS.lifetime_bytes()
    buf = _touch(16 * MIB)
    buf.close()
    assert PeakRSS.lifetime_bytes() >= before > 0


def test_enforced_cap_is_none_or_a_byte_count() -> None:
    cap = enforced_cap()
    assert cap is None or cap > 0


def test_strategies_take_turns_only_when_a_cap_cannot_hold_them_together() -> None:
    found = {
        Strategy.XRONOS: Verdict((300 * MIB, 200 * MIB)),
        Strategy.PP_1F1B: Verdict((250 * MIB, 250 * MIB)),
        Strategy.SINGLE: Verdict((400 * MIB, 0), "needs too much"),  # never opened
    }
    runtime = [300 * MIB, 300 * MIB]
    # xronos twice (its stall twin), the pipeline once, the runtime: 1150 / 950 MiB
    assert not take_turns(found, [None, None], runtime, [0, 0])
    assert not take_turns(found, [1150 * MIB, 950 * MIB], runtime, [0, 0])
    assert take_turns(found, [1149 * MIB, 2000 * MIB], runtime, [0, 0])
    assert take_turns(found, [1150 * MIB, 950 * MIB], runtime, [1, 0])  # + a solo byte
    unknown = {Strategy.AUTO: Verdict(None)}
    assert take_turns(unknown, [10**12, None], runtime, [0, 0])


def test_table_shows_peaks_and_why_a_strategy_did_not_run() -> None:
    bench = {
        "scenario": "x",
        "strategies": {
            "xronos": {"step_time_s": 0.9, "peak_rss_mb": [712.4, 530.6], "final_loss": 9.0},
            "single": {
                "feasible": False,
                "infeasible": "needs 777 MiB on fast (runtime 329 + model 448), cap 740 MiB",
            },
        },
        "memory": {
            "cap_mb": [740.0, 740.0],
            "enforced_cap_mb": [740.0, 740.0],
            "schedule": "in turn",
        },
    }
    lines = format_bench_table(bench).splitlines()
    assert "peak MiB" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert "712/531" in rows["xronos"]
    assert rows["single"][1] == "infeasible" and set(rows["single"][2:]) == {"-"}
    assert "single: infeasible: needs 777 MiB on fast" in "\n".join(lines)
    assert any(line.startswith("memory caps (MiB): 740/740") for line in lines)
