"""A worker keeps the memory it frees (:mod:`xronos.comm.heap`): a step's large tensors are
allocated again without faulting their pages in again."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys

import pytest

CHILD = """
import resource, sys, torch
from xronos.comm.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():  # a training step's pattern: large tensors made, used and freed
    xs = [torch.ones(1 << 20) for _ in range(8)]  # 8 x 4 MiB
    del xs
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_kept_memory_is_reused_without_page_faults() -> None:
    # glibc's first threshold (128 KiB), held fixed: its later rise depends on the order of
    # earlier frees, which would make the contrast below a matter of chance.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}

    def faults(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True, env=env
        )
        return int(out.stdout.strip())

    # One step touches 32 MiB: 8,192 pages of 4 KiB. Mapped anew each time, 20 steps fault
    # all of it in again (90 %: the count is exact, the margin only for page size rounding).
    # Kept, the pages are reused: the faults do not grow with the steps, at most two steps'
    # worth in all (measured: 0 to one, depending on where the heap's top lands).
    per_step = 32 * 2**20 // resource.getpagesize()
    assert faults("default") > 0.9 * 20 * per_step
    assert faults("keep") <= 2 * per_step
