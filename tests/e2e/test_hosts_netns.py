"""Xronos across hosts: every host is a network namespace with its own host name, its own
/etc/hosts, its own shaped link and its own working directory, and runs one torchrun agent;
the agents meet through c10d rendezvous on the coordinator's address::

    python -m torch.distributed.run --nnodes 3 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HUB_ADDRESS:PORT --rdzv-id JOB -m xronos worker ...

Only the coordinator (the host started with --model and --data) holds the model and the
data, and only it writes the run directory; the other hosts start with nothing but the
job's token. Runs only where network namespaces can be made (root with iproute2)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.hf_models import WORDS, make_checkpoint, save_word_tokenizer
from tests.unit.test_emulation_netns import NO_NETNS

SKIP = (
    "needs root (network namespaces)"
    if os.geteuid() != 0
    else NO_NETNS or (None if shutil.which("unshare") else "util-linux `unshare` is not installed")
)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(SKIP is not None, reason=str(SKIP))]

TOKEN = "kitchen-hub-token-5f1c2a9e7d"
WRONG = "not-the-kitchen-token-000000"
HUB = "hub"
"""The coordinator's host. torchrun numbers the nodes by host name, so the hub comes after
"attic" and "den": torchrun gives it the last node rank, and Xronos must make it rank 0."""
LINKS = {HUB: 200e6, "attic": 50e6, "den": 100e6, "pi": 20e6, "yard": 50e6}
"""Each host's link (bit/s, both directions; tbf on its veth pair)."""
RUN = [
    "--steps",
    "2",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--eval-size",
    "0",
    "--comm-dtype",
    "fp32",  # exact payloads: the losses are compared with one process's
]
COORDINATOR = [
    "--model",
    "model",
    "--data",
    "data.jsonl",
    *RUN,
    "--strategy",
    "tp-even",
    "--out",
    "run",
]
JOIN_TIMEOUT = 8
"""Short, as the refusal tests wait it out; long enough for three workers started together
on two cores to reach the admission exchange."""
WAIT_S = 150
"""Bound on any one wait for agents; a run that takes longer has hung."""


@dataclass(frozen=True)
class Lan:
    """The hosts' namespaces and addresses: one /24 behind a bridge in the root namespace."""

    namespaces: dict[str, str]
    ips: dict[str, str]


def _sh(*args: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def lan() -> Iterator[Lan]:
    from xronos.emulation import netns
    from xronos.emulation.cluster import DeviceSpec

    names = list(LINKS)
    plan = netns.plan_network(f"hosts-{uuid.uuid4().hex}", len(names))
    etc = [Path("/etc/netns") / plan.namespace(i) for i in range(len(names))]
    made_etc = not Path("/etc/netns").exists()
    try:
        netns.setup_network(plan, tuple(DeviceSpec(n, bandwidth_bps=LINKS[n]) for n in names))
        # Every host resolves every host's name to its address, as a LAN's DNS would:
        # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts.
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{plan.ip(i)} {n}\n" for i, n in enumerate(names)
        )
        try:
            for d in etc:
                d.mkdir(parents=True, exist_ok=True)
                (d / "hosts").write_text(hosts)
        except OSError as e:
            pytest.skip(f"cannot give the namespaces their own /etc/hosts: {e}")
        for i in range(len(names)):  # the links are shaped
            assert "tbf" in _sh("tc", "-n", plan.namespace(i), "qdisc", "show", "dev", "eth0")
        yield Lan(
            {n: plan.namespace(i) for i, n in enumerate(names)},
            {n: plan.ip(i) for i, n in enumerate(names)},
        )
    finally:
        problems = netns.teardown_network(plan.namespaces, plan.links)
        for d in etc:
            shutil.rmtree(d, ignore_errors=True)
        if made_etc:
            with contextlib.suppress(OSError):
                Path("/etc/netns").rmdir()
        assert not problems, problems


@dataclass
class Agent:
    """One host's torchrun agent; its output goes to files (no pipe fills up)."""

    host: str
    proc: subprocess.Popen[bytes]
    log: Path
    started: float
    ended: float | None = None

    @property
    def code(self) -> int | None:
        return self.proc.poll()

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")

    @property
    def seconds(self) -> float:
        assert self.ended is not None
        return self.ended - self.started


