"""`xronos worker` under torchrun (the multi-machine entry point, here on one host)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from xronos.cli import main

ARGS = [
    "--comm-dtype",
    "fp32",  # exact payloads: the losses are compared with one process's
    "--steps",
    "3",
    "--train-size",
    "64",
    "--batch-size",
    "8",
    "--seq-len",
    "48",
    "--eval-size",
    "0",
    "--strategy",
    "tp-even",
]


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow
def test_torchrun_workers_train_like_one_process(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    res = subprocess.run(
        [*torchrun, "-m", "xronos", "worker", *ARGS, "--out", str(tmp_path / "tr")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # the workers' own errors come before torchrun's summary of which rank failed
    assert res.returncode == 0, res.stderr[:3000] + "\n…\n" + res.stderr[-1500:]
    assert (tmp_path / "tr" / "summary.md").is_file()
    assert (
        main(
            [
                "finetune",
                *ARGS[:-2],
                "--strategy",
                "single",
                "--no-emulate",
                "--out",
                str(tmp_path / "one"),
            ]
        )
        == 0
    )
    # two ranks vs one: only the order of the all-reduce sums differs (fp32; equal here,
    # within 1e-5 by docs/architecture.md, Exactness)
    assert _losses(tmp_path / "tr") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)

    # torchrun starts the workers again when a device arrives as the run ends (restart
    # count 0, the same agent) or after a failure (count > 0; here 1): the run has trained
    # every step, so the workers end with a line and exit 0, and the run is left as it was
    before = {p.name: p.read_bytes() for p in (tmp_path / "tr").iterdir() if p.is_file()}
    env = os.environ | {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}

    def worker(restarts: str, *argv: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "xronos", "worker", *ARGS, *argv]
        env_n = env | {"TORCHELASTIC_RESTART_COUNT": restarts}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env_n)

    again = worker("1", "--out", str(tmp_path / "tr"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "has trained every step" in again.stdout, again.stdout
    # the user asking to continue it is a mistake, said in one line (exit 2)
    asked = worker("0", "--resume", str(tmp_path / "tr"))
    assert asked.returncode == 2, asked.stderr[-3000:]
    assert "pass a larger --steps" in asked.stderr, asked.stderr
    after = {p.name: p.read_bytes() for p in (tmp_path / "tr").iterdir() if p.is_file()}
    assert after == before


def test_worker_outside_torchrun_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--steps", "1"]) == 2
    assert "torchrun" in capsys.readouterr().err
