"""``xronos bench --links``: the crossover map — every strategy's step time over
``single``'s against the bandwidth of the links, one full bench run per link.

Each link is its own ``xronos bench`` run (the same code path, the same outputs in
``OUT/<link>/``) with that link given to every device, as ``--bandwidth RATE`` would;
``loopback`` is ``--no-network``. A latency the cluster declares stays where it declares
it unless ``--latency`` is given (then every device gets it, on every link but loopback).
This module parses the list, and turns the runs' ``bench.json`` documents into
``crossover.json``, its markdown table and ``crossover.png``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xronos.emulation.cluster import LinkRequest
from xronos.emulation.units import parse_bandwidth, parse_duration
from xronos.errors import UserError
from xronos.utils import atomic_write_text

LOOPBACK = "loopback"
EXAMPLE = "loopback,1Gbit,500Mbit,200Mbit,100Mbit"
MIN_RATE_BPS = 1000.0
"""The slowest link accepted (as ``--bandwidth``)."""


@dataclass(frozen=True)
class SweepLink:
    """One link of the sweep."""

    label: str
    """``loopback`` or the rate in canonical form (``1Gbit``, ``200Mbit``): the name of the
    run's directory and of its row."""
    bandwidth_bps: float | None
    """None for loopback."""
    latency_s: float | None = None
    """``--latency``, given to every device (None: each keeps its own)."""

    def request(self) -> LinkRequest:
        """What the run asks of the emulator: loopback, or every device on this link."""
        if self.bandwidth_bps is None:
            return LinkRequest(False)
        return LinkRequest(True, self.bandwidth_bps, self.latency_s)


def rate_label(bps: float) -> str:
    """1e9 -> ``1Gbit``, 2e8 -> ``200Mbit``, 1.25e6 -> ``1.25Mbit`` (``tc``'s units)."""
    for unit, factor in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bps >= factor:
            return f"{bps / factor:g}{unit}"
    return f"{bps:g}bit"


def parse_links(text: str, latency: str | None = None) -> list[SweepLink]:
    """``--links`` (and ``--latency``) -> the sweep, in the order given.

    Raises:
        UserError: one line naming the bad entry and the fix; nothing has run then.
    """
    words = [w.strip() for w in text.split(",")]
    if not any(words):
        raise UserError(f"--links: none given; give loopback and/or rates, e.g. {EXAMPLE}")
    delay = None
    if latency is not None:
        try:
            delay = parse_duration(latency)
        except ValueError as e:
            raise UserError(f"--latency: {e}") from None
        if not 0 <= delay <= 10:
            raise UserError(f"--latency {latency}: outside [0, 10 s]; give e.g. 2ms")
    out: list[SweepLink] = []
    for word in words:
        if not word:
            raise UserError(f"--links {text!r}: an empty entry; separate links by one comma")
        if word.lower() == LOOPBACK:
            link = SweepLink(LOOPBACK, None)
        else:
            try:
                rate = parse_bandwidth(word)
            except ValueError as e:
                raise UserError(
                    f"--links: {word!r} is neither loopback nor a rate ({e}); e.g. {EXAMPLE}"
                ) from None
            if not (math.isfinite(rate) and rate >= MIN_RATE_BPS):
                raise UserError(f"--links: {word!r} is below 1kbit/s; give e.g. 200Mbit or 1Gbit")
            link = SweepLink(rate_label(rate), rate, delay)
        same = [o for o in out if o.label == link.label]
        if same:
            raise UserError(f"--links: {word!r} is given twice (as {link.label}); give each once")
        out.append(link)
    if delay is not None and all(link.bandwidth_bps is None for link in out):
        raise UserError(
            "--latency applies to the rated links and --links has only loopback; drop "
            "--latency or add a rate to --links"
        )
    return out


# ----------------------------------------------------------------------------- record


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def mechanisms(bench: Mapping[str, Any]) -> dict[str, Any]:
    """The emulation in force during one run: the report's mechanism lines and each
    device's link, from ``bench.json``."""
    emulation = bench.get("emulation") or {}
    return {
        **(emulation.get("mechanisms") or {}),
        "links": {link["name"]: link["link"] for link in emulation.get("links") or []},
    }


def _over(interval: Any) -> list[float] | None:
    """A speed-up interval over ``single`` as the interval of step ÷ ``single`` (None
    where the run gave none)."""
    lo, hi = (_num(v) for v in interval) if interval else (None, None)
    return [1 / hi, 1 / lo] if lo and hi else None


