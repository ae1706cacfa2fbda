"""Network emulation: one namespace per device behind a bridge, shaped with tc. Runs only
where ``ip netns`` works (root with iproute2)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import threading
import time
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


SWAP_BYTES = 256 * 1024
"""One activation all-reduce of the 2-core scenarios in bf16 (256 × 512 × 2 bytes)."""
SWAPS = 15


def swap_child(slot: DeviceSlot, host: str | None, port: int, out: Any) -> None:
    """Exchange SWAP_BYTES with the peer SWAPS times, a pause before each (the bucket
    refills), both directions at once, as the two-device all-reduce does; the server side
    (``host`` None) reports its port, then each exchange's seconds."""
    slot.enter(configure_torch=False)
    if host is None:
        with socket.socket() as s:
            s.bind((slot.ip, 0))
            s.listen(1)
            out.put(s.getsockname()[1])
            conn, _ = s.accept()
    else:
        conn = socket.create_connection((host, port), timeout=10)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf, payload, times = bytearray(SWAP_BYTES), bytes(SWAP_BYTES), []
    with conn:
        for _ in range(SWAPS):
            time.sleep(0.015)
            t = time.perf_counter()
            sender = threading.Thread(target=conn.sendall, args=(payload,))
            sender.start()
            view, got = memoryview(buf), 0
            while got < SWAP_BYTES:
                got += conn.recv_into(view[got:], SWAP_BYTES - got)
            sender.join()
            times.append(time.perf_counter() - t)
    if host is None:
        out.put(times)


@pytest.mark.slow
def test_a_shaped_link_takes_each_message_its_time_on_the_wire(tmp_path: Path) -> None:
    rate = 1e9
    cluster = ClusterSpec("c", tuple(DeviceSpec(n, 1, 1.0, bandwidth_bps=rate) for n in ("a", "b")))
    with Emulator(cluster, f"t{uuid.uuid4().hex[:8]}", network=True, state_dir=tmp_path) as emu:
        if emu.net is None:
            pytest.skip(f"network emulation unavailable: {emu.notes.get('network')}")
        out = SPAWN.Queue()
        a, b = emu.slot(0), emu.slot(1)
        server = SPAWN.Process(target=swap_child, args=(a, None, 0, out))
        server.start()
        port = out.get(timeout=60)
        client = SPAWN.Process(target=swap_child, args=(b, a.ip, port, out))
        client.start()
        times = sorted(out.get(timeout=120))
        server.join(timeout=10)
        client.join(timeout=10)
        stats = subprocess.run(
            ["ip", "-j", "-s", "-n", a.netns or "", "link", "show", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
    sent = json.loads(stats)[0]["stats64"]["tx"]
    # a's uplink carried its 15 × 256 KiB and the acknowledgements of b's, and the veth
    # counts the packets it is handed. Offloaded packets pass the bucket whole
    # (xronos.emulation.netns.gso_cap: up to 54 KiB here; ~23 KiB on average measured, TCP
    # sizing them by its window); cut by tbf into 1448-byte frames they were 2,637, and
    # every frame crossed the host's network path on its own, on the devices' CPUs.
    assert sent["bytes"] >= SWAPS * SWAP_BYTES
    assert sent["packets"] < SWAPS * SWAP_BYTES / 8192, stats
    # Each direction carries the payload in ~1448-byte segments, 1514 bytes a frame as tbf
    # counts them: ~274 KB, 2.19 ms at 1 Gbit/s. The bucket lets 62.5 KB of it pass at once
    # after the pause (0.5 ms of traffic), so the wire alone takes at least ~1.7 ms; a busy
    # host only makes an exchange slower. A bucket of 2 ms of traffic (250 KB) passed the
    # exchange in ~0.5 ms, as fast as no link at all.
    wire_s = SWAP_BYTES / 1448 * 1514 * 8 / rate
    assert times[len(times) // 2] >= 0.75 * wire_s, times
