"""Two torchrun agents as two hosts, each in a directory of its own: only the coordinator
holds the model, the data and the run directory; the other device is started with no
options, receives its slices over the process group and writes nothing.

The coordinator is the agent with node rank 1, so Xronos (not torchrun) must make it
rank 0.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.agents import free_port, static_agent
from tests.hf_models import WORDS, make_checkpoint, save_word_tokenizer
from xronos.cli import main

TOKEN = "hub-token-3b9e51c07a4d"
TRAIN = [
    "--comm-dtype",
    "fp32",  # exact payloads: the losses are compared with one process's
    "--batch-size",
    "8",
    "--seq-len",
    "16",
    "--eval-size",
    "0",
    "--strategy",
    "tp-even",
    "--save-every",
    "2",
]


def _data(path: Path) -> None:
    rng = random.Random(0)
    rows = [
        {
            "prompt": " ".join(rng.choice(WORDS) for _ in range(4)),
            "completion": " " + " ".join(rng.choice(WORDS) for _ in range(3)),
        }
        for _ in range(48)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _agents(hub: Path, pi: Path, coordinator_args: list[str]) -> list[str]:
    """Run the two agents (the coordinator at node rank 1); each one's stdout + stderr."""
    port = free_port()
    env = os.environ | {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "OMP_NUM_THREADS": "1"}
    env |= {"XRONOS_TOKEN": TOKEN}
    procs = []
    for node, (cwd, args) in enumerate([(pi, []), (hub, coordinator_args)]):
        cmd = static_agent(2, node, port, ["--join-timeout", "60", *args])
        log = open(cwd.parent / f"{cwd.name}.log", "w")  # noqa: SIM115 -- closed below
        procs.append((subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=log), log))
    outputs = []
    for p, log in procs:
        try:
            code = p.wait(timeout=300)
        finally:
            p.kill()
            log.close()
        text = Path(log.name).read_text()
        assert code == 0, text[-3000:]
        outputs.append(text)
    return outputs


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.slow
def test_only_the_coordinator_holds_files(tmp_path: Path) -> None:
    hub, pi = tmp_path / "hub", tmp_path / "pi"
    hub.mkdir()
    pi.mkdir()
    make_checkpoint(hub / "model", vocab=96, hidden=64, layers=2, heads=8, kv_heads=4)
    save_word_tokenizer(hub / "model", 96)
    _data(hub / "home.jsonl")
    model_bytes = sum(f.stat().st_size for f in (hub / "model").glob("*.safetensors"))
    first = ["--model", "model", "--data", "home.jsonl", "--out", "run", "--steps", "4", *TRAIN]

    pi_out, hub_out = _agents(hub, pi, first)

    assert _files(pi) == [], "the device without options wrote files"
    assert (hub / "run" / "checkpoints" / "step-00000004" / "COMPLETE").is_file()
    # both ranks' shards, written by the coordinator alone
    shards = sorted(p.name for p in (hub / "run/checkpoints/step-00000004").glob("rank*"))
    assert len(shards) == 2, shards
    # the device received its own slices of the weights, not the whole model: under an
    # even split of 2 it holds half of every split matrix plus the replicated norms
    got = re.search(r"received ([\d.]+) MB of model and checkpoint slices", pi_out)
    assert got is not None, pi_out[-2000:]
    assert 0.3 * model_bytes < float(got[1]) * 1e6 < 0.75 * model_bytes
    assert "coordinating 2 devices" in hub_out

    # the same job in one process
    args = [
        *TRAIN[:-4],
        "--strategy",
        "single",
        "--no-emulate",
        "--steps",
        "4",
        "--save-every",
        "2",
    ]
    data = ["--model", str(hub / "model"), "--data", str(hub / "home.jsonl")]
    assert main(["finetune", *args, *data, "--out", str(tmp_path / "one4")]) == 0
    # two ranks vs one: only the order of the all-reduce sums differs (fp32; 2.1e-7 relative
    # measured, docs/architecture.md, Exactness)
    ran, one = _losses(hub / "run"), _losses(tmp_path / "one4")
    assert sorted(ran) == [1, 2, 3, 4]
    assert [ran[s] for s in ran] == pytest.approx([one[s] for s in ran], rel=1e-5)

    # resume from the coordinator's run directory alone; the device again needs nothing
    _agents(hub, pi, ["--resume", "run", "--steps", "6"])
    assert _files(pi) == []
    assert (hub / "run" / "checkpoints" / "step-00000006" / "COMPLETE").is_file()
    resumed = _losses(hub / "run")
    assert max(resumed) == 6
    # steps 5 and 6 continue from step 4's weights, AdamW moments and data position:
    # the single-process run resumed the same way is the reference
    args = ["--resume", str(tmp_path / "one4"), "--steps", "6"]
    assert main(["finetune", *args]) == 0
    single = _losses(tmp_path / "one4")
    assert [resumed[5], resumed[6]] == pytest.approx([single[5], single[6]], rel=1e-5)

    # a pipeline continues the run (the device reads its stage's part of the checkpoint
    # through the coordinator, which writes both stages' files), then tp-even continues
    # the pipeline's: the same training as the single process's
    _agents(hub, pi, ["--resume", "run", "--steps", "8", "--strategy", "pp-1f1b"])
    meta = json.loads((hub / "run/checkpoints/step-00000008/meta.json").read_text())
    assert meta["extra"]["strategy"] == "pp-1f1b" and meta["optimizer"] is True
    _agents(hub, pi, ["--resume", "run", "--steps", "10", "--strategy", "tp-even"])
    assert _files(pi) == []
    assert main(["finetune", "--resume", str(tmp_path / "one4"), "--steps", "10"]) == 0
    got, single = _losses(hub / "run"), _losses(tmp_path / "one4")
    assert [got[s] for s in range(7, 11)] == pytest.approx(
        [single[s] for s in range(7, 11)], rel=1e-5
    )
