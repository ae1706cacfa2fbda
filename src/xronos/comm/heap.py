"""A worker keeps the memory it frees: no page faults on every step's tensors.

glibc's malloc hands a large block (above a threshold that starts at 128 KiB and rises with
what is freed, up to 32 MiB) straight to ``mmap`` and returns it with ``munmap`` on free,
and trims the heap's free top back to the system. A training step allocates and frees the
same activations and gradients every time, so each step then faults every page of them in
again, and the kernel zeroes each page first. Measured on ``ci-2dev`` (the `small` preset,
5 strategies interleaved on a 2-core host): `single` took 0.533 s a step with glibc's
defaults and 0.457 s with the settings below, and the compute of a step no longer differed
from the same compute replayed (the stall column: 7.3 % → 0.0 %).

:func:`keep_freed_memory` sets, through ``mallopt``, the mmap threshold to its maximum
(32 MiB on 64-bit glibc: smaller blocks come from the heap and are reused), a trim
threshold of 2 GiB and a 256 MiB top pad; the process's resident memory stays at its peak
instead of falling between steps. (The environment variables ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_TOP_PAD_`` do the same, but only when set before the
process starts.) Elsewhere than glibc (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 * 2**20
"""The largest threshold glibc accepts on 64-bit (``HEAP_MAX_SIZE / 2``)."""
TOP_PAD = 256 * 2**20
NO_TRIM = 2**31 - 1
"""The heap's free top is returned only past this (the largest value ``mallopt`` takes)."""


def keep_freed_memory() -> bool:
    """Apply the settings above to this process's malloc; False where it is not glibc's
    or it refused one of them."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = [
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        mallopt(M_TRIM_THRESHOLD, NO_TRIM),
        mallopt(M_TOP_PAD, TOP_PAD),
    ]
    return all(r == 1 for r in done)
