"""torchrun's elastic rendezvous (``--nnodes 2:3 --max-restarts 1``): a device that joins a
running job makes torchrun restart the workers with one device more; one that is lost
mid-run, with one device fewer. Each time ``xronos worker`` resumes from the coordinator's
newest checkpoint under a plan for the devices now present."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

from tests.e2e.agents import free_port
from tests.e2e.test_torchrun_coordinator import TOKEN, _data
from tests.hf_models import make_checkpoint, save_word_tokenizer

STEPS = 140
"""Enough steps for a loss and a return: each time the nuc starts, the workers are held
(``_Job.hold``) until its agent is in the rendezvous, so it joins at the step where it was
started, whatever the host's load (a busy 2-core host once let the nuc's first join take
until step 100, and the run ended before its return)."""
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=2,keep_alive_max_attempt=3"
"""A round closes 2 s after its last node. The nuc is killed without a word to the
rendezvous, and the next round can only start once every node of the last one has left it:
the nuc leaves when its heartbeats have stopped for keep_alive_interval x
keep_alive_max_attempt (torch's defaults, 5 s x 3, made the two wait about 13 s). A live
agent still has three heartbeats in a row, 6 s, to miss before it is taken for dead: it is
an idle process that writes one key every 2 s, which a 2-core host busy with three training
workers still schedules within milliseconds."""


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


class _Job:
    """torchrun agents of one elastic job (``--nnodes 2:3 --max-restarts 1``), each host a
    directory of its own under ``root``; the hub holds the model, the data and the run."""

    def __init__(self, root: Path) -> None:
        self.hosts = {h: root / h for h in ("hub", "pi", "nuc")}
        for h in self.hosts.values():
            h.mkdir()
        self.hub = self.hosts["hub"]
        make_checkpoint(self.hub / "model", vocab=96, hidden=64, layers=2, heads=8, kv_heads=4)
        save_word_tokenizer(self.hub / "model", 96)
        _data(self.hub / "home.jsonl")
        self.root, self.port = root, free_port()
        self.procs: list[tuple[subprocess.Popen[bytes], IO[str]]] = []
        self.hub_log = root / "hub.log"

    def start(self, host: str, log_name: str) -> subprocess.Popen[bytes]:
        env = os.environ | {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "OMP_NUM_THREADS": "1"}
        # a late agent is admitted only when the workers do not share the agent's store
        env |= {"XRONOS_TOKEN": TOKEN, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        options = [
            *("--model", "model", "--data", "home.jsonl", "--out", "run"),
            *("--steps", str(STEPS), "--batch-size", "8", "--seq-len", "16"),
            *("--eval-size", "0", "--save-every", "20", "--strategy", "tp-even"),
            *("--join-timeout", "60"),
        ]
        cmd = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3"),
            *("--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d"),
            *("--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "home"),
            *("--rdzv-conf", RDZV_CONF),
            *("-m", "xronos", "worker"),
            *(options if host == "hub" else ["--join-timeout", "60"]),
        ]
        log = open(self.root / log_name, "w")  # noqa: SIM115 -- closed by close()
        p = subprocess.Popen(
            cmd,
            cwd=self.hosts[host],
            env=env | {"XRONOS_DEVICE": host},
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        self.procs.append((p, log))
        return p

    def wait_for(self, done: Callable[[], bool]) -> None:
        t0 = time.monotonic()
        while not done():
            assert time.monotonic() - t0 < 180, self.hub_log.read_text()[-3000:]
            assert self.procs[0][0].poll() is None, self.hub_log.read_text()[-3000:]
            time.sleep(0.2)

    def hold(self, host: str, log_name: str) -> subprocess.Popen[bytes]:
        """Start ``host``'s agent with the running workers held (SIGSTOP), and let them go
        on (SIGCONT) once the hub's agent stops them for a new round (torchrun's line
        "closing signal SIGTERM"): the device joins before the run moves on."""
        stops = self.hub_log.read_text().count("closing signal SIGTERM")
        workers = [w for p, _ in self.procs if p.poll() is None for w in _children(p.pid)]
        for w in workers:
            with contextlib.suppress(ProcessLookupError):  # one that just ended
                os.kill(w, signal.SIGSTOP)
        try:
            p = self.start(host, log_name)
            self.wait_for(lambda: self.hub_log.read_text().count("closing signal SIGTERM") > stops)
        finally:
            for w in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w, signal.SIGCONT)
        return p

    def said(self) -> list[str]:
        """How many devices the coordinator said it coordinates, each time it started."""
        return re.findall(r"coordinating (\d) devices", self.hub_log.read_text())

    def checkpoint(self, step: int) -> None:
        """Wait until the run's checkpoint of ``step`` is complete."""
        self.wait_for(lambda: (self.hub / f"run/checkpoints/step-{step:08d}/COMPLETE").is_file())

    def close(self) -> None:
        for p, log in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            log.close()

    def check_the_run(self, events_seen: list[tuple[str, object]]) -> list[dict]:
        """What every elastic run must show: the hub resumed from a checkpoint at every
        restart (never started over), the events of who left and came, every step up to
        the last trained, and nothing written on the other hosts. The events, returned."""
        text = self.hub_log.read_text()
        restarts = len(re.findall(r"coordinating \d devices", text)) - 1
        assert len(re.findall(r"resuming from run/checkpoints/step-", text)) == restarts, text
        assert (self.hub / "run" / "checkpoints" / f"step-{STEPS:08d}" / "COMPLETE").is_file()
        # the coordinator logs who left and who came back, as `xronos finetune` does (other
        # events, e.g. `io_threads_restored` when a busy host kept a device's CPU, may come
        # between them and are not what this test is about)
        membership = {"device_lost", "device_joined", "resumed"}
        events = [r for r in _rows(self.hub / "run") if r.get("event") in membership]
        got = [(e["event"], e.get("device") or sorted(e["devices"])) for e in events]
        assert got == events_seen, events
        # every step up to the last was trained (some twice, after each restart)
        steps = {r["step"] for r in _rows(self.hub / "run") if "loss" in r}
        assert steps == set(range(1, STEPS + 1))
        for h in ("pi", "nuc"):
            assert [p.name for p in self.hosts[h].iterdir()] == []
        return events