@dataclass
class Hosts:
    """Each host's own directory (``work``: the agent's working directory; ``home``: its
    HOME) and the agents started on them."""

    lan: Lan
    root: Path
    port: int = 29400
    job: str = field(default_factory=lambda: f"job-{uuid.uuid4().hex[:8]}")
    agents: list[Agent] = field(default_factory=list)

    def work(self, host: str) -> Path:
        return self.root / host / "work"

    def token_file(self, host: str, token: str) -> str:
        self.work(host).mkdir(parents=True, exist_ok=True)
        f = self.work(host) / "token"
        f.write_text(token + "\n")
        f.chmod(0o600)
        return "token"

    def start(
        self,
        host: str,
        argv: list[str],
        *,
        nnodes: str = "3",
        rdzv_conf: str | None = None,
        env: dict[str, str] | None = None,
        entry: list[str] | None = None,
    ) -> Agent:
        """Start ``host``'s agent in its namespace and its own UTS namespace (its own host
        name), in its own directory, with ``xronos worker ARGV``."""
        home = self.root / host / "home"
        home.mkdir(parents=True, exist_ok=True)
        self.work(host).mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("XRONOS_", "PYTEST"))}
        base |= {
            "HOME": str(home),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
            "OMP_NUM_THREADS": "1",
            "LOGLEVEL": "INFO",  # torchrun's rendezvous rounds in the log
            "PYTHONUNBUFFERED": "1",  # lines reach the log as they are printed
            "HF_HUB_OFFLINE": "1",
        }
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes]
        torchrun += ["--nproc-per-node", "1", "--rdzv-backend", "c10d"]
        torchrun += ["--rdzv-endpoint", f"{self.lan.ips[HUB]}:{self.port}", "--rdzv-id", self.job]
        if rdzv_conf:
            torchrun += ["--rdzv-conf", rdzv_conf]
        cmd = ["ip", "netns", "exec", self.lan.namespaces[host], "unshare", "--uts", "--"]
        cmd += ["sh", "-c", 'hostname "$0" && exec "$@"', host]
        cmd += [*torchrun, *(entry or ["-m", "xronos"]), "worker", *argv]
        log = self.root / f"{host}-{len(self.agents)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=self.work(host),
                env=base | (env or {}),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        agent = Agent(host, proc, log, time.monotonic())
        self.agents.append(agent)
        return agent

    def wait(self, agents: list[Agent] | None = None, limit: float = WAIT_S) -> None:
        """Until ``agents`` (default: all) have ended; fails naming the ones that hang."""
        agents = self.agents if agents is None else agents
        until = time.monotonic() + limit
        while time.monotonic() < until:
            for a in agents:
                if a.ended is None and a.code is not None:
                    a.ended = time.monotonic()
            if all(a.ended is not None for a in agents):
                return
            time.sleep(0.1)
        hung = [a for a in agents if a.ended is None]
        pytest.fail(
            f"agent(s) on {[a.host for a in hung]} still running after {limit:.0f} s:\n"
            + "\n".join(f"--- {a.host}\n{a.text[-3000:]}" for a in hung)
        )

    def wait_for(self, agent: Agent, pattern: str, limit: float = WAIT_S) -> re.Match[str]:
        """Until ``agent``'s log matches ``pattern``."""
        until = time.monotonic() + limit
        while time.monotonic() < until:
            if m := re.search(pattern, agent.text):
                return m
            if agent.code is not None:
                break
            time.sleep(0.1)
        pytest.fail(f"{agent.host}: no {pattern!r} in its log:\n{agent.text[-3000:]}")

    def stop(self) -> None:
        """Kill every agent's process group and whatever else runs in the namespaces (the
        agents start their workers in sessions of their own)."""
        for a in self.agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.proc.pid, signal.SIGKILL)
        for ns in self.lan.namespaces.values():
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in pids.stdout.split():
                if int(pid) != os.getpid():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
        for a in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                a.proc.wait(10)


