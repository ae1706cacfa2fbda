"""Two torchrun agents (``--nnodes 2``, static rendezvous on loopback) as two hosts: only
devices that hold the job's token join."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.agents import free_port, static_agent

TOKEN = "kitchen-hub-token-5f1c2a9e7d"
ARGS = [
    "--steps",
    "2",
    "--train-size",
    "32",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--eval-size",
    "0",
    "--strategy",
    "tp-even",
]
JOIN_TIMEOUT = 20
"""Generous where nothing waits it out: the devices that hold the token must all join."""
REFUSED_JOIN_TIMEOUT = 10
"""The hub waits this out after refusing the other device: long enough for two workers
started together on two cores to reach the admission exchange (the hub must see the wrong
token to say so; the hosts tests give three such workers 8 s)."""


def _agents(
    tmp_path: Path,
    tokens: list[dict[str, str]],
    extra: list[list[str]],
    join_timeout: int = JOIN_TIMEOUT,
) -> list[tuple[subprocess.CompletedProcess[str], float]]:
    """Start one agent per node rank at once; each agent's result and seconds until it
    ended."""
    port = free_port()
    procs = []
    t0 = time.monotonic()
    for node, (env_extra, more) in enumerate(zip(tokens, extra, strict=True)):
        env = {k: v for k, v in os.environ.items() if k != "XRONOS_TOKEN"}
        env |= {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "OMP_NUM_THREADS": "1"} | env_extra
        args = [*ARGS, "--join-timeout", str(join_timeout), "--out", str(tmp_path / "run")]
        cmd = static_agent(2, node, port, [*args, *more])
        out, err = tmp_path / f"agent{node}.out", tmp_path / f"agent{node}.err"
        with out.open("w") as o, err.open("w") as e:  # files, not pipes: none fills up
            procs.append(subprocess.Popen(cmd, env=env, stdout=o, stderr=e))
    ended: dict[int, float] = {}
    while len(ended) < len(procs) and time.monotonic() - t0 < 300:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic() - t0
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    outs = [
        ((tmp_path / f"agent{i}.out").read_text(), (tmp_path / f"agent{i}.err").read_text())
        for i in range(len(procs))
    ]
    assert len(ended) == len(procs), "an agent hung: " + outs[0][1][-2000:]
    return [
        (subprocess.CompletedProcess(p.args, p.returncode, out, err), ended[i])
        for i, (p, (out, err)) in enumerate(zip(procs, outs, strict=True))
    ]


def _token_file(tmp_path: Path, text: str) -> str:
    f = tmp_path / "token"
    f.write_text(text + "\n")
    f.chmod(0o600)
    return str(f)


@pytest.mark.slow
def test_agents_holding_the_token_train(tmp_path: Path) -> None:
    ((hub, _), (pi, _)) = _agents(
        tmp_path,
        [{"XRONOS_TOKEN": TOKEN}, {}],
        [[], ["--token-file", _token_file(tmp_path, TOKEN)]],
    )
    assert hub.returncode == 0, hub.stderr[-3000:]
    assert pi.returncode == 0, pi.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert (tmp_path / "run" / "summary.md").is_file()
    assert "warning: no token" not in hub.stderr + pi.stderr


@pytest.mark.slow
def test_an_agent_with_a_wrong_token_is_refused_and_the_hub_stops(tmp_path: Path) -> None:
    ((hub, hub_s), (pi, pi_s)) = _agents(
        tmp_path,
        [{"XRONOS_TOKEN": TOKEN}, {"XRONOS_TOKEN": "not-the-kitchen-token-000000"}],
        [[], []],
        REFUSED_JOIN_TIMEOUT,
    )
    assert pi.returncode != 0
    refused = [x for x in pi.stderr.splitlines() if "refused this device's token" in x]
    assert refused == [
        f"xronos: error: device '{socket.gethostname()}-0': the coordinator refused this "
        "device's token; give the job's token via XRONOS_TOKEN or --token-file"
    ], pi.stderr[-3000:]
    assert hub.returncode != 0
    assert f"not every device joined within {REFUSED_JOIN_TIMEOUT} s: rank 1" in hub.stderr, (
        hub.stderr[-3000:]
    )
    assert "was refused: its token does not match the coordinator's" in hub.stderr
    assert pi_s < hub_s  # the refused device stops first; the hub waits out its timeout
    assert REFUSED_JOIN_TIMEOUT <= hub_s < REFUSED_JOIN_TIMEOUT + 90
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