def link_entry(link: SweepLink, bench: Mapping[str, Any]) -> dict[str, Any]:
    """One row of ``crossover.json`` from that link's ``bench.json``."""
    strategies: Mapping[str, Mapping[str, Any]] = bench.get("strategies", {})
    rows: dict[str, Any] = {}
    for name, entry in strategies.items():
        speedup = _num(entry.get("speedup_vs_single"))
        rows[name] = {
            "step_time_s": _num(entry.get("step_time_s")),
            "step_over_single": 1 / speedup if speedup else None,
            "step_over_single_interval": _over(entry.get("speedup_vs_single_interval")),
            "predicted_step_time_s": _num(entry.get("predicted_step_time_s")),
            "loss_matches_single": entry.get("loss_matches_single"),
        }
    auto = strategies.get("auto", {})
    ran = (auto.get("auto") or {}).get("ran") or {}
    # single's step (measured, or the fastest device's solo step when single did not run)
    single = [r["step_time_s"] / r["step_over_single"] for r in rows.values() if _ok(r)]
    return {
        "link": link.label,
        "bandwidth_bps": link.bandwidth_bps,
        "latency_s": {d["name"]: d.get("latency_s") for d in bench.get("links") or []},
        "dir": link.label,
        "single_step_time_s": single[0] if single else None,
        "strategies": rows,
        "auto_chosen": auto.get("chosen"),
        "auto_ran": ran.get("strategy") if isinstance(ran, dict) else None,
        "auto_vs_best_other": bench.get("auto_vs_best_other"),
        "emulation": mechanisms(bench),
    }


def _ok(row: Mapping[str, Any]) -> bool:
    return bool(row.get("step_time_s") and row.get("step_over_single"))


def crossover(
    links: Sequence[SweepLink], benches: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]
) -> dict[str, Any]:
    """``crossover.json``: ``meta`` (scenario, model, cluster, command) and one entry per
    link, in the order run."""
    first = benches[0] if benches else {}
    return {
        "scenario": first.get("scenario"),
        "model": first.get("model"),
        "strategies": list(first.get("strategies", {})),
        "workload": first.get("workload"),
        **meta,
        "links": [link_entry(link, b) for link, b in zip(links, benches, strict=True)],
    }


def format_table(doc: Mapping[str, Any]) -> str:
    """The markdown table: one row per link, each strategy's step time ÷ single's (marked
    ``†`` where its loss left single's: it trained another model), auto's pick, single's
    step time for scale and, where auto ran, its step ÷ the best other strategy's with
    that ratio's 95 % interval; a line under the table explains the mark."""
    names: list[str] = list(doc.get("strategies", []))
    against = "auto" in names
    head = ["link", *names, "auto's pick", "single s/step"]
    head += ["auto ÷ best other (95 %)"] if against else []
    rule = "|---|" + "---:|" * len(names) + "---|---:|" + ("---|" if against else "")
    out = ["| " + " | ".join(head) + " |", rule]
    marked = False
    for entry in doc.get("links", []):
        rows = entry["strategies"]
        cells = [entry["link"]]
        for name in names:
            row = rows.get(name) or {}
            ratio = row.get("step_over_single")
            mark = "†" if row.get("loss_matches_single") is False else ""
            marked = marked or bool(mark)
            cells.append(f"{ratio:.2f}{mark}" if ratio is not None else "—")
        pick = entry.get("auto_chosen") or "—"
        if entry.get("auto_ran") and entry.get("auto_ran") != entry.get("auto_chosen"):
            pick += f" (ran {entry['auto_ran']})"
        single = entry.get("single_step_time_s")
        cells += [pick, f"{single:.3f}" if single else "—"]
        if against:
            cells.append(_against(entry.get("auto_vs_best_other")))
        out.append("| " + " | ".join(cells) + " |")
    if marked:  # a blank line, then the footnote under the table
        out += [
            "",
            "† its loss left single's (bench.json: loss_gap_vs_single): not the same training",
        ]
    return "\n".join(out) + "\n"


def _against(found: Mapping[str, Any] | None) -> str:
    """``1.052 (0.981–1.103) vs xronos``, or — where auto had nothing to be judged by."""
    if not found or found.get("ratio") is None:
        return "—"
    interval = found.get("interval")
    spread = f" ({interval[0]:.3f}–{interval[1]:.3f})" if interval else ""
    return f"{found['ratio']:.3f}{spread} vs {found['best_other']}"


def clear_outputs(out_dir: Path) -> None:
    """Remove a previous sweep's ``crossover.*`` so that none is left beside runs it does
    not describe while this sweep runs (they are written once every link has run)."""
    for name in ("crossover.json", "crossover.png"):
        (out_dir / name).unlink(missing_ok=True)


def write_outputs(out_dir: Path, doc: Mapping[str, Any]) -> None:
    """``crossover.json`` and ``crossover.png`` in ``out_dir``."""
    from xronos.metrics.plot import plot_crossover

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "crossover.json", json.dumps(doc, indent=2))
    plot_crossover(out_dir / "crossover.png", doc)
