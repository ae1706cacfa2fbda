"""Device names of a torchrun run: unique without configuration, explicit ones kept."""

from __future__ import annotations

from xronos.cli.worker import device_names
from xronos.emulation import ClusterSpec, DeviceSpec


def test_two_raspberry_pis_get_distinct_valid_names() -> None:
    names = device_names([("raspberrypi-0", False), ("raspberrypi-0", False), ("nuc-0", False)])
    assert names == ["raspberrypi-0", "raspberrypi-0-2", "nuc-0"]
    # they make a valid cluster (the old default stopped with "appears twice")
    ClusterSpec(name="torchrun", devices=tuple(DeviceSpec(name=n) for n in names))


def test_host_names_with_dots_become_valid_device_names() -> None:
    names = device_names([("pi.local-0", False), ("pi.local-0", False)])
    assert names == ["pi-local-0", "pi-local-0-2"]
    ClusterSpec(name="torchrun", devices=tuple(DeviceSpec(name=n) for n in names))


def test_explicit_names_are_kept_and_defaults_step_around_them() -> None:
    asked = [("hub-0", False), ("hub-0", True), ("kitchen", True)]
    assert device_names(asked) == ["hub-0-2", "hub-0", "kitchen"]
