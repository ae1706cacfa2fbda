"""torchrun's elastic rendezvous (``--nnodes 2:3 --max-restarts 1``): a device that is lost
mid-run makes torchrun restart the workers with one device fewer, and ``xronos worker``
resumes from the coordinator's newest checkpoint under a plan for the two that remain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.agents import free_port
from tests.e2e.test_torchrun_coordinator import TOKEN, _data
from tests.hf_models import make_checkpoint, save_word_tokenizer

STEPS = 300


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun starts its workers in sessions of
    their own, so killing the agent's process group would leave them running)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
def test_a_lost_device_restarts_the_job_on_the_others(tmp_path: Path) -> None:
    hosts = [tmp_path / h for h in ("hub", "pi", "nuc")]
    for h in hosts:
        h.mkdir()
    hub = hosts[0]
    make_checkpoint(hub / "model", vocab=96, hidden=64, layers=2, heads=8, kv_heads=4)
    save_word_tokenizer(hub / "model", 96)
    _data(hub / "home.jsonl")
    port = free_port()
    env = os.environ | {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "OMP_NUM_THREADS": "1"}
    env |= {"XRONOS_TOKEN": TOKEN}
    options = [
        *("--model", "model", "--data", "home.jsonl", "--out", "run", "--steps", str(STEPS)),
        *("--batch-size", "8", "--seq-len", "16", "--eval-size", "0", "--save-every", "20"),
        *("--strategy", "tp-even", "--join-timeout", "60"),
    ]
    procs = []
    for h in hosts:
        cmd = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3"),
            *("--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d"),
            *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "home"),
            *("--rdzv-conf", "last_call_timeout=2"),
            *("-m", "xronos", "worker", *(options if h == hub else ["--join-timeout", "60"])),
        ]
        log = open(tmp_path / f"{h.name}.log", "w")  # noqa: SIM115 -- closed below
        p = subprocess.Popen(cmd, cwd=h, env=env, stdout=log, stderr=log, start_new_session=True)
        procs.append((p, log))
        if h == hub:  # the hub's agent hosts the rendezvous store, as on a real network
            time.sleep(3)
    try:
        t0 = time.monotonic()
        while not (hub / "run/checkpoints/step-00000040/COMPLETE").is_file():
            assert time.monotonic() - t0 < 180, (tmp_path / "hub.log").read_text()[-3000:]
            assert procs[0][0].poll() is None, (tmp_path / "hub.log").read_text()[-3000:]
            time.sleep(0.2)
        for pid in [*_children(procs[2][0].pid), procs[2][0].pid]:  # the nuc is gone
            os.kill(pid, signal.SIGKILL)
        for p, _ in procs[:2]:
            assert p.wait(timeout=240) == 0, (tmp_path / "hub.log").read_text()[-4000:]
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            log.close()
    hub_log = (tmp_path / "hub.log").read_text()
    assert "coordinating 3 devices" in hub_log and "coordinating 2 devices" in hub_log
    assert "resuming from run/checkpoints/step-" in hub_log
    assert (hub / "run" / "checkpoints" / f"step-{STEPS:08d}" / "COMPLETE").is_file()
    # every step up to the last was trained, the later ones on two devices
    steps = {r["step"] for r in _rows(hub / "run") if "loss" in r}
    assert steps == set(range(1, STEPS + 1))
    assert [p.name for p in hosts[1].iterdir()] == [] and [p.name for p in hosts[2].iterdir()] == []
