"""Offloaded packets sized to the shaped links' buckets (``xronos.emulation.netns.gso_cap``)."""

from __future__ import annotations

from xronos.emulation.cluster import DeviceSpec
from xronos.emulation.netns import GSO_DEFAULT, bucket, gso_cap

MSS, HEADERS = 1448, 66
"""A full-size TCP segment on a 1500-byte link and the headers tbf counts again for each
further segment of an offloaded packet (Ethernet 14, IPv4 20, TCP with timestamps 32)."""


def counted(size: int) -> int:
    """The length tbf gives an offloaded packet of ``size`` bytes."""
    segments = -(-size // MSS)
    return size + (segments - 1) * HEADERS


def test_an_offloaded_packet_fits_every_shaped_bucket_whole() -> None:
    for rate in (1e9, 500e6, 200e6, 100e6, 10e6):
        cap = gso_cap((DeviceSpec("a", bandwidth_bps=rate),))
        assert cap is not None and cap % 1024 == 0
        assert counted(cap) <= bucket(rate), rate  # tbf would cut a larger one into frames
        assert cap >= 0.8 * bucket(rate), rate  # and no smaller than it needs to be


def test_the_smallest_bucket_decides_and_unshaped_links_keep_the_default() -> None:
    fast, slow = DeviceSpec("a", bandwidth_bps=1e9), DeviceSpec("b", bandwidth_bps=500e6)
    assert gso_cap((fast, slow)) == gso_cap((slow,)) < gso_cap((fast,))  # type: ignore[operator]
    assert gso_cap((DeviceSpec("a"), DeviceSpec("b", latency_s=0.002))) is None
    # A bucket that holds Linux's own largest packet changes nothing.
    assert bucket(10e9) > GSO_DEFAULT and gso_cap((DeviceSpec("a", bandwidth_bps=10e9),)) is None
