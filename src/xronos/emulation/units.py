"""Parsing and printing of the quantities in a cluster spec: memory sizes, link bandwidths
and latencies.

Each parser takes the raw TOML value and returns a number in base units (bytes, bits per
second, seconds), or raises ``ValueError`` with a message that ends in the accepted forms;
the cluster loader adds the file and field in front of it.
"""

from __future__ import annotations

import re

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")

_BYTE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

MEMORY_FORMS = "an integer number of bytes or a string such as 512MiB, 2GiB, 1.5GB"
BANDWIDTH_FORMS = "a string such as 100Mbit, 1Gbit, 500kbit or 12.5MB/s"
LATENCY_FORMS = "a string such as 2ms, 500us or 0.1s"


def _split(value: str, forms: str) -> tuple[float, str]:
    match = _NUMBER_UNIT.match(value)
    if match is None:
        raise ValueError(f"cannot read {value!r}; write {forms}")
    return float(match.group(1)), match.group(2)


def parse_bytes(value: object) -> int:
    """``"2GiB"`` -> 2147483648; a bare integer is a number of bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not a size; write {MEMORY_FORMS}")
    if isinstance(value, int):
        return value
    number, unit = _split(value, MEMORY_FORMS)
    factor = _BYTE_UNITS.get(unit.lower() if unit else "b")
    if factor is None:
        raise ValueError(f"unknown unit {unit!r} in {value!r}; write {MEMORY_FORMS}")
    return round(number * factor)


def parse_bandwidth(value: object) -> float:
    """``"100Mbit"`` -> 1e8 bits per second. Prefixes are decimal, as in ``tc``; ``bit``,
    ``bit/s`` and ``b/s`` count bits, ``B/s`` (capital B) counts bytes."""
    if not isinstance(value, str):
        raise ValueError(f"{value!r} has no unit; write {BANDWIDTH_FORMS}")
    number, unit = _split(value, BANDWIDTH_FORMS)
    if not unit:
        raise ValueError(f"{value!r} has no unit; write {BANDWIDTH_FORMS}")
    if unit.lower() in ("bps", "kbps", "mbps", "gbps"):
        raise ValueError(
            f"{unit!r} in {value!r} is ambiguous (bits or bytes?); write {BANDWIDTH_FORMS}"
        )
    for suffix, bits in (("bit/s", 1.0), ("bit", 1.0), ("B/s", 8.0), ("b/s", 1.0)):
        body = unit[: -len(suffix)]
        if unit.endswith(suffix) or (bits == 1.0 and unit.lower().endswith(suffix)):
            prefix = _PREFIXES.get(body.lower())
            if prefix is not None:
                return number * prefix * bits
    raise ValueError(f"unknown unit {unit!r} in {value!r}; write {BANDWIDTH_FORMS}")


def parse_duration(value: object) -> float:
    """``"2ms"`` -> 0.002 seconds."""
    if not isinstance(value, str):
        raise ValueError(f"{value!r} has no unit; write {LATENCY_FORMS}")
    number, unit = _split(value, LATENCY_FORMS)
    if not unit:
        raise ValueError(f"{value!r} has no unit; write {LATENCY_FORMS}")
    factor = _TIME_UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown unit {unit!r} in {value!r}; write {LATENCY_FORMS}")
    return number * factor


def format_bytes(n: int) -> str:
    """2147483648 -> ``"2.0 GiB"``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def format_bandwidth(bps: float) -> str:
    """1e8 -> ``"100 Mbit/s"``."""
    for unit, factor in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= factor:
            return f"{bps / factor:g} {unit}"
    return f"{bps:g} bit/s"


def format_duration(seconds: float) -> str:
    """0.002 -> ``"2 ms"``."""
    if seconds >= 1:
        return f"{seconds:g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:g} ms"
    return f"{seconds * 1e6:g} us"
