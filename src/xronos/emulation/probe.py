"""The speed probe: a child process that times a fixed CPU kernel on request.

The launcher starts it once (:class:`xronos.emulation.speed.Probe`), moves it into each
device's cgroup in turn and asks it to run the kernel with and without the device's limit,
so that what the device really gets can be compared with what its spec asks for.

Protocol, one line each way: after start-up the probe writes ``ready``; then for every
``run THREADS REPS CPUS`` line it reads (``CPUS`` comma-separated) it pins all its threads
to those CPUs, runs ``REPS`` float32 matrix products on ``THREADS`` torch threads and writes
``ok SECONDS`` (or ``err MESSAGE``). It exits on ``quit`` or when its input closes, i.e.
when the launcher is gone. This file runs as a script; it imports torch and the standard
library only (the parent-side :class:`Probe` uses the standard library only).
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

SIZE = 256
"""Matrix side: a 256×256 float32 product, the order of a small model's layer matmul."""
REPS = 400
"""Matrix products per timed run: about 130 ms on one core of a current x86 CPU."""
START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 60.0


def _pin(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


class ProbeError(RuntimeError):
    """The probe could not start or did not answer."""


class Probe:
    """Parent-side handle of the :mod:`probe` child process."""

    def __init__(self, timeout_s: float = START_TIMEOUT_S) -> None:
        try:
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                close_fds=True,
            )
        except OSError as e:
            raise ProbeError(f"cannot start the speed probe: {e}") from e
        try:
            if self._answer(timeout_s) != "ready":
                raise ProbeError("the speed probe did not start (is torch installed?)")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _answer(self, timeout_s: float) -> str:
        out = self.process.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout_s)
        line = out.readline() if ready else ""
        if not line:
            raise ProbeError("the speed probe did not answer" if not ready else "probe exited")
        return line.strip()

    def run(self, threads: int, cpus: Sequence[int], reps: int = REPS) -> float:
        """Seconds for ``reps`` matrix products on ``threads`` threads pinned to ``cpus``."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(f"run {threads} {reps} {','.join(map(str, cpus))}\n")
            self.process.stdin.flush()
        except OSError as e:
            raise ProbeError(f"the speed probe is gone ({e})") from e
        answer = self._answer(RUN_TIMEOUT_S)
        if not answer.startswith("ok "):
            raise ProbeError(f"the speed probe failed: {answer}")
        return float(answer[3:])

    def join(self, procs_files: Sequence[str]) -> None:
        """Move the probe into a device's cgroup(s)."""
        for procs in procs_files:
            Path(procs).write_text(str(self.pid))

    def close(self) -> None:
        """Stop the probe (idempotent)."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                assert self.process.stdin is not None
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
            try:
                self.process.wait(2.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()


# ----------------------------------------------------------------------------- child


def main() -> int:
    import torch

    torch.set_num_interop_threads(1)
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(SIZE, SIZE, generator=gen)
    b = torch.rand(SIZE, SIZE, generator=gen)
    out = torch.empty(SIZE, SIZE)
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        try:
            threads, reps = int(words[1]), int(words[2])
            _pin({int(c) for c in words[3].split(",")})
            torch.set_num_threads(threads)
            torch.mm(a, b, out=out)  # warm the caches and the thread pool
            start = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b, out=out)
            elapsed = time.perf_counter() - start
        except (IndexError, ValueError, OSError) as e:
            print(f"err {e}", flush=True)
            continue
        print(f"ok {elapsed!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