@pytest.mark.slow
def test_a_device_joins_a_running_job_is_lost_and_comes_back(tmp_path: Path) -> None:
    """Two devices train; a third starts and joins; it is killed; it starts again.

    Joining, torchrun stops the workers for a new round without counting a restart (a
    membership change uses up none of --max-restarts), so the workers see a restart count
    of 0, as at the job's start: the coordinator must still continue its run, not start it
    over. Lost, the survivors' collectives fail and torchrun restarts them on the two (a
    counted restart). Back, it restarts them on the three again."""
    job = _Job(tmp_path)
    try:
        job.start("hub", "hub.log")
        time.sleep(3)  # the hub's agent hosts the rendezvous store, as on a real network
        job.start("pi", "pi.log")
        job.checkpoint(20)
        nuc = job.hold("nuc", "nuc.log")  # a device arrives: the job grows to three
        job.wait_for(lambda: job.said() == ["2", "3"])
        # a checkpoint the three wrote: the run goes on from there when the nuc is lost
        resumed = re.findall(r"resuming from \S+ \(step (\d+)\)", job.hub_log.read_text())
        assert resumed, job.hub_log.read_text()[-3000:]
        job.checkpoint((int(resumed[-1]) // 20 + 1) * 20)
        for pid in [*_children(nuc.pid), nuc.pid]:  # the nuc is gone, agent and worker
            os.kill(pid, signal.SIGKILL)
        job.wait_for(lambda: job.said() == ["2", "3", "2"])
        job.hold("nuc", "nuc-again.log")  # and comes back
        for p, _ in [job.procs[0], job.procs[1], job.procs[3]]:
            assert p.wait(timeout=240) == 0, job.hub_log.read_text()[-4000:]
    finally:
        job.close()
    assert job.said() == ["2", "3", "2", "3"]  # the two, all, the two that remained, all
    events = job.check_the_run(
        [
            ("device_joined", "nuc"),
            ("resumed", ["hub", "nuc", "pi"]),
            ("device_lost", "nuc"),
            ("resumed", ["hub", "pi"]),
            ("device_joined", "nuc"),
            ("resumed", ["hub", "nuc", "pi"]),
        ]
    )
    steps = [e["step"] for e in events]
    # joining, from the checkpoint the workers wrote when torchrun stopped them; lost, from
    # a checkpoint of the run (every 20 steps) that the three wrote
    assert steps[0] == steps[1] >= 20 and steps[4] == steps[5]
    assert steps[3] % 20 == 0 and steps[3] > steps[1]
