"""Ctrl-C during `xronos finetune`, or SIGTERM (``kill``, a service manager's stop): every
worker stops at a step boundary, a final checkpoint is written, and no emulation state
(cgroups) is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xronos.emulation.hierarchies import detect

ROOT = Path("/sys/fs/cgroup")


def _xronos_cgroups() -> set[str]:
    """Every cgroup directory Xronos made, at any depth a launcher's own cgroup may be."""
    found: set[str] = set()
    for depth in range(1, 5):
        found |= {str(p) for p in ROOT.glob("/".join(["*"] * depth) + "/xronos-*")}
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "group"),
    [(signal.SIGINT, False), (signal.SIGTERM, True)],
    ids=["ctrl-c-to-the-launcher", "sigterm-to-every-process"],
)
def test_a_stop_checkpoints_and_cleans_up(tmp_path: Path, sig: signal.Signals, group: bool) -> None:
    if detect() is None:
        pytest.skip("no writable cgroups here: the emulation teardown cannot be observed")
    before = _xronos_cgroups()
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "xronos",
        "finetune",
        "--cluster",
        "ci-2dev",
        # both devices train, so that every worker has to stop at the boundary (the default,
        # auto, ran `single` here: one worker), and no time goes to auto's measuring of
        # candidate plans before the first step
        "--strategy",
        "tp-even",
        "--steps",
        "400",
        "--train-size",
        "96",
        "--batch-size",
        "8",
        "--seq-len",
        "48",
        "--eval-size",
        "0",
        "--out",
        str(run),
    ]
    # Ctrl-C as in a terminal, even when this test runs where SIGINT is ignored (a shell's
    # background job): Python installs its handler only if SIGINT is not ignored at start
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        start_new_session=True,  # a process group of its own, as `timeout` makes
    )
    deadline = time.monotonic() + 120
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().count("\n") >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    if group:  # `timeout`, a service manager's stop: the workers and the fork server too
        os.killpg(proc.pid, sig)
    else:  # the launcher alone (a terminal's Ctrl-C reaches the workers too; they ignore it)
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted at step" in err and "--resume" in err, err
    ckpts = sorted((run / "checkpoints").iterdir())
    assert ckpts and (ckpts[-1] / "COMPLETE").is_file()
    assert (run / "summary.md").is_file()
    assert _xronos_cgroups() <= before, "emulation cgroups left behind"