@pytest.fixture
def hosts(lan: Lan, tmp_path: Path) -> Iterator[Hosts]:
    h = Hosts(lan, tmp_path / "hosts")
    # the coordinator's model (random weights, word-level tokenizer) and data, only on it
    model = h.work(HUB) / "model"
    make_checkpoint(model, vocab=96)
    save_word_tokenizer(model, 96)
    rows = [
        {"prompt": f"please turn {w} the light in the kitchen", "completion": f" {w} lamp"}
        for w in WORDS
    ]
    (h.work(HUB) / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    try:
        yield h
    finally:
        h.stop()


def _losses(run: Path) -> list[float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _lines(agent: Agent, needle: str) -> list[str]:
    return [x for x in agent.text.splitlines() if needle in x]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def _start_three(
    hosts: Hosts,
    tokens: dict[str, str],
    join_timeout: int,
    *,
    run: list[str] | None = None,
    env: dict[str, str] | None = None,
    nnodes: str = "3",
    rdzv_conf: str | None = None,
) -> dict[str, Agent]:
    """The hub (with the job; its token in XRONOS_TOKEN), attic and den (no options but a
    token file); each holds the token given in ``tokens`` (default: the job's)."""
    agents = {}
    wait = ["--join-timeout", str(join_timeout)]
    for host in (HUB, "attic", "den"):
        token = tokens.get(host, TOKEN)
        if host == HUB:
            argv, own = [*COORDINATOR, *(run or []), *wait], {"XRONOS_TOKEN": token}
        else:
            argv, own = ["--token-file", hosts.token_file(host, token), *wait], {}
        agents[host] = hosts.start(
            host, argv, env=(env or {}) | own, nnodes=nnodes, rdzv_conf=rdzv_conf
        )
    return agents


def test_three_hosts_train_like_one_process_and_only_the_hub_keeps_the_run(
    hosts: Hosts, tmp_path: Path
) -> None:
    from xronos.cli import main

    agents = _start_three(hosts, {}, join_timeout=60)  # generous: nothing waits it out
    hosts.wait()
    for a in agents.values():
        assert a.code == 0, f"{a.host}:\n{a.text[-4000:]}"
    # torchrun numbers the nodes by host name: the hub is its last node, and Xronos put it
    # first (the device order of the plan is the process group's)
    assert "group_rank=2" in agents[HUB].text, "torchrun no longer puts the hub last"
    run = hosts.work(HUB) / "run"
    plan = json.loads((run / "plan.json").read_text())
    assert plan["devices"][0] == "hub-0" and sorted(plan["devices"]) == [
        "attic-0",
        "den-0",
        "hub-0",
    ]
    assert (run / "checkpoints" / "step-00000002" / "COMPLETE").is_file()
    assert (run / "summary.md").is_file()

    one = tmp_path / "one"
    hub = hosts.work(HUB)
    argv = ["finetune", "--model", str(hub / "model"), "--data", str(hub / "data.jsonl"), *RUN]
    assert main([*argv, "--strategy", "single", "--no-emulate", "--out", str(one)]) == 0
    # three devices vs one, fp32 payloads: only the order of the all-reduce sums differs
    # (the tolerance of test_torchrun; docs/architecture.md, Exactness)
    want = _losses(one)
    assert len(want) == 2
    assert _losses(run) == pytest.approx(want, rel=1e-5)

    # nothing of the job on the other hosts: no model, no data, no run, in their working
    # directories or their homes; only the token file the test gave them
    for host in ("attic", "den"):
        assert _files(hosts.root / host) == ["work/token"], host


def test_a_host_with_a_wrong_token_is_refused_and_the_others_stop(hosts: Hosts) -> None:
    # attic comes first in torchrun's order (rank 0 of the rendezvous, its agent serves the
    # workers' store): a wrong token must be refused whatever rank torchrun gives its host
    agents = _start_three(hosts, {"attic": WRONG}, join_timeout=JOIN_TIMEOUT)
    hosts.wait()
    attic, hub, den = agents["attic"], agents[HUB], agents["den"]
    assert attic.code != 0
    assert _lines(attic, "refused") == [
        "xronos: error: device 'attic-0': the coordinator refused this device's token; "
        "give the job's token via XRONOS_TOKEN or --token-file"
    ], attic.text[-4000:]
    assert _lines(hub, "('attic-0') was refused: its token does not match the coordinator's"), (
        hub.text[-4000:]
    )
    for a in (hub, den):  # the devices with the token stop, each with its line
        assert a.code != 0
        assert not _lines(a, "refused this device's token"), a.text[-4000:]
        assert _lines(a, f"xronos: error: device '{a.host}-0': "), a.text[-4000:]
    # the refused host stops first, the others by the join timeout (sooner where the store
    # they met through was served by the refused host's agent, which has gone)
    assert attic.ended is not None
    for a in (hub, den):
        assert a.ended is not None and attic.ended < a.ended
        assert a.seconds < JOIN_TIMEOUT + 60, (a.host, a.seconds)
    assert not list(hosts.root.rglob("metrics.jsonl"))


def test_a_host_of_another_version_is_refused(hosts: Hosts) -> None:
    import xronos

    other = "0.0.1"
    assert other != xronos.__version__
    # Another Xronos on pi: the same package, announcing another version.
    shim = hosts.root / "pi" / "home" / "other_xronos.py"
    shim.parent.mkdir(parents=True, exist_ok=True)
    shim.write_text(
        "import sys\nimport xronos\n\n"
        f"xronos.__version__ = {other!r}\n"
        "from xronos.cli import main\n\nsys.exit(main())\n"
    )
    wait = ["--join-timeout", str(JOIN_TIMEOUT)]
    # two hosts are enough to be refused (and start faster than three)
    hub = hosts.start(HUB, [*COORDINATOR, *wait], nnodes="2", env={"XRONOS_TOKEN": TOKEN})
    pi = hosts.start(
        "pi", ["--token-file", hosts.token_file("pi", TOKEN), *wait], nnodes="2", entry=[str(shim)]
    )
    hosts.wait()
    v = xronos.__version__
    assert pi.code != 0
    assert _lines(pi, "refused") == [
        f"xronos: error: device 'pi-0': refused to join: Xronos {other} (this device) vs {v} "
        "(the coordinator); install the same versions on every device"
    ], pi.text[-4000:]
    # the coordinator names the device it waited for, and why, and stops after the timeout
    assert hub.code != 0
    why = f"('pi-0') was refused: it runs Xronos {other} (that device) vs {v} (this coordinator)"
    assert _lines(hub, f"device 'hub-0': not every device joined within {JOIN_TIMEOUT} s"), (
        hub.text[-4000:]
    )
    assert _lines(hub, why)
    assert pi.ended is not None and hub.ended is not None and pi.ended < hub.ended
    assert JOIN_TIMEOUT <= hub.seconds < JOIN_TIMEOUT + 60, hub.seconds
    assert not list(hosts.root.rglob("metrics.jsonl"))


def test_an_intruder_cannot_join_a_running_elastic_job(hosts: Hosts) -> None:
    """``--nnodes 3:4``: a fourth agent, without the token, arrives once the three have
    formed the job and it runs.

    torchrun counts a node that waits to join as a membership change: every agent stops
    its worker and a new rendezvous round starts, now with four nodes (documented elastic
    behaviour; it does not use up --max-restarts). Xronos cannot keep the running job out
    of that restart; what it must guarantee is that the intruder never becomes a member:
    it is refused, nothing of the run names it, and the devices with the token stop with
    a clear line instead of waiting for it."""
    # torchrun shares its agent's store with the workers (MASTER_ADDR/PORT) unless told
    # not to; with sharing, a round that adds a node breaks in torch itself (the newcomer
    # waits for an address that the unchanged rank 0 never republishes, or, where the
    # newcomer becomes rank 0, the old nodes keep the old store). Without sharing every
    # round publishes its own store, and the workers meet as torchrun documents.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    steps = 30  # outlasts the intruder's start
    agents = _start_three(
        hosts,
        {},
        JOIN_TIMEOUT,
        run=["--steps", str(steps)],
        env=env,
        nnodes="3:4",  # elastic: a fourth node may join
        rdzv_conf="last_call_timeout=1",  # the round closes 1 s after the third node
    )
    hosts.wait_for(agents[HUB], "coordinating 3 devices")  # the job has formed
    yard = hosts.start(
        "yard",
        ["--token-file", hosts.token_file("yard", WRONG), "--join-timeout", str(JOIN_TIMEOUT)],
        env=env,
        nnodes="3:4",
        rdzv_conf="last_call_timeout=1,join_timeout=60",  # bounded, should the job end first
    )
    hosts.wait()
    legit = list(agents.values())
    restarted = [a.host for a in legit if "will restart worker group" in a.text]
    assert restarted == [HUB, "attic", "den"], "torchrun did not restart the job's workers"

    assert yard.code != 0
    assert _lines(yard, "refused") == [
        "xronos: error: device 'yard-0': the coordinator refused this device's token; "
        "give the job's token via XRONOS_TOKEN or --token-file"
    ], yard.text[-4000:]
    assert any(_lines(a, "('yard-0') was refused: its token does not match") for a in legit)
    for a in legit:  # stopped by Xronos with a line of their own, not left waiting
        assert a.code != 0
        assert _lines(a, f"xronos: error: device '{a.host}-0': "), a.text[-4000:]
    assert yard.ended is not None and all(a.ended and a.ended > yard.ended for a in legit)

    # never a member: the coordinator never counted four devices, and nothing it wrote
    # names the intruder; the intruder's host holds nothing but its token
    assert not _lines(agents[HUB], "coordinating 4 devices")
    run = hosts.work(HUB) / "run"
    assert not [p for p in run.rglob("*") if p.is_file() and b"yard" in p.read_bytes()]
    assert _files(hosts.root / "yard") == ["work/token"]
