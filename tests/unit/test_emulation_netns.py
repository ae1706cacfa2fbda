"""Network emulation: one namespace per device behind a bridge, shaped with tc. Runs only
where ``ip netns`` works (root with iproute2)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from xronos.emulation import ClusterSpec, DeviceSlot, DeviceSpec, Emulator
from xronos.emulation.netns import list_namespaces

SPAWN = mp.get_context("spawn")


def _probe() -> str | None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    name = f"xr-probe-{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if done.returncode != 0:
        return f"ip netns does not work here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


NO_NETNS = _probe()
pytestmark = pytest.mark.skipif(NO_NETNS is not None, reason=str(NO_NETNS))


def server_child(slot: DeviceSlot, out: Any) -> None:
    slot.enter(configure_torch=False)
    with socket.socket() as s:
        s.bind((slot.ip, 0))
        s.listen(1)
        out.put(("port", s.getsockname()[1]))
        conn, (peer, _) = s.accept()
        with conn:
            conn.sendall(b"hello")
        out.put(("peer", peer))


def client_child(slot: DeviceSlot, host: str, port: int, out: Any) -> None:
    slot.enter(configure_torch=False)
    with socket.create_connection((host, port), timeout=10) as s:
        out.put(("got", s.recv(5), os.environ.get("GLOO_SOCKET_IFNAME")))


def links() -> set[str]:
    return set(os.listdir("/sys/class/net"))


@pytest.mark.slow
def test_devices_talk_through_their_namespaces_and_teardown_removes_them(
    tmp_path: Path,
) -> None:
    cluster = ClusterSpec(
        "c",
        (
            DeviceSpec("a", 1, 1.0, bandwidth_bps=100e6, latency_s=0.002),
            DeviceSpec("b", 1, 1.0, bandwidth_bps=10e6),
        ),
    )
    before = links()
    out = SPAWN.Queue()
    with Emulator(cluster, f"t{uuid.uuid4().hex[:8]}", network=True, state_dir=tmp_path) as emu:
        if emu.net is None:
            pytest.skip(f"network emulation unavailable: {emu.notes.get('network')}")
        namespaces = emu.net.namespaces
        assert set(namespaces) <= set(list_namespaces())
        a, b = emu.slot(0), emu.slot(1)
        assert a.ip != b.ip and a.netns != b.netns
        # Shaping: device b's downlink (root-side veth) and uplink (inside its namespace).
        down = subprocess.run(
            ["tc", "qdisc", "show", "dev", emu.net.host_veth(1)], capture_output=True, text=True
        ).stdout
        up = subprocess.run(
            ["tc", "-n", b.netns or "", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in down and "rate 10Mbit" in down
        assert "tbf" in up and "rate 10Mbit" in up

        # Device b connects to device a's address: namespace to namespace over the bridge.
        server = SPAWN.Process(target=server_child, args=(a, out))
        server.start()
        emu.attach(0, server.pid)  # type: ignore[arg-type]
        kind, port = out.get(timeout=60)
        assert kind == "port"
        client = SPAWN.Process(target=client_child, args=(b, a.ip, port, out))
        client.start()
        emu.attach(1, client.pid)  # type: ignore[arg-type]
        results = dict((item[0], item[1:]) for item in (out.get(timeout=60) for _ in range(2)))
        assert results["got"] == (b"hello", "eth0")
        assert results["peer"] == (b.ip,)  # it really came from b's namespace

        # The root namespace reaches the devices at the bridge address (rendezvous store).
        assert emu.bridge_ip is not None
        with socket.socket() as store:
            store.bind((emu.bridge_ip, 0))
            store.listen(1)
            client = SPAWN.Process(
                target=client_child, args=(a, emu.bridge_ip, store.getsockname()[1], out)
            )
            client.start()
            conn, (peer, _) = store.accept()
            with conn:
                conn.sendall(b"store")
            assert peer == a.ip
            assert out.get(timeout=60)[1] == b"store"
        server.join(timeout=10)
        client.join(timeout=10)
    assert not set(namespaces) & set(list_namespaces())
    assert links() == before  # bridge and veths are gone
    assert list(tmp_path.iterdir()) == []


def test_latency_report_is_honest_about_netem(tmp_path: Path) -> None:
    cluster = ClusterSpec("c", (DeviceSpec("a", 1, 1.0, latency_s=0.005),))
    with Emulator(cluster, f"t{uuid.uuid4().hex[:8]}", network=True, state_dir=tmp_path) as emu:
        if emu.net is None:
            pytest.skip(f"network emulation unavailable: {emu.notes.get('network')}")
        report = "\n".join(emu.report())
        qdisc = subprocess.run(
            ["tc", "qdisc", "show", "dev", emu.net.host_veth(0)], capture_output=True, text=True
        ).stdout
    # Either the kernel delays the packets, or the communication layer is told to; the
    # report names which, and the latency is never silently dropped.
    if "netem" in qdisc:
        assert "delay 5ms" in qdisc and "link: 5 ms (netem)" in report
        assert emu.comm_latencies() is None
    else:
        assert "latency by the communication layer" in report
        assert "link: 5 ms (latency in the communication layer)" in report
        assert emu.comm_latencies() == (0.005,)
