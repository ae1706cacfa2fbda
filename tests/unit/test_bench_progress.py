"""The bench's progress lines: from the first rank only, steps at most every so often."""

from __future__ import annotations

import io

from xronos.bench.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_steps_are_shown_at_most_every_interval_and_after_the_last() -> None:
    out, clock = io.StringIO(), Clock()
    progress = Progress(0, out, clock, every_s=15.0)
    clock.t = 160.0
    progress.say("profiled in 60.0 s")
    for done in range(1, 9):  # 8 steps of 4 s, the first 3 warm-up
        clock.t += 4.0
        progress.step(done, 8, 3)
    assert out.getvalue().splitlines() == [
        "bench: profiled in 60.0 s (60 s)",
        "bench: step 4 of 8 (counted) (76 s)",  # 16 s after the last line
        "bench: step 8 of 8 (counted) (92 s)",  # the last, 16 s later
    ]


def test_the_warm_up_is_named_and_a_prefix_kept() -> None:
    out, clock = io.StringIO(), Clock()
    progress = Progress(0, out, clock, every_s=15.0)
    clock.t += 20.0
    progress.step(2, 10, 3, "pp-1f1b: ")
    assert out.getvalue() == "bench: pp-1f1b: step 2 of 10 (warm-up) (20 s)\n"


def test_other_ranks_say_nothing() -> None:
    out, clock = io.StringIO(), Clock()
    progress = Progress(1, out, clock)
    progress.say("profiled in 1.0 s")
    progress.step(5, 5, 1)
    assert out.getvalue() == ""
